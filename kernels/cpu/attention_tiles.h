// Causal attention on the CPU, blocked like flash attention so that no T×T
// matrix ever exists: the tile code shared by the training attention
// (kernels/cpu/attention.cpp: a sequence's packed or grouped qkv, causal by
// index) and the blockwise attention of context parallelism
// (kernels/cpu/block_attention.cpp: local queries against one key/value
// block, visibility by global position, f32 outputs accumulated over the
// ring's blocks). Both run the same tiles: 64 query rows meet 64 keys; a pair
// no query sees is skipped, one where some keys are hidden tests each
// position; each tile's products run in a register-blocked f32 micro-kernel
// (GCC vector extensions: AVX-512 with -march=native) on contiguous,
// zero-padded f32 copies of the rows (bf16/f16 are converted when gathered).
// The per-row math (online softmax, probabilities, score gradients) is the
// shared code of kernels/functors/attention.h.
//
// A call's layout is a `Rows` type of the caller's (element offsets of q, k,
// v, out and the statistics); a query head reads its group's keys and values
// in place, never a repeated copy.
//
// Forward: one task per (b, h, query tile), online softmax over key tiles.
// Backward: one task per (b, key/value group): for each of the group's query
// heads in turn, for each key tile, dK and dV accumulate over the query tiles
// that see it into the group's f32 buffers, dQ in a per-head buffer; no two
// tasks write the same output, so results are deterministic. Tasks are dealt
// to one scratch slot per thread, largest first.
//
// Dropout on the attention probabilities (ops::AttentionDropout, the training
// attention's only): once a tile's probabilities are formed, a pass multiplies
// them by the mask (one Philox call per query and four keys); with p = 0 that
// pass, and the backward's masked variant, are never entered.
#pragma once

#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/context.h"
#include "core/parallel_for.h"
#include "kernels/functors/attention.h"
#include "kernels/functors/block_attention.h"
#include "kernels/ops.h"

namespace tessera::cpu_attention {

constexpr int64_t kBlock = 64;  // query rows and keys per tile
constexpr int64_t kLanes = 16;  // floats per vector; tile row lengths are multiples of it

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));

inline int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// C[kRows × 16·kVecs] (+)= op(A)[kRows × k]·B[k × 16·kVecs], accumulators in
// registers; op(A) is A (element (r, p) at a[r·lda + p]) or, with kTransA, Aᵀ
// (at a[p·lda + r]): either way one broadcast per FMA row, so no tile is ever
// transposed in memory.
template <int kRows, int kVecs, bool kTransA, bool kAccumulate>
inline void gemm_micro(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t k) {
  Vec acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      if constexpr (kAccumulate)
        std::memcpy(&acc[r][v], c + r * ldc + v * kLanes, sizeof(Vec));
      else
        acc[r][v] = Vec{};
    }
  for (int64_t p = 0; p < k; ++p) {
    Vec bv[kVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) std::memcpy(&bv[v], b + p * ldb + v * kLanes, sizeof(Vec));
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float s = kTransA ? a[p * lda + r] : a[r * lda + p];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[r][v] += s * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) std::memcpy(c + r * ldc + v * kLanes, &acc[r][v], sizeof(Vec));
}

template <int kVecs, bool kTransA, bool kAccumulate>
void gemm_columns(int64_t m, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                  int64_t ldc) {
  constexpr int kRows = 4;
  // Row r of op(A) starts at a + r·lda, or at a + r when transposed.
  const int64_t row_step = kTransA ? 1 : lda;
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows)
    gemm_micro<kRows, kVecs, kTransA, kAccumulate>(a + i * row_step, lda, b, ldb, c + i * ldc, ldc, k);
  switch (m - i) {
    case 3:
      gemm_micro<3, kVecs, kTransA, kAccumulate>(a + i * row_step, lda, b, ldb, c + i * ldc, ldc, k);
      break;
    case 2:
      gemm_micro<2, kVecs, kTransA, kAccumulate>(a + i * row_step, lda, b, ldb, c + i * ldc, ldc, k);
      break;
    case 1:
      gemm_micro<1, kVecs, kTransA, kAccumulate>(a + i * row_step, lda, b, ldb, c + i * ldc, ldc, k);
      break;
    default:
      break;
  }
}

