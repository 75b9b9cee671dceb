"""The Triton kernels of ops/moe_triton.py (module level: Triton resolves helper kernels as globals).
Importing this module needs Triton.

The weights are the MMA's A operand when SWAP (out^T = W x^T: a tile of BLOCK_N weight rows is
the M side, so a block of 16-32 slots still fills Hopper's 64-row warpgroup MMA); else x is A.
int4 codes are never interleaved in registers: byte j of a row holds inputs 2j (low nibble) and
2j + 1 (high nibble), so the low nibbles multiply x's even columns and the high nibbles its odd
columns, two dots over half-width tiles. Codes become bf16 / fp16 exactly by OR-ing the nibble
into the mantissa of 128 (1024) and subtracting 136 (1032); the group's scale multiplies the tile's
fp32 product (BLOCK_K never spans two groups; int8 with one scale a row: the
finished product), so no weight is multiplied in the inner loop.
"""

import triton
import triton.language as tl


@triton.jit
def _as_float(codes, dtype: tl.constexpr):
    """int4 nibbles 0..15 -> code - 8 in `dtype`, exactly."""
    if dtype == tl.bfloat16:
        return (codes.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
    elif dtype == tl.float16:
        return (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    else:
        return (codes.to(tl.float32) - 8.0).to(dtype)


@triton.jit
def _dot(w, x_ptrs, x_mask, acc, SWAP: tl.constexpr):
    """acc + w [BN, K] times x [BM, K] (loaded through x_ptrs: [K, BM] when SWAP, else [BM, K])."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if SWAP:
        return tl.dot(w, x, acc)
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _tile_product(w_base, s_base, rows, a_ptr, a_rows, valid, k0, k, stride_am, stride_wn, stride_sn,
                  INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                  dtype: tl.constexpr):
    """One K tile's fp32 product of weight rows `rows` and the block's x rows: [BN, BM] when SWAP,
    else [BM, BN], times its group's scales (GROUP 0, int8 only: one scale a row, the caller's)."""
    if SWAP:
        part = tl.zeros((rows.shape[0], a_rows.shape[0]), tl.float32)
    else:
        part = tl.zeros((a_rows.shape[0], rows.shape[0]), tl.float32)
    if INT4:
        j = tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_base + rows[:, None] * stride_wn + (k0 // 2 + j)[None, :],
                         mask=(k0 // 2 + j)[None, :] < k // 2, other=136)
        even = k0 + 2 * j
        if SWAP:
            ptrs = a_ptr + a_rows[None, :] * stride_am + even[:, None]
            mask = valid[None, :] & (even[:, None] < k)
        else:
            ptrs = a_ptr + a_rows[:, None] * stride_am + even[None, :]
            mask = valid[:, None] & (even[None, :] < k)
        part = _dot(_as_float(packed & 15, dtype), ptrs, mask, part, SWAP)
        part = _dot(_as_float(packed >> 4, dtype), ptrs + 1, mask, part, SWAP)
        part = part * _scale(s_base, rows, stride_sn, k0 // GROUP, SWAP)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_base + rows[:, None] * stride_wn + kk[None, :], mask=kk[None, :] < k, other=0)
        if SWAP:
            ptrs = a_ptr + a_rows[None, :] * stride_am + kk[:, None]
            mask = valid[None, :] & (kk[:, None] < k)
        else:
            ptrs = a_ptr + a_rows[:, None] * stride_am + kk[None, :]
            mask = valid[:, None] & (kk[None, :] < k)
        part = _dot(codes.to(dtype), ptrs, mask, part, SWAP)
        if GROUP:
            part = part * _scale(s_base, rows, stride_sn, k0 // GROUP, SWAP)
    return part


@triton.jit(do_not_specialize=["num_slots"])  # one compiled kernel for every token count
def grouped_gemm(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, experts_ptr, used_ptr,
                 num_slots, rows_per_a, n, k, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                 up_offset,
                 GATE_UP: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, SWAP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    a_rows = tl.where(valid, slots // rows_per_a, 0)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(cols < n, cols, 0)
    dtype = a_ptr.dtype.element_ty
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for k0 in range(0, k, BLOCK_K):
        acc += _tile_product(w_base, s_base, rows, a_ptr, a_rows, valid, k0, k, stride_am, stride_wn, stride_sn,
                             INT4, GROUP, BLOCK_K, SWAP, dtype)
        if GATE_UP:
            acc_up += _tile_product(w_base, s_base, rows + up_offset, a_ptr, a_rows, valid, k0, k, stride_am,
                                    stride_wn, stride_sn, INT4, GROUP, BLOCK_K, SWAP, dtype)
    if not GROUP:  # int8 with one scale a row
        acc = acc * _scale(s_base, rows, stride_sn, 0, SWAP)
        if GATE_UP:
            acc_up = acc_up * _scale(s_base, rows + up_offset, stride_sn, 0, SWAP)
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if SWAP:
        ptrs = out_ptr + slots[None, :].to(tl.int64) * stride_om + cols[:, None]
        mask = valid[None, :] & (cols[:, None] < n)
    else:
        ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + cols[None, :]
        mask = valid[:, None] & (cols[None, :] < n)
    tl.store(ptrs, acc.to(dtype), mask=mask)


@triton.jit
def _scale(s_base, rows, stride_sn, group, SWAP: tl.constexpr):
    """The rows' scales of one group, shaped to multiply a product tile."""
    scale = tl.load(s_base + rows * stride_sn + group).to(tl.float32)
    if SWAP:
        return scale[:, None]
    return scale[None, :]
