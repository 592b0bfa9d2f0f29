// CpuBackend: whole-tensor reductions and their gradients (math in
// kernels/functors/reduce.h). The tensor is cut into fixed chunks of
// kReduceChunk elements whatever the thread count; each chunk is reduced by
// kLanes interleaved accumulators (so the loop vectorises), sums in double;
// chunk partials are combined in chunk order. The result is therefore the
// same for any number of threads.
#include "kernels/functors/reduce.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

constexpr int kLanes = 16;

int64_t chunk_count(int64_t n) {
  return (n + kReduceChunk - 1) / kReduceChunk;
}

// Reduction of x[begin, end) with accumulator type A.
template <ReduceKind K, typename A, typename T>
A reduce_chunk(const T* x, int64_t begin, int64_t end) {
  using Op = ReduceOp<K>;
  A lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = Op::template identity<A>();
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lanes[j] = Op::combine(lanes[j], Op::template transform<A>(to_float(x[i + j])));
  }
  A total = Op::template identity<A>();
  for (int j = 0; j < kLanes; ++j) total = Op::combine(total, lanes[j]);
  for (; i < end; ++i) total = Op::combine(total, Op::template transform<A>(to_float(x[i])));
  return total;
}

template <ReduceKind K, typename T>
float reduce_all(const T* x, int64_t n) {
  using Op = ReduceOp<K>;
  using A = std::conditional_t<K == ReduceKind::max, float, double>;
  std::vector<A> partials(size_t(chunk_count(n)));
  parallel_for(chunk_count(n), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c)
      partials[size_t(c)] = reduce_chunk<K, A>(x, c * kReduceChunk, std::min(n, (c + 1) * kReduceChunk));
  });
  A total = Op::template identity<A>();
  for (const A& partial : partials) total = Op::combine(total, partial);
  return Op::finalize(total, n);
}

// Index of the first maximum, in three steps that each run at memory speed:
// the maximum m (reduce_all), which chunks hold an element matching m (in
// parallel, vectorised), then the first match within the first such chunk.
// The same answer as the GPU's ArgMax reduction (ties go to the lower index).
template <typename T>
int64_t first_max_index(const T* x, int64_t n) {
  const float m = reduce_all<ReduceKind::max>(x, n);
  std::vector<uint8_t> found(size_t(chunk_count(n)));
  parallel_for(chunk_count(n), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      int any = 0;
      const int64_t end = std::min(n, (c + 1) * kReduceChunk);
#pragma omp simd reduction(| : any)
      for (int64_t i = c * kReduceChunk; i < end; ++i) any |= int(reduce_matches_max(to_float(x[i]), m));
      found[size_t(c)] = uint8_t(any);
    }
  });
  for (int64_t c = 0; c < chunk_count(n); ++c) {
    if (!found[size_t(c)]) continue;
    for (int64_t i = c * kReduceChunk; i < std::min(n, (c + 1) * kReduceChunk); ++i)
      if (reduce_matches_max(to_float(x[i]), m)) return i;
  }
  return 0;  // not reached: m is one of the elements (n > 0 is checked by ops::)
}

}  // namespace

void CpuBackend::reduce(ReduceKind kind, const Tensor& x, Tensor& out) {
  dispatch_float(x.dtype(), "reduce", [&](auto tag) {
    using T = decltype(tag);
    dispatch_reduce_kind(kind, [&](auto k) { out.data<float>()[0] = reduce_all<decltype(k)::value>(x.data<T>(), x.numel()); });
  });
}

// x is undefined for sum and mean.
void CpuBackend::reduce_backward(ReduceKind kind, const Tensor& x, const Tensor& grad_out, Tensor& grad_x) {
  const float* g = grad_out.data<float>();
  dispatch_float(grad_x.dtype(), "reduce_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = grad_x.numel();
    T* gx = grad_x.data<T>();
    if (kind == ReduceKind::max) {
      const int64_t first_max = first_max_index(x.data<T>(), n);
      cpu_for_each_index(n, MaxBackward<T>{&first_max, g, gx});
      return;
    }
    const T* xs = x.defined() ? x.data<T>() : nullptr;
    dispatch_reduce_kind(kind, [&](auto k) {
      constexpr ReduceKind K = decltype(k)::value;
      if constexpr (K != ReduceKind::max) cpu_for_each_index(n, ReduceBackward<T, K>{xs, g, gx, float(n)});
    });
  });
}

}  // namespace tessera
