"""The Triton kernels of ops/moe_triton.py (grouped MoE GEMMs) and ops/quant_triton.py (dense GEMMs):
module level, because Triton resolves helper kernels as globals. Importing this module needs Triton."""

import triton
import triton.language as tl


@triton.jit
def weight_tile(w_ptr, s_ptr, rows, k0, k, stride_wn, stride_sn,
                 INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of one expert's weight rows `rows`, columns k0.., dequantized."""
    if INT4:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + half[None, :], mask=half[None, :] < k // 2, other=136)
        low = (packed & 15).to(tl.float32) - 8.0
        high = (packed >> 4).to(tl.float32) - 8.0
        codes = tl.reshape(tl.join(low, high), (rows.shape[0], BLOCK_K))
        scale = tl.load(s_ptr + rows * stride_sn + k0 // GROUP).to(tl.float32)
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=cols[None, :] < k, other=0)
        codes = codes.to(tl.float32)
        if GROUP:  # int8 with groups (GGUF's Q8_0): BLOCK_K never spans two
            scale = tl.load(s_ptr + rows * stride_sn + k0 // GROUP).to(tl.float32)
        else:
            scale = tl.load(s_ptr + rows * stride_sn).to(tl.float32)
    return tl.trans((codes * scale[:, None]).to(dtype))


@triton.jit(do_not_specialize=["num_slots"])  # one compiled kernel for every token count
def grouped_gemm(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, experts_ptr, used_ptr,
                 num_slots, rows_per_a, n, k, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                 up_offset,
                 GATE_UP: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < k),
                    other=0.0)
        acc += tl.dot(x, weight_tile(w_base, s_base, rows, k0, k, stride_wn, stride_sn, INT4, GROUP, BLOCK_K,
                                      dtype))
        if GATE_UP:
            acc_up += tl.dot(x, weight_tile(w_base, s_base, rows + up_offset, k0, k, stride_wn, stride_sn, INT4,
                                             GROUP, BLOCK_K, dtype))
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    mask = valid[:, None] & (cols[None, :] < n)
    tl.store(out_ptr + slots[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype), mask=mask)


@triton.jit
def quant_gemm(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, m, n, k, stride_am, stride_wn, stride_sn, stride_om,
               INT4: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [m, n] = a [m, k] @ W^T (+ bias) for one quantized [n, k] weight. Programs of one weight
    tile are adjacent (the row tile varies fastest), so its other row tiles read it from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    a_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = a_rows < m
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(cols < n, cols, 0)
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < k), other=0.0)
        acc += tl.dot(x, weight_tile(w_ptr, s_ptr, rows, k0, k, stride_wn, stride_sn, INT4, GROUP, BLOCK_K, dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    mask = valid[:, None] & (cols[None, :] < n)
    tl.store(out_ptr + a_rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype), mask=mask)
