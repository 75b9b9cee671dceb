"""Hot ops: each runs an extension's kernel when it applies (`ninfer_core._C` on CUDA,
`ninfer_core._cpu` on the CPU), else its torch reference.

Layers call these functions, never the extensions directly; `dispatch` holds the one rule that
picks kernel or reference (NINFER_DISABLE_KERNELS=1 forces the references).
"""

from .dispatch import kernels_available
from .rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref

__all__ = [
    "add_rmsnorm",
    "add_rmsnorm_ref",
    "kernels_available",
    "rmsnorm",
    "rmsnorm_ref",
]
