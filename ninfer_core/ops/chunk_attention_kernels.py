"""The Triton kernels of `chunk_attention` (ops/attention.py). Importing this module needs Triton."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_new", "table_width"])
def chunk_attention(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                    num_new, table_width, scale_log2,
                    stride_qb, stride_qt, stride_qh, stride_kp, stride_kr, stride_kh,
                    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """One program: BLOCK_T query tokens x the GROUP query heads of one kv head (rows packed as
    token-major, head-minor: the K/V tile is read once for all of them), over one split of the
    keys. Online softmax in base 2; with SPLITS > 1 the unnormalised output, max and sum go to the
    workspace for `combine_splits`."""
    tile = tl.program_id(0)
    b = tl.program_id(1) // KV_HEADS
    kv_head = tl.program_id(1) % KV_HEADS
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    t = tile * BLOCK_T + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (t < num_new) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, HEAD_DIM)
    q_rows = b * stride_qb + t * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    cached = tl.load(lens_ptr + b)
    query_pos = cached + t  # query t sees cache indices 0 .. query_pos
    kv_len = cached + tl.minimum((tile + 1) * BLOCK_T, num_new)
    per_split = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = (keys < end) & (keys // PAGE < table_width)
        page = tl.load(table_ptr + b * table_width + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        key_rows = page * stride_kp + (keys % PAGE) * stride_kr + kv_head * stride_kh
        k = tl.load(k_ptr + key_rows[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(key_ok[None, :] & (keys[None, :] <= query_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + key_rows[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # workspace rows: ((split * B + b) * T + t) * H + head
        heads = KV_HEADS * GROUP
        part = ((split * (tl.num_programs(1) // KV_HEADS) + b) * num_new + t) * heads + head
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def combine_splits(part_o_ptr, part_ml_ptr, out_ptr, rows_per_split, heads, num_new,
                   stride_ob, stride_ot, stride_oh,
                   HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """out[row] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s for one (b, t, head) row."""
    row = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, SPLITS)
    m = tl.load(part_ml_ptr + (s * rows_per_split + row) * 2)
    l_s = tl.load(part_ml_ptr + (s * rows_per_split + row) * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    o = tl.load(part_o_ptr + (s[:, None] * rows_per_split + row) * HEAD_DIM + d[None, :])
    total = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(l_s * w, 0), 1e-30)
    head = row % heads
    t = (row // heads) % num_new
    b = row // (heads * num_new)
    tl.store(out_ptr + b * stride_ob + t * stride_ot + head * stride_oh + d, total.to(out_ptr.dtype.element_ty))
