// AVX-512F build of the AdamW kernel; only called when the CPU reports AVX-512F.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx2,fma,f16c,prefer-vector-width=512")
#include <immintrin.h>
#define MZ_HAVE_FMA 1

#include "adam_math.h"

static void cast_f16_avx512(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
  cast_f16_soft(x + i, out + i, n - i);
}

void mz::adam_range_avx512(const AdamRange& r, const AdamScalars& s) {
  adam_range(r, s, cast_f16_avx512);
}
#endif
