// Whole-tensor reductions (sum, mean, max, sum of squares) and their
// gradients, shared by the CPU and CUDA backends.
//
// ReduceOp<kind> is the math of a reduction: what each element contributes
// (transform), how partial results combine, the identity, and the final
// value from the total. Both backends reduce in a fixed order that depends
// only on the element count (never on the thread count or device), so a
// result is reproducible run to run:
//   CPU: fixed chunks of kReduceChunk elements, 16 interleaved accumulators per
//        chunk (vector lanes), partials in double for the sums, combined in chunk order;
//   CUDA: a grid fixed by n, block partials in scratch, then one block (two passes).
// max propagates NaN (a NaN is "greater" than any number), as PyTorch does;
// its gradient goes to the FIRST maximum (ArgMax below breaks ties by index).
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/half.h"
#include "kernels/backend.h"

namespace tessera {

inline constexpr int64_t kReduceChunk = int64_t(1) << 14;

// a > b in the order used by max: NaN above every number, equal NaNs tie.
TESSERA_HD bool reduce_greater(float a, float b) {
  return a > b || (a != a && b == b);
}

// x is the maximum m (as max computes it): equal, or both NaN. With reduce_greater
// this is the order in which "the first maximum" is the first x[i] matching m.
TESSERA_HD bool reduce_matches_max(float x, float m) {
  return x == m || (x != x && m != m);
}

template <ReduceKind K>
struct ReduceOp {
  static constexpr bool kIsMax = K == ReduceKind::max;
  template <typename A>
  static TESSERA_HD A identity() {
    return kIsMax ? A(-bits_float(0x7f800000u)) : A(0);
  }
  template <typename A>
  static TESSERA_HD A transform(float x) {
    if constexpr (K == ReduceKind::sum_squares) return A(x) * A(x);
    return A(x);
  }
  template <typename A>
  static TESSERA_HD A combine(A a, A b) {
    if constexpr (kIsMax) return reduce_greater(float(b), float(a)) ? b : a;
    return a + b;
  }
  template <typename A>
  static TESSERA_HD float finalize(A total, int64_t n) {
    if constexpr (K == ReduceKind::mean) return float(total / A(n));  // NaN for an empty tensor, as 0/0
    return float(total);
  }
};

// (value, index) of the first maximum so far.
struct ArgMax {
  float value;
  int64_t index;

  static TESSERA_HD ArgMax identity() { return {-bits_float(0x7f800000u), INT64_MAX}; }
  // The greater value; on a tie, the lower index.
  static TESSERA_HD ArgMax combine(const ArgMax& a, const ArgMax& b) {
    if (reduce_greater(b.value, a.value)) return b;
    if (reduce_greater(a.value, b.value)) return a;
    return b.index < a.index ? b : a;
  }
};

// grad_x[i] for sum, mean and sum of squares; grad_out [1] f32 is read where it lives.
template <typename T, ReduceKind K>
struct ReduceBackward {
  const T* x;  // read only for sum_squares
  const float* grad_out;
  T* grad_x;
  float count;  // n, for mean
  TESSERA_HD void operator()(int64_t i) const {
    const float g = grad_out[0];
    float value;
    if constexpr (K == ReduceKind::sum_squares)
      value = 2.0f * to_float(x[i]) * g;
    else if constexpr (K == ReduceKind::mean)
      value = g / count;
    else
      value = g;
    grad_x[i] = from_float<T>(value);
  }
};

// grad_x[i] = grad_out at the first maximum (index *argmax, computed on the device), 0 elsewhere.
template <typename T>
struct MaxBackward {
  const int64_t* argmax;
  const float* grad_out;
  T* grad_x;
  TESSERA_HD void operator()(int64_t i) const {
    const int64_t first = argmax[0];
    const float g = grad_out[0];
    grad_x[i] = from_float<T>(i == first ? g : 0.0f);
  }
};

// Calls fn(std::integral_constant<ReduceKind, kind>{}), so launchers pick a
// compile-time ReduceKind from the runtime one.
template <typename Fn>
void dispatch_reduce_kind(ReduceKind kind, Fn&& fn) {
  switch (kind) {
    case ReduceKind::sum:
      return fn(std::integral_constant<ReduceKind, ReduceKind::sum>{});
    case ReduceKind::mean:
      return fn(std::integral_constant<ReduceKind, ReduceKind::mean>{});
    case ReduceKind::max:
      return fn(std::integral_constant<ReduceKind, ReduceKind::max>{});
    case ReduceKind::sum_squares:
      return fn(std::integral_constant<ReduceKind, ReduceKind::sum_squares>{});
  }
}

}  // namespace tessera
