"""User-facing errors: one clear message, no traceback at the CLI."""


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
