"""Block-scaled FP8 weights (Qwen's and DeepSeek's `quant_method: fp8` releases).

A weight W [..., N, K] stored as float8 comes with a companion `<name>_scale_inv` tensor of shape
[..., ceil(N / bn), ceil(K / bk)] for the block size [bn, bk] of `weight_block_size`; the blocks at
the bottom and right edges may be partial. Despite its name the scale is *multiplied*:
W_real[r, c] = W_fp8[r, c] * scale[r // bn, c // bk] (transformers' finegrained_fp8 and vLLM's
block FP8 loaders agree). A single-element scale is a per-tensor scale.
"""

from __future__ import annotations

import torch

from ..errors import ModelLoadError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})  # safetensors header dtype codes
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default
DEQUANT_DEFAULT_DTYPE = torch.bfloat16  # the unquantized dtype of Qwen's releases


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`; fused `experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`."""
    return weight_name + SCALE_SUFFIX


def block_size_from_quantization(quantization: dict | None, where: str) -> tuple[int, int]:
    """The [rows, cols] block of a `quantization_config`; only block-scaled FP8 is supported."""
    if not quantization:
        return DEFAULT_BLOCK
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(
            f"{where}: quantization method '{method}' is not supported (supported: block-scaled 'fp8')"
        )
    block = quantization.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ModelLoadError(f"{where}: invalid weight_block_size {block!r} (expected two positive integers)")
    return block[0], block[1]


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, name: str
) -> torch.Tensor:
    """W * scale per block, computed in fp32 (exact for e4m3 x bf16 scales), returned in `dtype`."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return (w * s.reshape(())).to(dtype)
    rows, cols = weight.shape[-2:]
    bn, bk = block
    expected = (*weight.shape[:-2], -(-rows // bn), -(-cols // bk))
    if tuple(s.shape) != expected:
        raise ModelLoadError(
            f"tensor '{scale_name(name)}': shape {tuple(s.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {list(block)} (expected {expected})"
        )
    per_element = s.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]
    return w.mul_(per_element).to(dtype)