// C[m × n] (+)= op(A)[m × k]·B[k × n], row-major with leading dimensions lda,
// ldb, ldc; op(A) = A [m × k] or, with kTransA, Aᵀ for A stored [k × m].
// n, ldb and ldc are multiples of kLanes.
template <bool kTransA, bool kAccumulate>
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
          int64_t ldc) {
  for (int64_t j = 0; j < n; j += 4 * kLanes) {
    switch (std::min<int64_t>(4, (n - j) / kLanes)) {
      case 4:
        gemm_columns<4, kTransA, kAccumulate>(m, k, a, lda, b + j, ldb, c + j, ldc);
        break;
      case 3:
        gemm_columns<3, kTransA, kAccumulate>(m, k, a, lda, b + j, ldb, c + j, ldc);
        break;
      case 2:
        gemm_columns<2, kTransA, kAccumulate>(m, k, a, lda, b + j, ldb, c + j, ldc);
        break;
      default:
        gemm_columns<1, kTransA, kAccumulate>(m, k, a, lda, b + j, ldb, c + j, ldc);
        break;
    }
  }
}

// dst[r][d] = scale·src[r·stride + d] for r < rows, d < dim; zero for dim ≤ d < ld.
template <typename T>
void gather_rows(const T* src, int64_t stride, int64_t rows, int64_t dim, float scale, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * stride;
    float* d = dst + r * ld;
    for (int64_t i = 0; i < dim; ++i) d[i] = scale * to_float(s[i]);
    for (int64_t i = dim; i < ld; ++i) d[i] = 0.0f;
  }
}

// dst[d][r] = scale·src[r·stride + d] for r < rows, d < dim; zero for rows ≤ r < kBlock.
template <typename T>
void gather_transposed(const T* src, int64_t stride, int64_t rows, int64_t dim, float scale, float* dst) {
  for (int64_t d = 0; d < dim; ++d) std::fill(dst + d * kBlock + rows, dst + (d + 1) * kBlock, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * stride;
    for (int64_t d = 0; d < dim; ++d) dst[d * kBlock + r] = scale * to_float(s[d]);
  }
}

// Dropout on a forward tile of probabilities, transposed [keys × queries]:
// p_t[j·kBlock + i] *= M[b, h, t0 + i, s0 + j]/(1 − p) for i < rows and
// j < round_up(keys, 4) (s0 is a multiple of 4 and one Philox call gives four
// keys; the tile has room for kBlock keys), query head h numbered within the
// call (attention_dropout_multiplier's mask). A vector lane per query.
inline void drop_transposed_tile(const ops::AttentionDropout& dropout, int64_t b, int64_t h, int64_t t0, int64_t rows,
                                 int64_t s0, int64_t keys, float* p_t) {
  const float scale = dropout_scale(dropout.p);
  for (int64_t j = 0; j < keys; j += 4) {
    float* column = p_t + j * kBlock;
#pragma omp simd
    for (int64_t i = 0; i < rows; ++i) {
      const PhiloxOutput bits = attention_dropout_bits(dropout, b, h, t0 + i, s0 + j);
      for (int k = 0; k < 4; ++k) column[k * kBlock + i] *= attention_dropout_multiplier(dropout.p, scale, bits.v[k]);
    }
  }
}

