"""Models from the Hugging Face hub: pull (download + verify), a local registry, aliases, fit estimates,
and the catalog of every model this machine can run by name (pulled, added local paths, embedded).

No UI here: long operations report through `events` callbacks (the CLI draws progress bars from
them, the TUI wizard its own widgets).
"""

from .aliases import ALIASES, Alias, alias_for_repo, resolve_alias
from .catalog import CatalogModel, LocalModels, find_model, list_models, locate
from .errors import HubError, HubOfflineError, IntegrityError, ModelNotFoundError, PullCancelled
from .events import Done, Event, EventCallback, Failed, FileStarted, FileVerified, Progress, PullStarted, Retry
from .estimate import fit_for
from .fit import FitEstimate, GpuMemory, count_params, estimate_fit, local_gpu
from .pull import PullOptions, pull
from .registry import ModelEntry, Registry, remove_model, resolve_local
from .retry import RetryPolicy
from .verify import FileCheck, VerifyReport, verify

__all__ = [
    "ALIASES", "Alias", "alias_for_repo", "resolve_alias",
    "CatalogModel", "LocalModels", "find_model", "list_models", "locate",
    "HubError", "HubOfflineError", "IntegrityError", "ModelNotFoundError", "PullCancelled",
    "Done", "Event", "EventCallback", "Failed", "FileStarted", "FileVerified", "Progress", "PullStarted", "Retry",
    "fit_for", "FitEstimate", "GpuMemory", "count_params", "estimate_fit", "local_gpu",
    "PullOptions", "pull",
    "ModelEntry", "Registry", "remove_model", "resolve_local",
    "RetryPolicy",
    "FileCheck", "VerifyReport", "verify",
]
