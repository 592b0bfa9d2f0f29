// CpuBackend: causal attention, blocked like flash attention so that no T×T
// matrix ever exists. Tiles of 64 query rows meet tiles of 64 keys up to the
// diagonal; each tile's products run in a register-blocked f32 micro-kernel
// (GCC vector extensions: AVX-512 with -march=native) on contiguous,
// zero-padded f32 copies of the rows (bf16/f16 are converted when gathered).
// The per-row math (online softmax, probabilities, score gradients) is the
// shared code of kernels/functors/attention.h.
//
// Both layouts of the projections (the GPT's packed [B, T, 3, H, Dh], Llama's
// grouped [B, T, G, R + 2, Dh]) run the same code through QkvLayout; a query
// head reads its group's keys and values in place, never a repeated copy.
//
// Forward: one task per (b, h, query tile), online softmax over key tiles.
// Backward: one task per (b, key/value group): for each of the group's query
// heads in turn, for each key tile, dK and dV accumulate over the query tiles
// at or below the diagonal into the group's sequence-long f32 buffers, dQ in a
// per-head buffer; no two tasks write the same output, so results are
// deterministic. Tasks are dealt to one scratch slot per thread, largest first.
//
// Dropout on the attention probabilities (ops::AttentionDropout): once a
// tile's probabilities are formed, a pass multiplies them by the mask (one
// Philox call per query and four keys); with p = 0 that pass, and the
// backward's masked variant, are never entered.
//
// Generation's cached attention runs the shared row functor, a row per task.
#include "kernels/functors/attention.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/context.h"
#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

constexpr int64_t kBlock = 64;  // query rows and keys per tile
constexpr int64_t kLanes = 16;  // floats per vector; tile row lengths are multiples of it

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));

