// Embedding lookup and its gradient as row functors (kernels/functors/row_group.h),
// shared by the CPU and CUDA backends.
//
// Forward: one row per token, out[n, :] = table[ids[n], :].
//
// Backward, deterministic without float atomics. The launcher first groups
// the tokens by id with a STABLE sort: sorted_ids[k] ascending and order[k],
// the token position of the k-th sorted id, positions ascending within an id
// (CPU: a counting sort; CUDA: cub::DeviceRadixSort, which is stable). Then
// one row functor per sorted position k: the position that starts a run of
// equal ids owns that vocabulary row; it adds the run's gradient rows to it in
// token order, accumulating in f32 and rounding once, and every other position
// returns at once. Each table element is written by one lane of one group, in
// the same order on both backends, so CPU and GPU agree bit for bit (any dtype) and
// repeated runs agree exactly. Parallel over distinct ids × columns.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "kernels/functors/row_group.h"

namespace tessera {

// out [N, D] from table [V, D], which holds rows [begin, begin + V) of a
// vocabulary of `total` (begin 0, total V: the whole table). An id outside
// [0, total) gives a NaN row (the CPU throws before launching; on CUDA nothing
// is checked, so it surfaces in the loss); an id held by another shard a zero
// row (vocabulary-parallel embedding: the shards' rows are summed).
template <typename T, typename I>
struct EmbeddingForward {
  const I* ids;
  const T* table;
  T* out;
  int64_t vocab, dim, begin, total;
  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t n) const {
    const int64_t id = int64_t(ids[n]), row = id - begin;
    T* dst = out + n * dim;
    if (id < 0 || id >= total || row < 0 || row >= vocab) {
      const T fill = (id < 0 || id >= total) ? from_float<T>(bits_float(0x7fc00000u)) : from_float<T>(0.0f);
      for (int64_t d = g.lane(); d < dim; d += kGroupLanes<Group>) dst[d] = fill;
      return;
    }
    const T* src = table + row * dim;
    for (int64_t d = g.lane(); d < dim; d += kGroupLanes<Group>) dst[d] = src[d];
  }
};

// grad_table[v − begin, :] += Σ_{n: ids[n] = v} grad_out[n, :], sums in token
// order. kColumns consecutive columns per lane per sweep (registers on a GPU,
// a vector or two on the CPU). Ids outside the table's rows [begin, begin + V)
// are skipped.
template <typename T, typename I, int kColumns>
struct EmbeddingBackward {
  const I* sorted_ids;   // [N], ascending
  const int64_t* order;  // [N], token positions, ascending within equal ids
  const T* grad_out;     // [N, D]
  T* grad_table;         // [V, D]
  int64_t tokens, vocab, dim, begin;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t k) const {
    const I id = sorted_ids[k];
    if (k > 0 && sorted_ids[k - 1] == id) return;  // not the first of its run
    const int64_t local = int64_t(id) - begin;
    if (local < 0 || local >= vocab) return;
    int64_t end = k + 1;
    while (end < tokens && sorted_ids[end] == id) ++end;
    T* row = grad_table + local * dim;
    for (int64_t d0 = int64_t(g.lane()) * kColumns; d0 < dim; d0 += kGroupLanes<Group> * kColumns) {
      if (dim - d0 >= kColumns)
        accumulate<true>(row, d0, kColumns, k, end);
      else
        accumulate<false>(row, d0, dim - d0, k, end);
    }
  }

  // row[d0 + j] += Σ_{t in [first, end)} grad_out[order[t], d0 + j] for j < width (= kColumns when kFull).
  template <bool kFull>
  TESSERA_HD void accumulate(T* row, int64_t d0, int64_t width, int64_t first, int64_t end) const {
    float acc[kColumns];
#pragma unroll
    for (int j = 0; j < kColumns; ++j) acc[j] = (kFull || j < width) ? to_float(row[d0 + j]) : 0.0f;
    for (int64_t t = first; t < end; ++t) {
      const T* src = grad_out + order[t] * dim + d0;
#pragma unroll
      for (int j = 0; j < kColumns; ++j)
        if (kFull || j < width) acc[j] += to_float(src[j]);
    }
#pragma unroll
    for (int j = 0; j < kColumns; ++j)
      if (kFull || j < width) row[d0 + j] = from_float<T>(acc[j]);
  }
};

}  // namespace tessera
