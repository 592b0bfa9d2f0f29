// Casts and BLAS-1 style helpers (cast, scale_, axpy, add) as index functors,
// shared by the CPU and CUDA backends. Loads convert to f32, stores round to
// the destination dtype (round to nearest even, core/half.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/half.h"

namespace tessera {

// y[i] = x[i] converted from S to D; a same-dtype cast copies the bits.
template <typename S, typename D>
struct Cast {
  const S* x;
  D* y;
  TESSERA_HD void operator()(int64_t i) const {
    if constexpr (std::is_same_v<S, D>)
      y[i] = x[i];
    else
      y[i] = from_float<D>(to_float(x[i]));
  }
};

// x[i] ·= alpha.
template <typename T>
struct Scale {
  T* x;
  float alpha;
  TESSERA_HD void operator()(int64_t i) const { x[i] = from_float<T>(to_float(x[i]) * alpha); }
};

// y[i] += alpha·x[i]. Y is X (same dtype) or float: a low-precision x added
// into an f32 accumulator (how modules add a bf16/f16 parameter gradient into
// the f32 main gradient).
template <typename X, typename Y = X>
struct Axpy {
  const X* x;
  Y* y;
  float alpha;
  TESSERA_HD void operator()(int64_t i) const { y[i] = from_float<Y>(to_float(y[i]) + alpha * to_float(x[i])); }
};

// out[i] = a[i] + b[i] (out may be a or b: each element is read before it is written).
template <typename T>
struct Add {
  const T* a;
  const T* b;
  T* out;
  TESSERA_HD void operator()(int64_t i) const { out[i] = from_float<T>(to_float(a[i]) + to_float(b[i])); }
};

}  // namespace tessera
