"""Errors of the model hub: each says what failed and what the user can do about it."""

from __future__ import annotations

from ..errors import NinferError


class HubError(NinferError):
    """A pull, verify or registry operation that cannot go on."""


class HubOfflineError(HubError):
    """A download was asked for while HF_HUB_OFFLINE is set."""


class IntegrityError(HubError):
    """A file whose bytes do not match the hub's size or hash: it is never marked ready."""


class PullCancelled(HubError):
    """The caller cancelled a pull; partial files stay on disk and the next pull resumes them."""


class ModelNotFoundError(HubError):
    """A model name that is neither in the local registry nor a known alias, or a repository or
    revision the hub does not have."""
