// The bias parts of 2-D convolution (NCHW), for the backends whose
// convolution library does not fuse them: adding bias[K] to y [N, K, P, Q]
// (an index functor) and the bias gradient, Σ over N, P, Q of grad_y per
// channel (a row functor, one row per channel, lanes striding over each
// image's P·Q plane so a warp reads contiguous memory).
#pragma once

#include <cstdint>

#include "core/half.h"
#include "kernels/functors/row_group.h"

namespace tessera {

// y[n, k, p, q] += bias[k]; `plane` = P·Q.
template <typename T>
struct Conv2dBiasAdd {
  T* y;
  const T* bias;
  int64_t channels, plane;
  TESSERA_HD void operator()(int64_t i) const {
    y[i] = from_float<T>(to_float(y[i]) + to_float(bias[i / plane % channels]));
  }
};

// grad_bias[k] (+)= Σ_n Σ_pq grad_y[n, k, pq], summed in f32.
template <typename T>
struct Conv2dBiasGrad {
  const T* grad_y;
  T* grad_bias;
  int64_t batch, channels, plane;
  bool accumulate;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t k) const {
    float partial = 0.0f;
    for (int64_t n = 0; n < batch; ++n) {
      const T* row = grad_y + (n * channels + k) * plane;
      for (int64_t j = g.lane(); j < plane; j += kGroupLanes<Group>) partial += to_float(row[j]);
    }
    const float total = g.sum(partial);
    if (g.lane() == 0) grad_bias[k] = from_float<T>(accumulate ? to_float(grad_bias[k]) + total : total);
  }
};

}  // namespace tessera
