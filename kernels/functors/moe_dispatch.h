// Token dispatch of the mixture of experts (ops::moe_permute, moe_combine and
// their backwards in kernels/ops.h) as index functors shared by the CPU and
// CUDA backends. A dispatch plan of M slots says where every choice goes:
// pairs[m] = t·K + j, the j-th expert choice of token t, the slots grouped
// by expert (each expert's rows contiguous, for its GEMMs); slot_of[t·K + j]
// = m, or −1 for a choice dropped over capacity. Every functor gathers (no
// atomics): each output element is written by one index, sums run over a
// token's K choices in order, so results do not depend on the launch.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "core/host_device.h"

namespace tessera {

// out[m, c] = x[pairs[m] / K, c].
template <typename T>
struct MoePermute {
  const T* x;
  const int32_t* pairs;
  T* out;
  int64_t width, top_k;
  TESSERA_HD void operator()(int64_t i) const {
    const int64_t m = i / width, c = i % width;
    out[i] = x[(pairs[m] / top_k) * width + c];
  }
};

// grad_x[t, c] = Σ_j grad_slots[slot_of[t, j], c] over the kept choices (f32 sums).
template <typename T>
struct MoePermuteBackward {
  const T* grad_slots;
  const int32_t* slot_of;
  T* grad_x;
  int64_t width, top_k;
  TESSERA_HD void operator()(int64_t i) const {
    const int64_t t = i / width, c = i % width;
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t slot = slot_of[t * top_k + j];
      if (slot >= 0) sum += to_float(grad_slots[int64_t(slot) * width + c]);
    }
    grad_x[i] = from_float<T>(sum);
  }
};

// out[t, c] = Σ_j weights[t, j]·ys[slot_of[t, j], c] over the kept choices
// (a token whose every choice was dropped gets 0).
template <typename T>
struct MoeCombine {
  const T* ys;
  const int32_t* slot_of;
  const float* weights;
  T* out;
  int64_t width, top_k;
  TESSERA_HD void operator()(int64_t i) const {
    const int64_t t = i / width, c = i % width;
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t slot = slot_of[t * top_k + j];
      if (slot >= 0) sum += weights[t * top_k + j] * to_float(ys[int64_t(slot) * width + c]);
    }
    out[i] = from_float<T>(sum);
  }
};

// grad_ys[m, c] = weights[pair]·grad_out[pair / K, c], pair = pairs[m].
template <typename T>
struct MoeCombineBackwardSlots {
  const T* grad_out;
  const int32_t* pairs;
  const float* weights;
  T* grad_ys;
  int64_t width, top_k;
  TESSERA_HD void operator()(int64_t i) const {
    const int64_t m = i / width, c = i % width, pair = pairs[m];
    grad_ys[i] = from_float<T>(weights[pair] * to_float(grad_out[(pair / top_k) * width + c]));
  }
};

// grad_weights[t, j] = Σ_c grad_out[t, c]·ys[slot_of[t, j], c]; 0 for a dropped choice.
template <typename T>
struct MoeCombineBackwardWeights {
  const T* grad_out;
  const T* ys;
  const int32_t* slot_of;
  float* grad_weights;
  int64_t width, top_k;
  TESSERA_HD void operator()(int64_t i) const {
    const int32_t slot = slot_of[i];
    float sum = 0.0f;
    if (slot >= 0) {
      const T* row = grad_out + (i / top_k) * width;
      const T* y = ys + int64_t(slot) * width;
      for (int64_t c = 0; c < width; ++c) sum += to_float(row[c]) * to_float(y[c]);
    }
    grad_weights[i] = sum;
  }
};

}  // namespace tessera
