"""Hot ops: each runs the CUDA extension's kernel when it applies, else its torch reference.

Layers call these functions, never `ninfer_core._C` directly; `dispatch` holds the one rule
that picks kernel or reference (NINFER_DISABLE_KERNELS=1 forces the references).
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
