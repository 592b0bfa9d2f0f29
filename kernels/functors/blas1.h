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

// y[i] += alpha·x[i].
template <typename T>
struct Axpy {
  const T* x;
  T* y;
  float alpha;
  TESSERA_HD void operator()(int64_t i) const { y[i] = from_float<T>(to_float(y[i]) + alpha * to_float(x[i])); }
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
