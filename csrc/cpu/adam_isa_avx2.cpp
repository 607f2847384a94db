// AVX2 + FMA + F16C build of the AdamW kernel; only called when the CPU reports all three.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#define MZ_HAVE_FMA 1

#include "adam_math.h"

static void cast_f16_avx2(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  cast_f16_soft(x + i, out + i, n - i);
}

void mz::adam_range_avx2(const AdamRange& r, const AdamScalars& s) {
  adam_range(r, s, cast_f16_avx2);
}
#endif
