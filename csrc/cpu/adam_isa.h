// The CPU AdamW kernel's entry points, one per instruction set. Each is compiled
// in its own translation unit (adam_isa_*.cpp) and chosen at run time by
// cpu_adam.cpp, so the extension runs on any x86-64 and uses AVX-512 where present.
#pragma once
#include <stdint.h>

namespace mz {

// Scalars of one step, folded the way torch.optim.AdamW folds them
// (in double precision, then rounded to float once).
struct AdamScalars {
  float decay;          // 1 - lr * weight_decay
  float one_minus_b1;   // lerp weight of exp_avg
  float beta2;
  float one_minus_b2;   // addcmul value of exp_avg_sq
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

enum LowKind : int { kLowNone = 0, kLowBF16 = 1, kLowF16 = 2 };

// A contiguous slice of the flat tensors; `low` is the bf16/fp16 copy (or null).
struct AdamRange {
  float* p;
  float* m;
  float* v;
  const float* g;
  uint16_t* low;
  int low_kind;
  int64_t n;
};

void adam_range_default(const AdamRange& r, const AdamScalars& s);
void adam_range_avx2(const AdamRange& r, const AdamScalars& s);
void adam_range_avx512(const AdamRange& r, const AdamScalars& s);

}  // namespace mz