int64_t round_up(int64_t n, int64_t multiple) {
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

// Where one call's rows live (either qkv layout, see QkvLayout), and the row
// length of its f32 tiles.
struct Layout {
  AttentionRows rows;
  int64_t padded_dim;  // head_dim rounded up to kLanes

  int64_t batch() const { return rows.batch; }
  int64_t seq_len() const { return rows.seq_len; }
  int64_t heads() const { return rows.qkv.heads; }
  int64_t groups() const { return rows.qkv.groups; }
  int64_t head_dim() const { return rows.qkv.head_dim; }
  int64_t qkv_row_stride() const { return rows.qkv.token_stride; }  // token t to t + 1 in qkv
  int64_t out_row_stride() const { return heads() * head_dim(); }
};

Layout layout_of(const Tensor& qkv, const QkvLayout& layout) {
  return Layout{AttentionRows{qkv.size(0), qkv.size(1), layout}, round_up(layout.head_dim, kLanes)};
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

// Whether key j of a key tile is masked for query i of a query tile: only on
// the diagonal tile pair, where key j is token s0 + j and query i token s0 + i.
inline bool masked(bool diagonal, int64_t i, int64_t j) {
  return diagonal && j > i;
}

// Dropout on a forward tile of probabilities, transposed [keys × queries]:
// p_t[j·kBlock + i] *= M[b, h, t0 + i, s0 + j]/(1 − p) for i < rows and
// j < round_up(keys, 4) (s0 is a multiple of 4 and one Philox call gives four
// keys; the tile has room for kBlock keys), query head h numbered within the
// call (attention_dropout_multiplier's mask). A vector lane per query.
void drop_transposed_tile(const ops::AttentionDropout& dropout, int64_t b, int64_t h, int64_t t0, int64_t rows,
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
void dropout_multipliers(const ops::AttentionDropout& dropout, int64_t b, int64_t h, int64_t t0, int64_t rows,
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
std::vector<std::vector<int64_t>> deal_tasks(const std::vector<int64_t>& costs, int64_t slots) {
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

// Query tile qb of head (b, h): out rows and logsumexp. Scores are formed
// transposed, Sᵀ = K·(scale·Q)ᵀ [keys × queries], so the online softmax runs
// down the columns with one vector lane per query row, and the keys need no
// transposing; O += P·V reads Sᵀ as a transposed A. Keys and values are those
// of the head's group, read in place (never repeated per query head). Dropout
// multiplies P before O += P·V, after the row sums took it undropped.
template <typename T>
void forward_tile(const Layout& g, const T* qkv, T* out, float* logsumexp, int64_t b, int64_t h, int64_t qb,
                  float scale, const ops::AttentionDropout& dropout, float* scratch) {
  const int64_t dp = g.padded_dim, dh = g.head_dim(), stride = g.qkv_row_stride(), kv = g.rows.qkv.group_of(h);
  const ForwardScratch s(scratch, dp);
  const int64_t t0 = qb * kBlock, rows = std::min(kBlock, g.seq_len() - t0);
  gather_transposed(qkv + g.rows.query_offset(b, t0, h), stride, rows, dh, scale, s.q_t);
  std::fill(s.acc, s.acc + rows * dp, 0.0f);
  std::fill(s.max, s.max + kBlock, -INFINITY);
  std::fill(s.sum, s.sum + kBlock, 0.0f);

  for (int64_t kb = 0; kb <= qb; ++kb) {
    const int64_t s0 = kb * kBlock, keys = std::min(kBlock, g.seq_len() - s0);
    const bool diagonal = kb == qb;
    gather_rows(qkv + g.rows.key_offset(b, s0, kv), stride, keys, dh, 1.0f, s.k, dp);
    gather_rows(qkv + g.rows.value_offset(b, s0, kv), stride, keys, dh, 1.0f, s.v, dp);
    gemm<false, false>(keys, kBlock, dh, s.k, dp, s.q_t, kBlock, s.scores_t, kBlock);

    std::fill(s.tile_max, s.tile_max + kBlock, -INFINITY);
    for (int64_t j = 0; j < keys; ++j) {
      const float* row = s.scores_t + j * kBlock;
#pragma omp simd simdlen(16)
      for (int64_t i = 0; i < kBlock; ++i) {
        const float x = masked(diagonal, i, j) ? -INFINITY : row[i];
        s.tile_max[i] = x > s.tile_max[i] ? x : s.tile_max[i];
      }
    }
#pragma omp simd simdlen(16)
    for (int64_t i = 0; i < kBlock; ++i) {
      s.factor[i] = online_softmax_raise_max(s.max[i], s.sum[i], s.tile_max[i]);
      s.tile_sum[i] = 0.0f;
    }
    for (int64_t j = 0; j < keys; ++j) {
      float* row = s.scores_t + j * kBlock;
#pragma omp simd simdlen(16)
      for (int64_t i = 0; i < kBlock; ++i) {
        const float p = masked(diagonal, i, j) ? 0.0f : online_softmax_weight(row[i], s.max[i]);
        row[i] = p;
        s.tile_sum[i] += p;
      }
    }
#pragma omp simd simdlen(16)
    for (int64_t i = 0; i < kBlock; ++i) s.sum[i] += s.tile_sum[i];
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
    T* o = out + g.rows.out_offset(b, t0 + i, h);
    const float* acc = s.acc + i * dp;
    const float normaliser = 1.0f / s.sum[i];
    for (int64_t d = 0; d < dh; ++d) o[d] = from_float<T>(acc[d] * normaliser);
    logsumexp[g.rows.stats_offset(b, h, t0 + i)] = online_softmax_logsumexp(s.max[i], s.sum[i]);
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

struct BackwardScratch {
  float *q, *grad_out, *grad_q;  // one query head: [padded T, dp]; q pre-multiplied by the scale
  float *grad_k, *grad_v;        // the group's key and value: [padded T, dp], summed over its heads
  float *k, *k_t, *v_t;          // one key tile
  float *p, *grad_s;             // [kBlock, kBlock]: queries × keys
  float* mask;                   // [kBlock, kBlock]: the dropout multipliers of p

  static int64_t floats(int64_t tp, int64_t dp) { return 5 * tp * dp + 3 * kBlock * dp + 3 * kBlock * kBlock; }
  BackwardScratch(float* base, int64_t tp, int64_t dp)
      : q(base),
        grad_out(q + tp * dp),
        grad_q(grad_out + tp * dp),
        grad_k(grad_q + tp * dp),
        grad_v(grad_k + tp * dp),
        k(grad_v + tp * dp),
        k_t(k + kBlock * dp),
        v_t(k_t + kBlock * dp),
        p(v_t + kBlock * dp),
        grad_s(p + kBlock * kBlock),
        mask(grad_s + kBlock * kBlock) {}
};

// One tile's probabilities and score gradients, row by row: p holds the
// scaled scores and leaves with P (∘ mask under kDropout, for dV); ds holds
// dP = dO·Vᵀ and leaves with dS = P∘(dP (∘ mask) − delta).
template <bool kDropout>
void tile_score_grads(const BackwardScratch& s, int64_t rows, bool diagonal, const float* lse, const float* delta) {
  for (int64_t i = 0; i < rows; ++i) {
    float* p = s.p + i * kBlock;
    float* ds = s.grad_s + i * kBlock;
    const float* mask = s.mask + i * kBlock;
    const float row_lse = lse[i], row_delta = delta[i];
#pragma omp simd simdlen(16)
    for (int64_t j = 0; j < kBlock; ++j) {
      const float prob = masked(diagonal, i, j) ? 0.0f : attention_probability(p[j], row_lse);
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

// Query head h's share of the backward: its dQ, written out, and its terms of
// its group's dK and dV, added to s.grad_k and s.grad_v.
template <typename T>
void backward_head(const Layout& g, const BackwardScratch& s, const T* grad_out, const T* qkv, const float* logsumexp,
                   const float* delta, T* grad_qkv, int64_t b, int64_t h, float scale,
                   const ops::AttentionDropout& dropout) {
  const int64_t dp = g.padded_dim, dh = g.head_dim(), stride = g.qkv_row_stride(), seq = g.seq_len();
  const int64_t tiles = (seq + kBlock - 1) / kBlock, kv = g.rows.qkv.group_of(h);
  gather_rows(qkv + g.rows.query_offset(b, 0, h), stride, seq, dh, scale, s.q, dp);
  gather_rows(grad_out + g.rows.out_offset(b, 0, h), g.out_row_stride(), seq, dh, 1.0f, s.grad_out, dp);
  std::fill(s.grad_q, s.grad_q + seq * dp, 0.0f);
  const float* lse = logsumexp + g.rows.stats_offset(b, h, 0);
  const float* dl = delta + g.rows.stats_offset(b, h, 0);

  for (int64_t kb = 0; kb < tiles; ++kb) {
    const int64_t s0 = kb * kBlock, keys = std::min(kBlock, seq - s0);
    gather_rows(qkv + g.rows.key_offset(b, s0, kv), stride, keys, dh, 1.0f, s.k, dp);
    gather_transposed(qkv + g.rows.key_offset(b, s0, kv), stride, keys, dh, 1.0f, s.k_t);
    gather_transposed(qkv + g.rows.value_offset(b, s0, kv), stride, keys, dh, 1.0f, s.v_t);
    float* grad_k = s.grad_k + s0 * dp;
    float* grad_v = s.grad_v + s0 * dp;

    for (int64_t qb = kb; qb < tiles; ++qb) {
      const int64_t t0 = qb * kBlock, rows = std::min(kBlock, seq - t0);
      const bool diagonal = qb == kb;
      const float* q = s.q + t0 * dp;
      const float* dout = s.grad_out + t0 * dp;
      gemm<false, false>(rows, kBlock, dh, q, dp, s.k_t, kBlock, s.p, kBlock);          // scaled scores S
      gemm<false, false>(rows, kBlock, dh, dout, dp, s.v_t, kBlock, s.grad_s, kBlock);  // dP = dO·Vᵀ
      if (dropout.p > 0.0f) {
        dropout_multipliers(dropout, b, h, t0, rows, s0, keys, s.mask);
        tile_score_grads<true>(s, rows, diagonal, lse + t0, dl + t0);
      } else {
        tile_score_grads<false>(s, rows, diagonal, lse + t0, dl + t0);
      }
      gemm<true, true>(keys, dp, rows, s.p, kBlock, dout, dp, grad_v, dp);                   // dV += Pᵀ·dO
      gemm<false, true>(rows, dp, keys, s.grad_s, kBlock, s.k, dp, s.grad_q + t0 * dp, dp);  // dQ += dS·K
      gemm<true, true>(keys, dp, rows, s.grad_s, kBlock, q, dp, grad_k, dp);                 // dK += dSᵀ·(scale·Q)
    }
  }
  for (int64_t t = 0; t < seq; ++t) {
    T* gq = grad_qkv + g.rows.query_offset(b, t, h);
    for (int64_t d = 0; d < dh; ++d) gq[d] = from_float<T>(scale * s.grad_q[t * dp + d]);
  }
}

// Key/value group kv of sequence b: the backward of each of its query heads in
// turn, then the group's dK and dV, summed over them, written once.
template <typename T>
void backward_group(const Layout& g, const T* grad_out, const T* qkv, const float* logsumexp, const float* delta,
                    T* grad_qkv, int64_t b, int64_t kv, float scale, const ops::AttentionDropout& dropout,
                    float* scratch) {
  const int64_t dp = g.padded_dim, dh = g.head_dim(), seq = g.seq_len(), per_group = g.rows.qkv.queries_per_group();
  const BackwardScratch s(scratch, round_up(seq, kBlock), dp);
  std::fill(s.grad_k, s.grad_k + seq * dp, 0.0f);
  std::fill(s.grad_v, s.grad_v + seq * dp, 0.0f);
  for (int64_t h = kv * per_group; h < (kv + 1) * per_group; ++h)
    backward_head(g, s, grad_out, qkv, logsumexp, delta, grad_qkv, b, h, scale, dropout);
  for (int64_t t = 0; t < seq; ++t) {
    T* gk = grad_qkv + g.rows.key_offset(b, t, kv);
    T* gv = grad_qkv + g.rows.value_offset(b, t, kv);
    for (int64_t d = 0; d < dh; ++d) gk[d] = from_float<T>(s.grad_k[t * dp + d]);
    for (int64_t d = 0; d < dh; ++d) gv[d] = from_float<T>(s.grad_v[t * dp + d]);
  }
}

// One task per (b, h, query tile), costed by the key tiles it visits.
void run_forward(const Tensor& qkv, const QkvLayout& layout, Tensor& out, Tensor& logsumexp, float scale,
                 const ops::AttentionDropout& dropout, const char* op) {
  const Layout g = layout_of(qkv, layout);
  const float s = attention_scale(scale, g.head_dim());
  const int64_t tiles = (g.seq_len() + kBlock - 1) / kBlock;
  std::vector<int64_t> costs(size_t(g.batch() * g.heads() * tiles));
  for (size_t i = 0; i < costs.size(); ++i) costs[i] = int64_t(i) % tiles + 1;  // key tiles visited
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* x = qkv.data<T>();
    T* y = out.data<T>();
    float* lse = logsumexp.data<float>();
    run_tasks(qkv.context(), costs, ForwardScratch::floats(g.padded_dim), [&](int64_t task, float* scratch) {
      const int64_t bh = task / tiles;
      forward_tile(g, x, y, lse, bh / g.heads(), bh % g.heads(), task % tiles, s, dropout, scratch);
    });
  });
}

// delta = rowsum(dO∘O), then one task per (b, key/value group): no two tasks
// write the same gradient, so the result is deterministic.
void run_backward(const Tensor& grad_out, const Tensor& qkv, const QkvLayout& layout, const Tensor& out,
                  const Tensor& logsumexp, Tensor& grad_qkv, float scale, const ops::AttentionDropout& dropout,
                  const char* op) {
  const Layout g = layout_of(qkv, layout);
  const float s = attention_scale(scale, g.head_dim());
  Context& ctx = qkv.context();
  Tensor delta = ctx.empty(Shape{g.batch(), g.heads(), g.seq_len()}, DType::f32);
  const std::vector<int64_t> costs(size_t(g.batch() * g.groups()), 1);
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = g.batch() * g.seq_len() * g.heads();
    const AttentionDelta<T> delta_op{grad_out.data<T>(), out.data<T>(), delta.data<float>(),
                                     g.seq_len(),        g.heads(),     g.head_dim()};
    cpu_for_each_index(rows, delta_op, std::max<int64_t>(1, (int64_t(1) << 14) / g.head_dim()));
    const T* dy = grad_out.data<T>();
    const T* x = qkv.data<T>();
    const float* lse = logsumexp.data<float>();
    const float* dl = delta.data<float>();
    T* dx = grad_qkv.data<T>();
    const int64_t scratch = BackwardScratch::floats(round_up(g.seq_len(), kBlock), g.padded_dim);
    run_tasks(ctx, costs, scratch, [&](int64_t task, float* area) {
      backward_group(g, dy, x, lse, dl, dx, task / g.groups(), task % g.groups(), s, dropout, area);
    });
  });
}

// Appends the new keys and values, then one query row per task.
void run_with_cache(const Tensor& qkv, const QkvLayout& layout, Tensor& keys, Tensor& values, int64_t position,
                    Tensor& out, float scale, const char* op) {
  const CacheLayout cache{AttentionRows{qkv.size(0), qkv.size(1), layout}, keys.size(2), position};
  const float s = attention_scale(scale, layout.head_dim);
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const int64_t new_keys = qkv.size(0) * cache.new_tokens() * layout.groups * layout.head_dim;
    cpu_for_each_index(new_keys, KvAppend<T>{qkv.data<T>(), keys.data<T>(), values.data<T>(), cache});
    const CachedAttentionRow<T> row{qkv.data<T>(), keys.data<T>(), values.data<T>(), out.data<T>(), cache, s};
    cpu_for_each_index(qkv.size(0) * cache.new_tokens() * layout.heads, row, 1);
  });
}

}  // namespace

void CpuBackend::attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                                   const ops::AttentionDropout& dropout) {
  run_forward(qkv, packed_qkv_layout(qkv.shape()), out, logsumexp, scale, dropout, "attention_forward");
}

void CpuBackend::attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                    const Tensor& logsumexp, Tensor& grad_qkv, float scale,
                                    const ops::AttentionDropout& dropout) {
  run_backward(grad_out, qkv, packed_qkv_layout(qkv.shape()), out, logsumexp, grad_qkv, scale, dropout,
               "attention_backward");
}

void CpuBackend::attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                      float scale) {
  run_with_cache(qkv, packed_qkv_layout(qkv.shape()), keys, values, position, out, scale, "attention_with_cache");
}

void CpuBackend::grouped_attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                                           const ops::AttentionDropout& dropout) {
  run_forward(qkv, grouped_qkv_layout(qkv.shape()), out, logsumexp, scale, dropout, "grouped_attention_forward");
}

void CpuBackend::grouped_attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                            const Tensor& logsumexp, Tensor& grad_qkv, float scale,
                                            const ops::AttentionDropout& dropout) {
  run_backward(grad_out, qkv, grouped_qkv_layout(qkv.shape()), out, logsumexp, grad_qkv, scale, dropout,
               "grouped_attention_backward");
}

void CpuBackend::grouped_attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position,
                                              Tensor& out, float scale) {
  run_with_cache(qkv, grouped_qkv_layout(qkv.shape()), keys, values, position, out, scale,
                 "grouped_attention_with_cache");
}

}  // namespace tessera