// The backward's multipliers of the same mask, [queries × keys]:
// mask[i·kBlock + j] = M[b, h, t0 + i, s0 + j]/(1 − p) for i < rows and
// j < round_up(keys, 4), 1 for the rest of the row (past the last key: never
// read). A vector lane per four keys.
inline void dropout_multipliers(const ops::AttentionDropout& dropout, int64_t b, int64_t h, int64_t t0, int64_t rows,
                                int64_t s0, int64_t keys, float* mask) {
  const float scale = dropout_scale(dropout.p);
  const int64_t quads = (keys + 3) / 4;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = mask + i * kBlock;
#pragma omp simd
    for (int64_t q = 0; q < quads; ++q) {
      const PhiloxOutput bits = attention_dropout_bits(dropout, b, h, t0 + i, s0 + 4 * q);
      for (int k = 0; k < 4; ++k) row[4 * q + k] = attention_dropout_multiplier(dropout.p, scale, bits.v[k]);
    }
    std::fill(row + 4 * quads, row + kBlock, 1.0f);
  }
}

// Deals tasks to `slots` lists, largest cost first, each to the least loaded slot.
inline std::vector<std::vector<int64_t>> deal_tasks(const std::vector<int64_t>& costs, int64_t slots) {
  std::vector<int64_t> order(costs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<std::vector<int64_t>> lists(static_cast<size_t>(slots));
  std::vector<int64_t> load(static_cast<size_t>(slots), 0);
  for (const int64_t task : order) {
    const size_t slot = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    lists[slot].push_back(task);
    load[slot] += costs[task];
  }
  return lists;
}

// Runs fn(task, scratch) for every task, one scratch area of `scratch_floats`
// (64-byte aligned) per thread, drawn from the context's host allocator.
template <typename Fn>
void run_tasks(Context& ctx, const std::vector<int64_t>& costs, int64_t scratch_floats, Fn&& fn) {
  const int64_t tasks = int64_t(costs.size());
  if (tasks == 0) return;
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t slots = std::max<int64_t>(1, std::min(threads, tasks));
  const int64_t slot_floats = round_up(scratch_floats, kLanes);
  Tensor scratch = ctx.empty(Shape{slots * slot_floats + kLanes}, DType::f32);
  float* base = scratch.data<float>();
  base += (kLanes - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % kLanes) % kLanes;
  const auto lists = deal_tasks(costs, slots);
  parallel_for(slots, 1, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot)
      for (const int64_t task : lists[size_t(slot)]) fn(task, base + slot * slot_floats);
  });
}

// Where each query and key of a call sits in the sequence, and which key tile
// a query tile sees: key s is visible to query t ⇔ key[s] ≤ query[t]
// (block_key_visible). The training attention passes 0..T−1 for both
// (causal); the blockwise attention its global positions (any set: a zigzag
// pair of chunks, a whole earlier chunk). Both lists are padded to whole
// tiles with kPastEnd, a position every padded query sees and no real query
// does, so a tile's padding is never visible to a real query.
class TilePositions {
 public:
  static constexpr int64_t kPastEnd = INT64_MAX;

  TilePositions(const int64_t* queries, int64_t query_count, const int64_t* keys, int64_t key_count)
      : query_(padded(queries, query_count)), key_(padded(keys, key_count)) {
    query_range_ = tile_ranges(query_, query_count);
    key_range_ = tile_ranges(key_, key_count);
  }
  // 0, 1, …, T − 1 for queries and keys: causal attention within one sequence.
  static TilePositions causal(int64_t seq_len) {
    std::vector<int64_t> positions(static_cast<size_t>(seq_len));
    for (int64_t t = 0; t < seq_len; ++t) positions[size_t(t)] = t;
    return TilePositions(positions.data(), seq_len, positions.data(), seq_len);
  }

