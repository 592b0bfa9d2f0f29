// Dropout as an index functor, shared by the CPU and CUDA backends. The mask
// is never stored: keep(i) = U(seed, kDropoutRngStream, offset + i) >= p is a
// pure function of (seed, offset + i) (core/rng.h), so the backward pass and
// every device regenerate exactly the same mask. Forward and backward are the
// same map (y = keep·x·scale), applied to x and to grad_y respectively.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "core/rng.h"
#include "kernels/ops.h"

namespace tessera {

// 1/(1 − p) for p < 1; 0 for p = 1 (nothing is kept, and nothing is divided by zero).
TESSERA_HD float dropout_scale(float p) {
  return p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
}

TESSERA_HD bool dropout_keep(float p, uint64_t seed, uint64_t index) {
  return philox_uniform(seed, ops::kDropoutRngStream, index) >= p;
}

// out[i] = keep(offset + i) ? in[i]·scale : 0. p = 0 keeps everything (U ≥ 0)
// with scale 1, an exact copy; p = 1 keeps nothing (U < 1).
template <typename T>
struct DropoutApply {
  const T* in;
  T* out;
  float p, scale;
  uint64_t seed, offset;
  // The output for element i whose input is x, in f32. (The CPU runs this on
  // blocks of converted inputs, so its Philox loop vectorises for every T.)
  TESSERA_HD float apply(float x, int64_t i) const {
    return dropout_keep(p, seed, offset + uint64_t(i)) ? x * scale : 0.0f;
  }
  TESSERA_HD void operator()(int64_t i) const { out[i] = from_float<T>(apply(to_float(in[i]), i)); }
};

}  // namespace tessera
