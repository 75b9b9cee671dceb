// Elementwise math on V's vectors for the kernels written over an instruction set (attention_kernels.h,
// gdn_kernels.h): libm's expf is scalar, and a scalar call an element took milliseconds of a step.
#pragma once

namespace ninfer::cpu {
namespace {

template <class V>
struct VectorMath {
  using F = typename V::F;

  // e^x, W at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r from Cephes' degree-6 polynomial (within a
  // few ulp of expf), times 2^n. x is held to [-86, 88], where the 2^n scaling stays normal on every
  // instruction set: e^-86 = 4e-38 adds nothing to sums of terms near 1, and e^88 = 1.7e38 is the largest
  // power of e below fp32's maximum.
  static F exp(F x) {
    x = V::max(x, V::splat(-86.0f));
    x = V::sub(V::splat(0.0f), V::max(V::sub(V::splat(0.0f), x), V::splat(-88.0f)));  // min(x, 88)
    const F n = V::round(V::mul(x, V::splat(1.44269504f)));
    F r = V::fma(n, V::splat(-0.693359375f), x);  // ln2 in two parts, so that r is exact
    r = V::fma(n, V::splat(2.12194440e-4f), r);
    F p = V::splat(1.9875691500e-4f);
    p = V::fma(p, r, V::splat(1.3981999507e-3f));
    p = V::fma(p, r, V::splat(8.3334519073e-3f));
    p = V::fma(p, r, V::splat(4.1665795894e-2f));
    p = V::fma(p, r, V::splat(1.6666665459e-1f));
    p = V::fma(p, r, V::splat(5.0000001201e-1f));
    p = V::fma(p, V::mul(r, r), V::add(r, V::splat(1.0f)));
    return V::times_pow2(p, n);
  }

  // x sigmoid(x) = x / (1 + e^-x); below x = -88 the quotient is under 1e-36 of |x|.
  static F silu(F x) { return V::div(x, V::add(V::splat(1.0f), exp(V::sub(V::splat(0.0f), x)))); }
};

}  // namespace
}  // namespace ninfer::cpu