  int64_t query_tiles() const { return int64_t(query_range_.size()); }
  int64_t key_tiles() const { return int64_t(key_range_.size()); }
  // Which keys of key tile kb the queries of query tile qb see.
  struct Mask {
    const int64_t* query;  // the query tile's kBlock positions
    const int64_t* key;    // the key tile's kBlock positions
    bool none;             // no query of the tile sees any key of it: skip the pair
    bool partial;          // some pairs hidden: test each; otherwise all visible
  };
  Mask mask(int64_t qb, int64_t kb) const {
    const Range& q = query_range_[size_t(qb)];
    const Range& k = key_range_[size_t(kb)];
    return Mask{query_.data() + qb * kBlock, key_.data() + kb * kBlock, !block_key_visible(q.max, k.min),
                !block_key_visible(q.min, k.max)};
  }
  // How many key tiles query tile qb sees (its forward task's cost).
  int64_t visible_key_tiles(int64_t qb) const {
    int64_t count = 0;
    for (int64_t kb = 0; kb < key_tiles(); ++kb) count += mask(qb, kb).none ? 0 : 1;
    return count;
  }

 private:
  struct Range {
    int64_t min, max;  // over the tile's real entries
  };
  static std::vector<int64_t> padded(const int64_t* positions, int64_t count) {
    std::vector<int64_t> out(size_t(round_up(count, kBlock)), kPastEnd);
    std::copy(positions, positions + count, out.begin());
    return out;
  }
  static std::vector<Range> tile_ranges(const std::vector<int64_t>& positions, int64_t count) {
    std::vector<Range> ranges;
    for (int64_t first = 0; first < count; first += kBlock) {
      const auto begin = positions.begin() + first, end = positions.begin() + std::min(count, first + kBlock);
      const auto [min, max] = std::minmax_element(begin, end);
      ranges.push_back(Range{*min, *max});
    }
    return ranges;
  }

  std::vector<int64_t> query_, key_;
  std::vector<Range> query_range_, key_range_;
};

// Whether key j of a tile pair is hidden from query i; with kPartial false
// (a pair wholly visible) a constant the compiler drops from the loops.
template <bool kPartial>
inline bool hidden(const TilePositions::Mask& mask, int64_t i, int64_t j) {
  return kPartial && !block_key_visible(mask.query[i], mask.key[j]);
}

// What the tile code reads and writes, in the element offsets of a `Rows`
// (a call's layout: query_offset, key_offset, value_offset, out_offset,
// stats_offset; query_stride, kv_stride, out_stride from token t to t + 1;
// group_of; batch, queries, keys, heads, groups, head_dim; padded_dim, the
// head dimension rounded up to kLanes). q and kv may be one tensor (qkv).
template <typename T, typename OutT>
struct ForwardOperands {
  const T* q;
  const T* kv;
  OutT* out;
  float* logsumexp;
};
template <typename T, typename OutT>
struct BackwardOperands {
  const T* grad_out;
  const T* q;
  const T* kv;
  const float* logsumexp;
  const float* delta;  // rowsum(dO∘O), logsumexp's order
  OutT* grad_q;        // offsets of q
  OutT* grad_kv;       // offsets of kv
};

