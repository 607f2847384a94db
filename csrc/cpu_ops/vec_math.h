// Element-wise math written so that GCC vectorises the loops that call it: no
// branches, no library calls, only float arithmetic and one integer shift.
// The hot loops live in functions marked MZ_CLONES, which GCC compiles once per
// instruction set and picks at load time (an AVX-512 CPU gets 16-wide loops; any
// x86-64 runs the default clone). No -ffast-math: sums keep their order.
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MZ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MZ_CLONES
#endif

namespace mz {

// exp(x) in float, within 2 ulp of expf for x in [-87.3, 88.4]; exactly 0 below
// (a masked score); above, it saturates at exp(88.4) (callers subtract a row max).
static inline float exp_f32(float x) {
  const float lo = -87.33654f, hi = 88.37626f;
  const float keep = x < lo ? 0.0f : 1.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite split of ln2)
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return keep * (p * scale);
}

// tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|): no overflow for any u.
static inline float tanh_f32(float u) {
  const float e = exp_f32(-2.0f * __builtin_fabsf(u));
  return __builtin_copysignf((1.0f - e) / (1.0f + e), u);
}

}  // namespace mz
