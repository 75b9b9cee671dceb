"""ninfer_core._cpu (csrc/cpu): the quantized matmul and the fp32 decode ops, against float64 math
and their torch references, on random inputs with NaN-poisoned outputs.

The matmul runs on every instruction set this CPU has (AVX-512, AVX2, the portable copy), with
every format the formats docstring of ops/quant.py allows: int8 per row / per group, int4 groups,
offsets or not, fp32 / fp16 / bf16 scales, odd row counts, 1..16 activation rows, bias.
Skipped where the extension is not built (NINFER_CPU=OFF, no compiler).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_core.cache.kv_pool import KVLayer
from ninfer_core.ops import activation, attention, dispatch, quant, rope
from ninfer_core.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from ninfer_core.ops.quant import QuantizedWeight, dequantize, dequantize_ref, quant_linear, quantize

pytestmark = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")

ISAS = ["avx512bf16", "avx512", "avx2", "generic"]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    ext = dispatch.cpu_extension()
    best = ext.isa()
    if ext.use_isa(request.param) != request.param:
        ext.use_isa(best)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    ext.use_isa(best)


def _weight(kind: str, n: int, k: int, group: int, scale_dtype: torch.dtype, offsets: bool, seed: int) -> QuantizedWeight:
    """Random codes (every value, including the extremes) and scales / offsets of mixed magnitudes."""
    g = torch.Generator().manual_seed(seed)
    if kind == "int4":
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    shape = (n, k // group) if group else (n,)
    scales = (torch.rand(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(scale_dtype)
    extra = torch.randn(shape, generator=g).to(scale_dtype) if offsets else None
    return QuantizedWeight(kind, codes, scales, group, extra)


def _weights64(qw: QuantizedWeight) -> torch.Tensor:
    """The float64 weights of the format (ops/quant.py docstring), decoded independently."""
    raw = qw.qweight.numpy()
    if qw.kind == "int4":
        codes = np.empty((raw.shape[0], raw.shape[1] * 2))
        codes[:, 0::2], codes[:, 1::2] = raw & 15, raw >> 4
    else:
        codes = raw.astype(np.float64)
    group = qw.group_size or codes.shape[1]
    scale = np.repeat(qw.scales.double().numpy().reshape(codes.shape[0], -1), group, axis=1)
    if qw.offsets is not None:
        offset = np.repeat(qw.offsets.double().numpy().reshape(codes.shape[0], -1), group, axis=1)
    else:
        offset = -8 * scale if qw.kind == "int4" else 0
    return torch.from_numpy(codes * scale + offset)


FORMATS = [  # kind, group, scale dtype, offsets
    ("int8", 0, torch.float32, False),  # the GPU int8 format
    ("int4", 128, torch.bfloat16, False),  # the GPU int4 format
    ("int4", 32, torch.float16, True),  # Q4_1 / Q4_K
    ("int4", 32, torch.float16, False),  # Q4_0
    ("int4", 64, torch.float32, True),
    ("int8", 16, torch.float16, False),  # Q6_K
    ("int8", 32, torch.float16, True),  # Q5_1 / Q5_K
    ("int8", 48, torch.bfloat16, False),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-g{f[1]}-{str(f[2])[6:]}{'-offsets' if f[3] else ''}")
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
def test_quant_matmul_matches_float64(isa, fmt, rows, monkeypatch):
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    kind, group, scale_dtype, offsets = fmt
    k = 384 if group != 48 else 480
    qw = _weight(kind, 37, k, group, scale_dtype, offsets, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(37, generator=g)
    assert qw.cpu_plan is not None
    out = torch.full((rows, 37), float("nan"))
    dispatch.cpu_extension().quant_matmul(out.data_ptr(), x.data_ptr(), bias.data_ptr(), rows, 37, 1, False, *qw.cpu_plan)
    exact = x.double() @ _weights64(qw).T + bias.double()
    magnitude = (x.double().square() @ _weights64(qw).square().T).sqrt()  # the scale of fp32 summation error
    assert not out.isnan().any()
    assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-6 * exact.abs()).all()
    # the public op: the same kernel, any leading dims, x in another dtype
    torch.testing.assert_close(quant_linear(x.view(1, rows, k), qw, bias), out.view(1, rows, 37), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-g{f[1]}-{str(f[2])[6:]}{'-offsets' if f[3] else ''}")
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int8_activations_match_their_float64_reference(isa, fmt, rows, monkeypatch):
    """The decode path of compact CPU weights: x quantized per block of 32 (quantize_activations_ref),
    integer products, scales in fp32. k = 576 / 544 leave AVX-512 a partial last chunk; the
    48-wide groups straddle chunks and run the exact kernel instead."""
    kind, group, scale_dtype, offsets = fmt
    k = {"int4": 576, "int8": 544}[kind] if group in (16, 32) else 480 if group == 48 else 384
    qw = _weight(kind, 37, k, group, scale_dtype, offsets, seed=rows)
    g = torch.Generator().manual_seed(200 + rows)
    x = torch.randn(rows, k, generator=g) * torch.exp(2 * torch.randn(rows, k, generator=g))  # outliers
    x[0, 32:64] = 0  # a block of zeros: scale 0
    bias = torch.randn(37, generator=g)
    out = torch.full((rows, 37), float("nan"))
    dispatch.cpu_extension().quant_matmul(out.data_ptr(), x.data_ptr(), bias.data_ptr(), rows, 37, 1, True, *qw.cpu_plan)
    assert not out.isnan().any()
    ref = quant.quant_linear_a8_ref(x, qw, bias) if group != 48 else x.double() @ _weights64(qw).T + bias.double()
    magnitude = (x.double().square() @ _weights64(qw).square().T).sqrt()
    assert ((out.double() - ref).abs() <= 1e-5 * magnitude + 1e-6 * ref.abs()).all()
    # and it is the exact product up to the activations' rounding, at most half a step per input
    exact = x.double() @ _weights64(qw).T + bias.double()
    half_step = quant.quantize_activations_ref(x)[1].double().repeat_interleave(32, -1) / 2
    assert ((out.double() - exact).abs() <= half_step @ _weights64(qw).abs().T + 1e-5 * magnitude).all()
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "int8")
    torch.testing.assert_close(quant_linear(x, qw, bias), out, rtol=0, atol=0)  # the op with NINFER_CPU_MATH=int8


def test_activation_quantization_reference():
    x = torch.tensor([[0.5, -1.0, 0.25, 1 / 254] + [0.0] * 28])
    codes, scales = quant.quantize_activations_ref(x)
    assert scales.tolist() == [[pytest.approx(1 / 127)]]
    assert codes[0, :4].tolist() == [64, -127, 32, 0]  # 63.5 and 0.5 round half to even
    assert quant.quantize_activations_ref(torch.zeros(1, 32))[0].abs().sum() == 0


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
def test_threads_give_the_same_bits(isa, int8):
    qw = _weight("int4", 1000, 512, 32, torch.float16, True, seed=1)
    x = torch.randn(4, 512)
    outs = []
    for threads in (1, 2, 3, 7):  # 7: more threads than cores, blocks of 2 and 3 tasks, taken over by others
        out = torch.full((4, 1000), float("nan"))
        dispatch.cpu_extension().quant_matmul(out.data_ptr(), x.data_ptr(), 0, 4, 1000, threads, int8, *qw.cpu_plan)
        outs.append(out)
    assert all(torch.equal(outs[0], other) for other in outs[1:])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-g{f[1]}-{str(f[2])[6:]}{'-offsets' if f[3] else ''}")
def test_dequantize_kernel_is_the_reference_bit_for_bit(isa, fmt):
    kind, group, scale_dtype, offsets = fmt
    qw = _weight(kind, 45, 480 if group == 48 else 256, group, scale_dtype, offsets, seed=7)
    assert qw.cpu_plan is not None
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(qw, dtype), dequantize_ref(qw, dtype))
    # code * scale + offset in fp32: the product exact for 16-bit scales, one rounding per operation
    exact = _weights64(qw)
    assert (dequantize_ref(qw, torch.float64) - exact).abs().max() <= 2**-23 * exact.abs().max()



@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_dequantize_to_bf16_rounds_as_torch_at_the_edges(isa, kind):
    """bf16 tiles where rounding is easy to get wrong (ties, overflow, NaN, fp32 subnormals, which
    AVX512-BF16's conversion would flush): weights of code +-1 (int4: 0 or 1, zero offsets) times a
    scale at such a value, every other value plain, bit for bit torch's .to(bfloat16) (a NaN as a
    NaN: torch's own bits for one differ between its scalar and vector conversions)."""
    edges = NARROW_EDGES[torch.bfloat16] + [float("-nan"), 1e-40, -3e-39, 2.0 ** -126, 2.0 ** -133, 0.0, -0.0]
    g = torch.Generator().manual_seed(4)
    group = 16 if kind == "int8" else 32
    scales = torch.rand(8, 64, generator=g) * 4 - 2
    scales.view(-1)[torch.randperm(scales.numel(), generator=g)[: len(edges)]] = torch.tensor(edges)
    codes = torch.randint(-1 if kind == "int8" else 0, 2, (8, 64 * group), generator=g, dtype=torch.int8)
    if kind == "int4":  # two codes a byte
        nibbles = codes.to(torch.uint8)
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    qw = QuantizedWeight(kind, codes, scales, group, None if kind == "int8" else torch.zeros_like(scales))
    assert qw.cpu_plan is not None
    out = dequantize(qw, torch.bfloat16)

    def bits(t: torch.Tensor) -> torch.Tensor:  # zeros as +0: the kernel adds the (zero) offset
        return torch.where(t == 0, torch.zeros_like(t), t).view(torch.int16)

    want = dequantize_ref(qw, torch.bfloat16)
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()
    assert torch.equal(bits(out[~want.isnan()]), bits(want[~want.isnan()]))
    assert (out.float().abs() < 2.0 ** -126).logical_and(out != 0).any()
    ext = dispatch.cpu_extension()
    ext.use_isa("generic")  # and every instruction set to the bit, a NaN's included
    assert torch.equal(out.view(torch.int16), dequantize(qw, torch.bfloat16).view(torch.int16))


def test_many_rows_multiply_the_dequantized_weight(monkeypatch):
    """Past CPU_GEMV_ROWS (prefill) the product is a GEMM over the dequantized weight, a tile of
    weight rows at a time (here 256 rows: three tiles, the last one short): fp32 with
    NINFER_CPU_MATH=exact, else bf16 where the CPU has bf16 arithmetic (fp32 sums, a bf16 result)."""
    monkeypatch.setattr(quant, "CPU_PREFILL_TILE_BYTES", 256 * 4 * 1024)
    qw = _weight("int4", 600, 1024, 32, torch.float16, True, seed=3)
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(2, 9, 1024, generator=gen), torch.randn(600, generator=gen)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    # against float64: fp32 sums of 1,024 products in any order, within 8 sqrt(K) ulps of sum |x w|
    weight = dequantize_ref(qw, torch.float64)
    want = torch.nn.functional.linear(x.double(), weight, bias.double())
    bound = 8 * 2**-23 * 1024**0.5 * torch.nn.functional.linear(x.double().abs(), weight.abs()) + 1e-6
    assert ((quant_linear(x, qw, bias).double() - want).abs() <= bound).all()
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    narrow = torch.bfloat16 if dispatch.cpu_native_bf16() else torch.float32
    product = x.to(narrow).double() @ dequantize_ref(qw, narrow).double().T
    magnitude = (x.double().square() @ _weights64(qw).square().T).sqrt()
    error = (quant_linear(x, qw, bias).double() - bias.double() - product).abs()
    assert (error <= 2**-8 * product.abs() + 1e-5 * magnitude).all()


def test_what_the_kernel_cannot_run_takes_the_reference(monkeypatch):
    odd = quantize(torch.randn(8, 40), "int8")  # a 40-wide row is not whole vectors of 16
    assert odd.cpu_plan is None
    x = torch.randn(2, 40)
    assert torch.equal(quant_linear(x, odd), quant.quant_linear_ref(x, odd))
    qw = _weight("int4", 16, 64, 32, torch.float16, True, seed=2)
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    assert torch.equal(quant_linear(x.new_ones(1, 64), qw), quant.quant_linear_ref(x.new_ones(1, 64), qw))
    with pytest.raises(ValueError, match="does not divide"):
        dispatch.cpu_extension().quant_matmul(0, 0, 0, 1, 16, 1, False, *(qw.cpu_plan[:3] + (64, 48) + qw.cpu_plan[5:]))


# ---------------------------------------------------------------- the fp32 decode ops


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_kernels_match_reference(zero_centered):
    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(3, 576, generator=g) for _ in range(3))
    normed, summed = add_rmsnorm(x, residual, weight[0], 1e-5, zero_centered=zero_centered)
    ref_normed, ref_summed = add_rmsnorm_ref(x, residual, weight[0], 1e-5, zero_centered=zero_centered)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rmsnorm(x, weight[0], 1e-5, zero_centered=zero_centered),
                               rmsnorm_ref(x, weight[0], 1e-5, zero_centered=zero_centered), rtol=1e-6, atol=1e-6)
    inplace = x.clone()  # out = x, residual_out = residual: the decode layer's in-place form
    res = residual.clone()
    add_rmsnorm(inplace, res, weight[0], 1e-5, zero_centered=zero_centered, out=inplace, residual_out=res)
    torch.testing.assert_close(inplace, ref_normed, rtol=1e-6, atol=1e-6)
    assert torch.equal(res, ref_summed)