// dst[d] = from_float(scale·src[d]) for d < dim, or with kAccumulate (f32
// outputs summed over a ring's blocks) dst[d] += scale·src[d].
template <bool kAccumulate, typename OutT>
void store_row(const float* src, int64_t dim, float scale, OutT* dst) {
  for (int64_t d = 0; d < dim; ++d) {
    if constexpr (kAccumulate)
      dst[d] += scale * src[d];
    else
      dst[d] = from_float<OutT>(scale * src[d]);
  }
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

struct ForwardScratch {
  float *q_t, *k, *v, *scores_t, *acc;
  float *max, *sum, *factor, *tile_max, *tile_sum;  // per query row [kBlock]
  static int64_t floats(int64_t dp) { return 4 * kBlock * dp + kBlock * kBlock + 5 * kBlock; }
  ForwardScratch(float* base, int64_t dp)
      : q_t(base),
        k(q_t + kBlock * dp),
        v(k + kBlock * dp),
        scores_t(v + kBlock * dp),
        acc(scores_t + kBlock * kBlock),
        max(acc + kBlock * dp),
        sum(max + kBlock),
        factor(sum + kBlock),
        tile_max(factor + kBlock),
        tile_sum(tile_max + kBlock) {}
};

// The online softmax over one tile of transposed scores (s.scores_t, keys ×
// queries): raises each query's max and sum (s.factor: what rescales its
// accumulated output) and leaves the tile's unnormalised weights in place,
// 0 for hidden keys. kPartial: the mask is tested (else every key is
// visible, and the loops carry no test at all).
template <bool kPartial>
void softmax_tile(const ForwardScratch& s, int64_t keys, const TilePositions::Mask& mask) {
  std::fill(s.tile_max, s.tile_max + kBlock, -INFINITY);
  for (int64_t j = 0; j < keys; ++j) {
    const float* row = s.scores_t + j * kBlock;
#pragma omp simd simdlen(16)
    for (int64_t i = 0; i < kBlock; ++i) {
      const float score = hidden<kPartial>(mask, i, j) ? -INFINITY : row[i];
      s.tile_max[i] = score > s.tile_max[i] ? score : s.tile_max[i];
    }
  }
  // A row that sees nothing of the tile (only where some keys are hidden)
  // keeps its max and sum: raising a max of −∞ to −∞ would make them NaN.
#pragma omp simd simdlen(16)
  for (int64_t i = 0; i < kBlock; ++i) {
    s.tile_sum[i] = 0.0f;
    if constexpr (kPartial) {
      if (s.tile_max[i] == -INFINITY) {
        s.factor[i] = 1.0f;
        continue;
      }
    }
    s.factor[i] = online_softmax_raise_max(s.max[i], s.sum[i], s.tile_max[i]);
  }
  for (int64_t j = 0; j < keys; ++j) {
    float* row = s.scores_t + j * kBlock;
#pragma omp simd simdlen(16)
    for (int64_t i = 0; i < kBlock; ++i) {
      const float p = hidden<kPartial>(mask, i, j) ? 0.0f : online_softmax_weight(row[i], s.max[i]);
      row[i] = p;
      s.tile_sum[i] += p;
    }
  }
#pragma omp simd simdlen(16)
  for (int64_t i = 0; i < kBlock; ++i) s.sum[i] += s.tile_sum[i];
}

// Query tile qb of head (b, h): out rows and logsumexp. Scores are formed
// transposed, Sᵀ = K·(scale·Q)ᵀ [keys × queries], so the online softmax runs
// down the columns with one vector lane per query row, and the keys need no
// transposing; O += P·V reads Sᵀ as a transposed A. Keys and values are those
// of the head's group, read in place (never repeated per query head). Key
// tiles the query tile cannot see are skipped; a row that sees no key gets
// out 0 and logsumexp −∞. Dropout multiplies P before O += P·V, after the row
// sums took it undropped.
template <typename Rows, typename T, typename OutT>
void forward_tile(const Rows& g, const TilePositions& positions, const ForwardOperands<T, OutT>& x, int64_t b,
                  int64_t h, int64_t qb, float scale, const ops::AttentionDropout& dropout, float* scratch) {
  const int64_t dp = g.padded_dim, dh = g.head_dim(), kv = g.group_of(h);
  const ForwardScratch s(scratch, dp);
  const int64_t t0 = qb * kBlock, rows = std::min(kBlock, g.queries() - t0);
  gather_transposed(x.q + g.query_offset(b, t0, h), g.query_stride(), rows, dh, scale, s.q_t);
  std::fill(s.acc, s.acc + rows * dp, 0.0f);
  std::fill(s.max, s.max + kBlock, -INFINITY);
  std::fill(s.sum, s.sum + kBlock, 0.0f);

  for (int64_t kb = 0; kb < positions.key_tiles(); ++kb) {
    const TilePositions::Mask mask = positions.mask(qb, kb);
    if (mask.none) continue;
    const int64_t s0 = kb * kBlock, keys = std::min(kBlock, g.keys() - s0);
    gather_rows(x.kv + g.key_offset(b, s0, kv), g.kv_stride(), keys, dh, 1.0f, s.k, dp);
    gather_rows(x.kv + g.value_offset(b, s0, kv), g.kv_stride(), keys, dh, 1.0f, s.v, dp);
    gemm<false, false>(keys, kBlock, dh, s.k, dp, s.q_t, kBlock, s.scores_t, kBlock);

    if (mask.partial)
      softmax_tile<true>(s, keys, mask);
    else
      softmax_tile<false>(s, keys, mask);
    if (dropout.p > 0.0f) drop_transposed_tile(dropout, b, h, t0, rows, s0, keys, s.scores_t);
    for (int64_t i = 0; i < rows; ++i) {
      float* acc = s.acc + i * dp;
      const float factor = s.factor[i];
#pragma omp simd simdlen(16)
      for (int64_t d = 0; d < dp; ++d) acc[d] *= factor;
    }
    gemm<true, true>(rows, dp, keys, s.scores_t, kBlock, s.v, dp, s.acc, dp);  // O += P·V, P = (Sᵀ)ᵀ
  }

  for (int64_t i = 0; i < rows; ++i) {
    const bool seen = s.sum[i] > 0.0f;
    store_row<false>(s.acc + i * dp, dh, seen ? 1.0f / s.sum[i] : 0.0f, x.out + g.out_offset(b, t0 + i, h));
    x.logsumexp[g.stats_offset(b, h, t0 + i)] = seen ? online_softmax_logsumexp(s.max[i], s.sum[i]) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

struct BackwardScratch {
  float *q, *grad_out, *grad_q;  // one query head: [padded Tq, dp]; q pre-multiplied by the scale
  float *grad_k, *grad_v;        // the group's key and value: [padded Tk, dp], summed over its heads
  float *k, *k_t, *v_t;          // one key tile
  float *p, *grad_s;             // [kBlock, kBlock]: queries × keys
  float* mask;                   // [kBlock, kBlock]: the dropout multipliers of p

  // tq, tk: query and key counts rounded up to whole tiles.
  static int64_t floats(int64_t tq, int64_t tk, int64_t dp) {
    return 3 * tq * dp + 2 * tk * dp + 3 * kBlock * dp + 3 * kBlock * kBlock;
  }
  BackwardScratch(float* base, int64_t tq, int64_t tk, int64_t dp)
      : q(base),
        grad_out(q + tq * dp),
        grad_q(grad_out + tq * dp),
        grad_k(grad_q + tq * dp),
        grad_v(grad_k + tk * dp),
        k(grad_v + tk * dp),
        k_t(k + kBlock * dp),
        v_t(k_t + kBlock * dp),
        p(v_t + kBlock * dp),
        grad_s(p + kBlock * kBlock),
        mask(grad_s + kBlock * kBlock) {}
};

// One tile's probabilities and score gradients, row by row: p holds the
// scaled scores and leaves with P (∘ mask under kDropout, for dV); ds holds
// dP = dO·Vᵀ and leaves with dS = P∘(dP (∘ mask) − delta).
template <bool kDropout, bool kPartial>
void tile_score_grads(const BackwardScratch& s, int64_t rows, const TilePositions::Mask& visible, const float* lse,
                      const float* delta) {
  for (int64_t i = 0; i < rows; ++i) {
    float* p = s.p + i * kBlock;
    float* ds = s.grad_s + i * kBlock;
    const float* mask = s.mask + i * kBlock;
    const float row_lse = lse[i], row_delta = delta[i];
#pragma omp simd simdlen(16)
    for (int64_t j = 0; j < kBlock; ++j) {
      const float prob = hidden<kPartial>(visible, i, j) ? 0.0f : attention_probability(p[j], row_lse);
      if constexpr (kDropout) {
        p[j] = prob * mask[j];
        ds[j] = attention_score_grad(prob, ds[j] * mask[j], row_delta);
      } else {
        p[j] = prob;
        ds[j] = attention_score_grad(prob, ds[j], row_delta);
      }
    }
  }
}

// tile_score_grads with the dropout and mask tests each compiled in only
// where they apply.
inline void score_grads(const BackwardScratch& s, int64_t rows, bool dropout, const TilePositions::Mask& mask,
                        const float* lse, const float* delta) {
  if (dropout)
    mask.partial ? tile_score_grads<true, true>(s, rows, mask, lse, delta)
                 : tile_score_grads<true, false>(s, rows, mask, lse, delta);
  else
    mask.partial ? tile_score_grads<false, true>(s, rows, mask, lse, delta)
                 : tile_score_grads<false, false>(s, rows, mask, lse, delta);
}

// Query head h's share of the backward: its dQ, stored (or with kAccumulate
// added), and its terms of its group's dK and dV, added to s.grad_k and
// s.grad_v. Every (query tile, key tile) pair that is not wholly hidden.
template <bool kAccumulate, typename Rows, typename T, typename OutT>
void backward_head(const Rows& g, const TilePositions& positions, const BackwardScratch& s,
                   const BackwardOperands<T, OutT>& x, int64_t b, int64_t h, float scale,
                   const ops::AttentionDropout& dropout) {
  const int64_t dp = g.padded_dim, dh = g.head_dim(), queries = g.queries(), kv = g.group_of(h);
  gather_rows(x.q + g.query_offset(b, 0, h), g.query_stride(), queries, dh, scale, s.q, dp);
  gather_rows(x.grad_out + g.out_offset(b, 0, h), g.out_stride(), queries, dh, 1.0f, s.grad_out, dp);
  std::fill(s.grad_q, s.grad_q + queries * dp, 0.0f);
  const float* lse = x.logsumexp + g.stats_offset(b, h, 0);
  const float* dl = x.delta + g.stats_offset(b, h, 0);

  for (int64_t kb = 0; kb < positions.key_tiles(); ++kb) {
    const int64_t s0 = kb * kBlock, keys = std::min(kBlock, g.keys() - s0);
    gather_rows(x.kv + g.key_offset(b, s0, kv), g.kv_stride(), keys, dh, 1.0f, s.k, dp);
    gather_transposed(x.kv + g.key_offset(b, s0, kv), g.kv_stride(), keys, dh, 1.0f, s.k_t);
    gather_transposed(x.kv + g.value_offset(b, s0, kv), g.kv_stride(), keys, dh, 1.0f, s.v_t);
    float* grad_k = s.grad_k + s0 * dp;
    float* grad_v = s.grad_v + s0 * dp;

    for (int64_t qb = 0; qb < positions.query_tiles(); ++qb) {
      const TilePositions::Mask mask = positions.mask(qb, kb);
      if (mask.none) continue;
      const int64_t t0 = qb * kBlock, rows = std::min(kBlock, queries - t0);
      const float* q = s.q + t0 * dp;
      const float* dout = s.grad_out + t0 * dp;
      gemm<false, false>(rows, kBlock, dh, q, dp, s.k_t, kBlock, s.p, kBlock);          // scaled scores S
      gemm<false, false>(rows, kBlock, dh, dout, dp, s.v_t, kBlock, s.grad_s, kBlock);  // dP = dO·Vᵀ
      if (dropout.p > 0.0f) dropout_multipliers(dropout, b, h, t0, rows, s0, keys, s.mask);
      score_grads(s, rows, dropout.p > 0.0f, mask, lse + t0, dl + t0);
      gemm<true, true>(keys, dp, rows, s.p, kBlock, dout, dp, grad_v, dp);                   // dV += Pᵀ·dO
      gemm<false, true>(rows, dp, keys, s.grad_s, kBlock, s.k, dp, s.grad_q + t0 * dp, dp);  // dQ += dS·K
      gemm<true, true>(keys, dp, rows, s.grad_s, kBlock, q, dp, grad_k, dp);                 // dK += dSᵀ·(scale·Q)
    }
  }
  for (int64_t t = 0; t < queries; ++t)
    store_row<kAccumulate>(s.grad_q + t * dp, dh, scale, x.grad_q + g.query_offset(b, t, h));
}

// Key/value group kv of sequence b: the backward of each of its query heads in
// turn, then the group's dK and dV, summed over them, stored (or added) once.
template <bool kAccumulate, typename Rows, typename T, typename OutT>
void backward_group(const Rows& g, const TilePositions& positions, const BackwardOperands<T, OutT>& x, int64_t b,
                    int64_t kv, float scale, const ops::AttentionDropout& dropout, float* scratch) {
  const int64_t dp = g.padded_dim, dh = g.head_dim(), keys = g.keys(), per_group = g.heads() / g.groups();
  const BackwardScratch s(scratch, round_up(g.queries(), kBlock), round_up(keys, kBlock), dp);
  std::fill(s.grad_k, s.grad_k + keys * dp, 0.0f);
  std::fill(s.grad_v, s.grad_v + keys * dp, 0.0f);
  for (int64_t h = kv * per_group; h < (kv + 1) * per_group; ++h)
    backward_head<kAccumulate>(g, positions, s, x, b, h, scale, dropout);
  for (int64_t t = 0; t < keys; ++t) {
    store_row<kAccumulate>(s.grad_k + t * dp, dh, 1.0f, x.grad_kv + g.key_offset(b, t, kv));
    store_row<kAccumulate>(s.grad_v + t * dp, dh, 1.0f, x.grad_kv + g.value_offset(b, t, kv));
  }
}

// One task per (b, h, query tile), costed by the key tiles it sees.
template <typename Rows, typename T, typename OutT>
void run_forward_tiles(Context& ctx, const Rows& g, const TilePositions& positions, const ForwardOperands<T, OutT>& x,
                       float scale, const ops::AttentionDropout& dropout) {
  const int64_t tiles = positions.query_tiles();
  std::vector<int64_t> visible(static_cast<size_t>(tiles));
  for (int64_t qb = 0; qb < tiles; ++qb) visible[size_t(qb)] = positions.visible_key_tiles(qb);
  std::vector<int64_t> costs(size_t(g.batch() * g.heads() * tiles));
  for (size_t i = 0; i < costs.size(); ++i) costs[i] = visible[i % size_t(tiles)] + 1;
  run_tasks(ctx, costs, ForwardScratch::floats(g.padded_dim), [&](int64_t task, float* scratch) {
    const int64_t bh = task / tiles;
    forward_tile(g, positions, x, bh / g.heads(), bh % g.heads(), task % tiles, scale, dropout, scratch);
  });
}

// One task per (b, key/value group): no two tasks write the same gradient, so
// the result is deterministic. delta must be ready.
template <bool kAccumulate, typename Rows, typename T, typename OutT>
void run_backward_tiles(Context& ctx, const Rows& g, const TilePositions& positions, const BackwardOperands<T, OutT>& x,
                        float scale, const ops::AttentionDropout& dropout) {
  const std::vector<int64_t> costs(size_t(g.batch() * g.groups()), 1);
  const int64_t scratch =
      BackwardScratch::floats(round_up(g.queries(), kBlock), round_up(g.keys(), kBlock), g.padded_dim);
  run_tasks(ctx, costs, scratch, [&](int64_t task, float* area) {
    backward_group<kAccumulate>(g, positions, x, task / g.groups(), task % g.groups(), scale, dropout, area);
  });
}

}  // namespace tessera::cpu_attention
