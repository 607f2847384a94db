// Baseline x86-64 / any-CPU build of the AdamW kernel (SSE2 auto-vectorisation).
#include "adam_math.h"

void mz::adam_range_default(const AdamRange& r, const AdamScalars& s) {
  adam_range(r, s, cast_f16_soft);
}
