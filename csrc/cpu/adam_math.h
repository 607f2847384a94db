// The AdamW element update and the low-precision casts, free of torch and std
// headers so that each ISA translation unit (adam_isa_*.cpp) can compile it
// under its own `#pragma GCC target` without leaking ISA-specific inline code
// into the rest of the extension. Everything here has internal linkage.
#pragma once
#include <stdint.h>

#include "adam_isa.h"

// torch's vectorised lerp/addcmul fuse their last multiply-add; do the same
// where the target has FMA, and round twice (within 1 ulp of it) where not.
// The build uses -ffp-contract=off so nothing else is fused behind our back.
// MZ_HAVE_FMA is set by the ISA translation units that target FMA.
#if MZ_HAVE_FMA
#define MZ_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MZ_FMA(a, b, c) ((a) * (b) + (c))
#endif

namespace {

using mz::AdamScalars;

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even float -> bfloat16, NaN -> 0x7fc0 (c10::BFloat16's rule).
static inline uint16_t bf16_from_float(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

// torch's single-tensor AdamW with the same ops, one rearranged (the step size
// and bias corrections are folded in double by the caller, as adam.py does):
//   p *= decay; m.lerp_(g, 1-b1); v = v*b2 + (1-b2)*g*g;
//   p += -step_size * m / (sqrt(v)/bc2_sqrt + eps)   (rearranged below)
// With kBF16 the bf16 copy of the new p is written in the same loop.
template <bool kBF16>
static inline void adam_update(float* __restrict__ p, float* __restrict__ m,
                               float* __restrict__ v, const float* __restrict__ g,
                               uint16_t* __restrict__ low, int64_t n, const AdamScalars& s) {
  const float decay = s.decay, w1 = s.one_minus_b1, b2 = s.beta2, w2 = s.one_minus_b2;
  const float eps_bc2 = s.eps * s.bc2_sqrt, neg_lr_bc2 = s.neg_step_size * s.bc2_sqrt;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = MZ_FMA(w1, gi - m[i], m[i]);  // torch's lerp for weight < 0.5
    const float vi = MZ_FMA(w2 * gi, gi, v[i] * b2);  // mul_(b2).addcmul_(g, g, 1-b2)
    // torch: -step_size * m / (sqrt(v) / bc2 + eps). Multiplying through by bc2
    // saves a division per element (a third of the arithmetic) for ~1 ulp of
    // the update; with FMA (and beta1 > 0.5) m and v stay bit-identical to torch's.
    const float denom = __builtin_sqrtf(vi) + eps_bc2;
    const float pi = p[i] * decay;  // rounded on its own, as param.mul_ does
    const float pn = pi + neg_lr_bc2 * mi / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
    if (kBF16) low[i] = bf16_from_float(pn);
  }
}

// Round-to-nearest-even float -> IEEE half in software (for CPUs without F16C).
static inline uint16_t half_from_float(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x47800000u)  // >= 65536, inf or nan
    return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x < 0x38800000u)  // below half's smallest normal: let the FPU round the subnormal
    return (uint16_t)(sign | (f32_bits(bits_f32(x) + 0.5f) - 0x3f000000u));
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent (-112 << 23) and round to even
  return (uint16_t)(sign | (x >> 13));
}

static inline void cast_f16_soft(const float* __restrict__ x, uint16_t* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_from_float(x[i]);
}

// One ISA's whole range. bf16 is cast inside the update loop; fp16 (which needs
// F16C instructions) tile by tile, while the tile's new weights are still in L1.
template <typename CastF16>
static inline void adam_range(const mz::AdamRange& r, const AdamScalars& s, CastF16 cast_f16) {
  if (r.low_kind == mz::kLowNone) return adam_update<false>(r.p, r.m, r.v, r.g, nullptr, r.n, s);
  if (r.low_kind == mz::kLowBF16) return adam_update<true>(r.p, r.m, r.v, r.g, r.low, r.n, s);
  constexpr int64_t kTile = 1024;
  for (int64_t off = 0; off < r.n; off += kTile) {
    const int64_t len = r.n - off < kTile ? r.n - off : kTile;
    adam_update<false>(r.p + off, r.m + off, r.v + off, r.g + off, nullptr, len, s);
    cast_f16(r.p + off, r.low + off, len);
  }
}

}  // namespace
