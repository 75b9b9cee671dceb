"""KV pages and GDN state slots shared by the running sequences."""

from .kv_pool import KVPool
from .manager import DEFAULT_PAGE_SIZE, CacheManager, ModelCache, SequenceCache
from .state_pool import StatePool, StateSnapshot

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "CacheManager",
    "KVPool",
    "ModelCache",
    "SequenceCache",
    "StatePool",
    "StateSnapshot",
]
