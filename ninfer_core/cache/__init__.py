"""KV pages and GDN state slots shared by the running sequences.

The exports load on first use (PEP 562), so `cache.sizes` (the torch-free byte arithmetic of
`ninfer show` and the hub's fit estimates) imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "KVPool": "kv_pool",
    "DEFAULT_PAGE_SIZE": "manager",
    "CacheManager": "manager",
    "ModelCache": "manager",
    "SequenceCache": "manager",
    "StatePool": "state_pool",
    "StateSnapshot": "state_pool",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
