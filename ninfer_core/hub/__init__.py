"""Models from the Hugging Face hub: pull (download + verify), a local registry, aliases, fit estimates,
and the catalog of every model this machine can run by name (pulled, added local paths, embedded).

No UI here: long operations report through `events` callbacks (the CLI draws progress bars from
them, the TUI wizard its own widgets). Pulling and verifying (huggingface_hub's network stack,
a third of a second to import) load on first use, so `ninfer ls / show` do not pay for them.
"""

from __future__ import annotations

import importlib
from typing import Any

from .aliases import ALIASES, Alias, alias_for_repo, resolve_alias
from .catalog import CatalogModel, LocalModels, find_model, list_models, locate, pull_needed
from .errors import HubError, HubOfflineError, IntegrityError, ModelNotFoundError, PullCancelled
from .events import Done, Event, EventCallback, Failed, FileStarted, FileVerified, Progress, PullStarted, Retry
from .estimate import fit_for
from .fit import FitEstimate, GpuMemory, count_params, estimate_fit, local_gpu
from .registry import ModelEntry, Registry, remove_model, resolve_local

_LAZY = {"PullOptions": "pulling", "pull": "pulling", "RetryPolicy": "retry",
         "FileCheck": "verifying", "VerifyReport": "verifying", "verify": "verifying"}

__all__ = [
    "ALIASES", "Alias", "alias_for_repo", "resolve_alias",
    "CatalogModel", "LocalModels", "find_model", "list_models", "locate", "pull_needed",
    "HubError", "HubOfflineError", "IntegrityError", "ModelNotFoundError", "PullCancelled",
    "Done", "Event", "EventCallback", "Failed", "FileStarted", "FileVerified", "Progress", "PullStarted", "Retry",
    "fit_for", "FitEstimate", "GpuMemory", "count_params", "estimate_fit", "local_gpu",
    "ModelEntry", "Registry", "remove_model", "resolve_local",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    """The pulling / verifying names, imported on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