def test_silu_mul_matches_reference():
    x = torch.randn(2, 5, 3072) * 4
    torch.testing.assert_close(activation.silu_mul(x), activation.silu_mul_ref(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_matches_reference(rotary_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 64, generator=g)
    cos, sin = torch.randn(2, 3, rotary_dim, generator=g), torch.randn(2, 3, rotary_dim, generator=g)
    torch.testing.assert_close(rope.apply_rotary(x, cos, sin), rope.apply_rotary_ref(x, cos, sin), rtol=1e-6, atol=1e-6)


def _cache(pages: int = 12, page_size: int = 4, kv_heads: int = 2, dim: int = 64) -> KVLayer:
    g = torch.Generator().manual_seed(2)
    return KVLayer(torch.randn(pages, page_size, kv_heads, dim, generator=g),
                   torch.randn(pages, page_size, kv_heads, dim, generator=g))


# Values where rounding to a 16-bit float is easy to get wrong: ties to even, overflow, fp16's subnormals.
NARROW_EDGES = {
    torch.bfloat16: [float("nan"), float("inf"), 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(2.0 ** 127) * 1.999],
    torch.float16: [float("-nan"), float("inf"), 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 65519.0, 65520.0, -65536.0,
                    2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 2.0 ** -25, 1.5 * 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26,
                    -(2.0 ** -24) * 2.5, 1e-30, -0.0],
}


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_copies_rows_to_their_slots(cache_dtype):
    """fp32 rows into an fp32 cache, or rounded into a bf16 / fp16 one as torch's .to() rounds: ties to
    even, overflow, subnormals, values across fp16's exponents; NaN a NaN (fp16: torch's bits too)."""
    kv, ref = (KVLayer(c.k.to(cache_dtype), c.v.to(cache_dtype)) for c in (_cache(), _cache()))
    k, v = torch.randn(2, 3, 2, 64), torch.randn(2, 3, 2, 64)
    edges = NARROW_EDGES.get(cache_dtype, [float("nan")])
    k[0, 0, 0, : len(edges)] = torch.tensor(edges)
    v[1, 2] = torch.randn(2, 64) * torch.pow(2.0, torch.randint(-30, 18, (2, 64)).float())  # 2^-30 .. 2^17
    slots = torch.tensor([[5, 6, 7], [40, 41, 2]])
    attention.write_kv(kv, k, v, slots)
    attention.write_kv_ref(ref, k, v, slots)
    torch.testing.assert_close(kv.k, ref.k, rtol=0, atol=0, equal_nan=True)  # (bf16: NaN's bits may differ)
    assert torch.equal(kv.v, ref.v) and kv.k.isnan().sum() == 1
    if cache_dtype == torch.float16:
        assert torch.equal(kv.k.view(torch.int16), ref.k.view(torch.int16))


@pytest.mark.parametrize("num_new", [1, 4])  # decode, a speculative verify
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_reference(num_new, threads, monkeypatch):
    """GQA (6 query heads on 2 kv heads), two sequences of different lengths over scattered pages."""
    monkeypatch.setattr(dispatch, "cpu_threads", lambda: threads)
    kv = _cache()
    q = torch.randn(2, num_new, 6, 64)
    table = torch.tensor([[7, 2, 9, 0, 11, 4], [1, 3, 5, 6, 8, 10]], dtype=torch.int32)
    lens = torch.tensor([13, 2])
    out = torch.full_like(q, float("nan"))
    attention.decode_attention(q, kv, table, lens, 0.125, out=out)
    torch.testing.assert_close(out, attention.attention_ref(q, kv, table, lens, 0.125), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_new", [1, 3])
@pytest.mark.parametrize("dim", [64, 36])  # 36: a tail after the vectors of every instruction set
def test_decode_attention_over_chunks_of_keys(isa, num_new, dim, cache_dtype, monkeypatch):
    """Keys split into chunks of 256 whose softmax sums are merged: sequences of 700, 255 and 5 keys
    (three chunks, one chunk to the token, one short one) against the float64 reference; the
    threads split the chunks, and the bits do not depend on how many."""
    pages, page_size, kv_heads = 540, 4, 2
    g = torch.Generator().manual_seed(5)
    kv = KVLayer(torch.randn(pages, page_size, kv_heads, dim, generator=g).to(cache_dtype),
                 (torch.randn(pages, page_size, kv_heads, dim, generator=g) * 3).to(cache_dtype))
    q = torch.randn(3, num_new, 6, dim, generator=g) * 2
    table = torch.randperm(pages, generator=g).to(torch.int32)[: 3 * 180].view(3, 180)  # 720 tokens each
    lens = torch.tensor([700, 256 - num_new, 5])
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(dispatch, "cpu_threads", lambda threads=threads: threads)
        out = torch.full_like(q, float("nan"))
        attention.decode_attention(q, kv, table, lens, dim ** -0.5, out=out)
        outs.append(out)
    as64 = KVLayer(kv.k.double(), kv.v.double())
    want = attention.attention_ref(q.double(), as64, table, lens, dim ** -0.5)
    torch.testing.assert_close(outs[0].double(), want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(outs[0], other) for other in outs[1:])



@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_attention_tokens_of_a_step_equal_each_token_alone(isa, cache_dtype, monkeypatch):
    """A step's new tokens share each chunk's K / V rows (a 16-bit cache's widened once for all of
    them); every token still gets, to the bit, what it gets as a decode step of its own over its own
    context: 11 tokens from 250 (crossing the chunk at 256), from 509 (crossing 512), from 3."""
    monkeypatch.setattr(dispatch, "cpu_threads", lambda: 2)
    pages, page_size, kv_heads, dim, num_new = 300, 4, 2, 64, 11
    g = torch.Generator().manual_seed(11)
    kv = KVLayer(torch.randn(pages, page_size, kv_heads, dim, generator=g).to(cache_dtype),
                 (torch.randn(pages, page_size, kv_heads, dim, generator=g) * 3).to(cache_dtype))
    q = torch.randn(3, num_new, 6, dim, generator=g) * 2
    table = torch.randint(0, pages, (3, 200), generator=g, dtype=torch.int32)  # 800 tokens each
    lens = torch.tensor([250, 509, 3])
    together = torch.full_like(q, float("nan"))
    attention.decode_attention(q, kv, table, lens, dim ** -0.5, out=together)
    for t in range(num_new):
        alone = torch.full_like(q[:, t:t + 1], float("nan"))
        attention.decode_attention(q[:, t:t + 1].contiguous(), kv, table, lens + t, dim ** -0.5, out=alone)
        assert torch.equal(together[:, t:t + 1], alone), t
    as64 = KVLayer(kv.k.double(), kv.v.double())
    want = attention.attention_ref(q.double(), as64, table, lens, dim ** -0.5)
    torch.testing.assert_close(together.double(), want, rtol=1e-5, atol=1e-5)

def test_silu_mul_prefill_rows_take_torch(monkeypatch):
    """The CPU kernel takes decode-sized row counts; a prefill's rows go to torch's vectorized ops."""
    real = dispatch.cpu_extension()
    calls = []

    class Recording:
        def silu_mul(self, *args):
            calls.append(args[2])
            return real.silu_mul(*args)

    monkeypatch.setattr(dispatch, "cpu_extension", lambda: Recording())
    small, large = torch.randn(activation.CPU_KERNEL_MAX_ROWS, 64), torch.randn(activation.CPU_KERNEL_MAX_ROWS + 1, 64)
    torch.testing.assert_close(activation.silu_mul(small), activation.silu_mul_ref(small), rtol=1e-6, atol=1e-6)
    assert torch.equal(activation.silu_mul(large), activation.silu_mul_ref(large))
    assert calls == [activation.CPU_KERNEL_MAX_ROWS]
