"""Errors with one clear message, no traceback at the CLI: the user's (NinferError and its kinds)
and the engine's own (EngineError), which the server answers with a 400 and a 500."""

from __future__ import annotations

import logging
import uuid


class NinferError(Exception):
    """An error caused by the user's input (model files, request, flags), not by a bug."""


class ModelLoadError(NinferError):
    """A model directory or file that cannot be loaded: names the file / tensor at fault."""


class ContextLengthError(NinferError):
    """A prompt (plus requested tokens) that does not fit the context or the KV capacity."""

    def __init__(self, message: str, prompt_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class EngineError(Exception):
    """The engine failed a request it had accepted, through no fault of the request (a bug, logits
    that are not finite, a grammar the sampler could not keep): the server's fault, not the user's."""


def logged_internal_error(log: logging.Logger, what: str) -> str:
    """Log the exception being handled, with its traceback, under a fresh id; return a message
    that names only that id (the exception's own text may hold paths or request data)."""
    error_id = f"err_{uuid.uuid4().hex[:24]}"
    log.error("%s (%s)", what, error_id, exc_info=True)
    return f"internal engine error (logged as {error_id})"
