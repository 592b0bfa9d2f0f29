// Index functors that fill a tensor: with a constant, or with uniform or
// normal random values from the counter-based RNG. Run by core/tensor.cpp on
// the CPU and by core/cuda/tensor_fill.cu on a GPU.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "core/rng.h"

namespace tessera {

template <typename T>
struct FillConstant {
  T* out;
  T value;
  TESSERA_HD void operator()(int64_t i) const { out[i] = value; }
};

// out[i] = low + (high - low) * U(seed, stream, first_index + i), kept below
// `high` (float rounding of the product can otherwise land exactly on it).
template <typename T>
struct FillUniform {
  T* out;
  uint64_t seed, stream, first_index;
  float low, high;
  TESSERA_HD void operator()(int64_t i) const {
    const float value = low + (high - low) * philox_uniform(seed, stream, first_index + uint64_t(i));
    out[i] = from_float<T>(value < high ? value : nextafterf(high, low));
  }
};

// out[i] = mean + stddev * N(seed, stream, first_index + i)
template <typename T>
struct FillNormal {
  T* out;
  uint64_t seed, stream, first_index;
  float mean, stddev;
  TESSERA_HD void operator()(int64_t i) const {
    out[i] = from_float<T>(mean + stddev * philox_normal(seed, stream, first_index + uint64_t(i)));
  }
};

}  // namespace tessera
