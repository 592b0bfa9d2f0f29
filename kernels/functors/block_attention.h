// Blockwise causal attention with global positions: the math of context
// parallelism's ring (parallel/ring_attention.h), shared by the CPU and CUDA
// launchers as the training attention's row functors are
// (kernels/functors/attention.h, whose online softmax, lane helpers and
// AttentionDelta these reuse). A rank's local queries meet one key/value
// block at a time; which key a query sees is decided by the tokens' global
// positions, not their indices, so a block may be any set of positions (a
// zigzag pair of chunks, a whole earlier chunk, or nothing visible at all):
//   key s is visible to query t  ⇔  k_pos[s] ≤ q_pos[t].
// A row that sees no key of a block gets out 0 and logsumexp −∞, which the
// log-sum-exp merge (BlockAttentionMerge) treats as "no contribution".
//
// Layouts (ops::attention_block_*):
//   q, grad_out, out [B, Tq, H, Dh]: query head h = g·R + j of key/value head
//     g (R = H/G), so [H, Dh] is also [G, R, Dh]; a head's vector is contiguous;
//   kv [B, Tk, G, 2, Dh]: per key/value head its key then its value; the
//     compact block that travels around the ring (no queries, no repeats);
//   logsumexp, delta [B, H, Tq] f32 (the training attention's order);
//   the block's forward out, the running out, grad_q and grad_kv in f32:
//     a sequence's output and gradients are sums over C blocks, which f32
//     accumulates without rounding to bf16/f16 at every step.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/shape.h"
#include "core/tensor.h"
#include "kernels/functors/attention.h"

namespace tessera {

// Whether a key at global position `key` is visible to a query at `query`.
TESSERA_HD bool block_key_visible(int64_t query, int64_t key) {
  return key <= query;
}

// Element offsets of one call's tensors (see the layouts above).
struct BlockRows {
  int64_t batch, queries, keys;     // B, Tq, Tk
  int64_t heads, groups, head_dim;  // H, G, Dh

  TESSERA_HD int64_t group_of(int64_t h) const { return h / (heads / groups); }
  TESSERA_HD int64_t query_offset(int64_t b, int64_t t, int64_t h) const {  // q, out, grad_out, grad_q
    return ((b * queries + t) * heads + h) * head_dim;
  }
  TESSERA_HD int64_t key_offset(int64_t b, int64_t s, int64_t g) const {  // kv, grad_kv
    return ((b * keys + s) * groups + g) * 2 * head_dim;
  }
  TESSERA_HD int64_t value_offset(int64_t b, int64_t s, int64_t g) const { return key_offset(b, s, g) + head_dim; }
  TESSERA_HD int64_t stats_offset(int64_t b, int64_t h, int64_t t) const { return (b * heads + h) * queries + t; }
  // Query row (b·H + h)·Tq + t, the order of logsumexp, as (b, h, t).
  TESSERA_HD int64_t batch_of_query_row(int64_t row) const { return row / queries / heads; }
  TESSERA_HD int64_t head_of_query_row(int64_t row) const { return row / queries % heads; }
  TESSERA_HD int64_t query_rows() const { return batch * heads * queries; }
  TESSERA_HD int64_t key_rows() const { return batch * groups * keys; }
};

// The dimensions of a call from q [B, Tq, H, Dh] and kv [B, Tk, G, 2, Dh];
// of a merge, from out [B, Tq, H, Dh] alone (keys and groups unused there).
inline BlockRows block_rows_of(const Shape& q, const Shape& kv) {
  return BlockRows{q[0], q[1], kv[1], q[2], kv[2], q[3]};
}
inline BlockRows block_rows_of(const Shape& out) {
  return BlockRows{out[0], out[1], 0, out[2], 1, out[3]};
}

// Forward, a row functor over the query rows (b·H + h)·Tq + t: the online
// softmax over the block's visible keys → out (f32, normalised over this
// block only) and logsumexp (−∞ and out 0 where no key is visible).
template <typename T, int kMaxHeadDim>
struct BlockAttentionForwardRow {
  const T* q;
  const T* kv;
  const int64_t* q_pos;
  const int64_t* k_pos;
  float* out;
  float* logsumexp;
  BlockRows rows;
  float scale;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const int lane = g.lane(), dh = int(rows.head_dim);
    const int64_t t = row % rows.queries, b = rows.batch_of_query_row(row), h = rows.head_of_query_row(row);
    const int64_t kvh = rows.group_of(h), position = q_pos[t];
    float query[kCount], acc[kCount];
    load_lanes<kLanes>(q + rows.query_offset(b, t, h), dh, lane, scale, query);
#pragma unroll
    for (int i = 0; i < kCount; ++i) acc[i] = 0.0f;
    OnlineSoftmax softmax;
    for (int64_t s = 0; s < rows.keys; ++s) {
      if (!block_key_visible(position, k_pos[s])) continue;
      const float score = group_dot(g, query, kv + rows.key_offset(b, s, kvh), dh);
      const float factor = softmax.raise_max(score);
      const float weight = softmax.weight(score);
      softmax.add(weight);
      rescale_add_lanes<kLanes>(acc, factor, weight, kv + rows.value_offset(b, s, kvh), dh, lane);
    }
    const bool seen = softmax.sum > 0.0f;
    store_lanes<kLanes>(out + rows.query_offset(b, t, h), dh, lane, seen ? softmax.normaliser() : 0.0f, acc);
    if (lane == 0) logsumexp[row] = seen ? softmax.logsumexp() : -INFINITY;
  }
};

// The weights of two partial results of one query row in their union, from
// their logsumexps a (the running one) and b (the block's): e^(a − m), e^(b − m)
// over the union's normaliser, and the union's logsumexp. −∞ is "nothing
// seen": its weight is 0 and, both −∞, the union stays −∞ with out 0.
struct LogSumExpMerge {
  float running, block, logsumexp;

  TESSERA_HD static LogSumExpMerge of(float a, float b) {
    const float m = a > b ? a : b;
    if (m == -INFINITY) return LogSumExpMerge{0.0f, 0.0f, -INFINITY};
    const float wa = exp_f32(a - m), wb = exp_f32(b - m), total = wa + wb;
    return LogSumExpMerge{wa / total, wb / total, m + logf(total)};
  }
};

// The merge of a block's partial result into the running one, an index
// functor over the query rows (b·Tq + t)·H + h of out [B, Tq, H, Dh], f32:
// out = w_run·out + w_block·block_out, logsumexp = log(e^lse + e^block_lse).
struct BlockAttentionMerge {
  const float* block_out;
  const float* block_logsumexp;
  float* out;
  float* logsumexp;
  BlockRows rows;

  TESSERA_HD void operator()(int64_t row) const {
    const int64_t h = row % rows.heads, t = row / rows.heads % rows.queries, b = row / rows.heads / rows.queries;
    const int64_t stats = rows.stats_offset(b, h, t), first = row * rows.head_dim;
    const LogSumExpMerge w = LogSumExpMerge::of(logsumexp[stats], block_logsumexp[stats]);
    for (int64_t d = first; d < first + rows.head_dim; ++d) out[d] = w.running * out[d] + w.block * block_out[d];
    logsumexp[stats] = w.logsumexp;
  }
};

// What the two backward row functors read and write. logsumexp is the FINAL
// one (over every block), so P recomputed here is the whole sequence's
// probability; delta = rowsum(dO∘O) of the final output (AttentionDelta).
template <typename T>
struct BlockAttentionBackwardArgs {
  const T* grad_out;
  const T* q;
  const T* kv;
  const int64_t* q_pos;
  const int64_t* k_pos;
  const float* logsumexp;
  const float* delta;
  float* grad_q;   // [B, Tq, H, Dh], accumulated
  float* grad_kv;  // [B, Tk, G, 2, Dh], accumulated
  BlockRows rows;
  float scale;
};

// Backward, a row functor over the query rows (numbered as the forward's):
// grad_q += scale·Σ_{visible s} dS[t, s]·k_s, dS = P∘(dO·v − delta).
template <typename T, int kMaxHeadDim>
struct BlockAttentionGradQueryRow {
  BlockAttentionBackwardArgs<T> args;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const BlockRows& rows = args.rows;
    const int lane = g.lane(), dh = int(rows.head_dim);
    const int64_t t = row % rows.queries, b = rows.batch_of_query_row(row), h = rows.head_of_query_row(row);
    const int64_t kvh = rows.group_of(h), position = args.q_pos[t];
    float query[kCount], dout[kCount], grad[kCount];
    load_lanes<kLanes>(args.q + rows.query_offset(b, t, h), dh, lane, args.scale, query);
    load_lanes<kLanes>(args.grad_out + rows.query_offset(b, t, h), dh, lane, 1.0f, dout);
    load_lanes<kLanes>(args.grad_q + rows.query_offset(b, t, h), dh, lane, 1.0f, grad);
    const float lse = args.logsumexp[row], row_delta = args.delta[row];
    for (int64_t s = 0; s < rows.keys; ++s) {
      if (!block_key_visible(position, args.k_pos[s])) continue;
      const T* key = args.kv + rows.key_offset(b, s, kvh);
      const float p = attention_probability(group_dot(g, query, key, dh), lse);
      const float ds =
          attention_score_grad(p, group_dot(g, dout, args.kv + rows.value_offset(b, s, kvh), dh), row_delta);
      rescale_add_lanes<kLanes>(grad, 1.0f, args.scale * ds, key, dh, lane);
    }
    store_lanes<kLanes>(args.grad_q + rows.query_offset(b, t, h), dh, lane, 1.0f, grad);
  }
};

// Backward, a row functor over the key rows (b·G + g)·Tk + s: the gradients
// of key/value head g's key and value at block token s, over the group's R
// query heads and the queries that see it: grad_v += Σ P[t, s]·dO_t,
// grad_k += scale·Σ dS[t, s]·q_t. One writer per key row: no atomics.
template <typename T, int kMaxHeadDim>
struct BlockAttentionGradKeyValueRow {
  BlockAttentionBackwardArgs<T> args;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const BlockRows& rows = args.rows;
    const int lane = g.lane(), dh = int(rows.head_dim);
    const int64_t s = row % rows.keys, b = row / rows.keys / rows.groups, kvh = row / rows.keys % rows.groups;
    const int64_t per_group = rows.heads / rows.groups, position = args.k_pos[s];
    float k[kCount], v[kCount], grad_k[kCount], grad_v[kCount];
    load_lanes<kLanes>(args.kv + rows.key_offset(b, s, kvh), dh, lane, 1.0f, k);
    load_lanes<kLanes>(args.kv + rows.value_offset(b, s, kvh), dh, lane, 1.0f, v);
    load_lanes<kLanes>(args.grad_kv + rows.key_offset(b, s, kvh), dh, lane, 1.0f, grad_k);
    load_lanes<kLanes>(args.grad_kv + rows.value_offset(b, s, kvh), dh, lane, 1.0f, grad_v);
    for (int64_t h = kvh * per_group; h < (kvh + 1) * per_group; ++h) {
      for (int64_t t = 0; t < rows.queries; ++t) {
        if (!block_key_visible(args.q_pos[t], position)) continue;
        float query[kCount], dout[kCount];
        load_lanes<kLanes>(args.q + rows.query_offset(b, t, h), dh, lane, args.scale, query);
        load_lanes<kLanes>(args.grad_out + rows.query_offset(b, t, h), dh, lane, 1.0f, dout);
        float score = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < kCount; ++i) score += query[i] * k[i], dp += dout[i] * v[i];
        const int64_t stats = rows.stats_offset(b, h, t);
        const float p = attention_probability(g.sum(score), args.logsumexp[stats]);
        const float ds = attention_score_grad(p, g.sum(dp), args.delta[stats]);
#pragma unroll
        for (int i = 0; i < kCount; ++i) grad_v[i] += p * dout[i], grad_k[i] += ds * query[i];
      }
    }
    store_lanes<kLanes>(args.grad_kv + rows.key_offset(b, s, kvh), dh, lane, 1.0f, grad_k);  // q was scaled already
    store_lanes<kLanes>(args.grad_kv + rows.value_offset(b, s, kvh), dh, lane, 1.0f, grad_v);
  }
};

// The functors' arguments from the tensors of ops::attention_block_forward
// and ops::attention_block_backward (for both backends' launchers).
template <typename T, int kMaxHeadDim>
BlockAttentionForwardRow<T, kMaxHeadDim> block_forward_row(const Tensor& q, const Tensor& kv, const Tensor& q_positions,
                                                           const Tensor& k_positions, Tensor& out, Tensor& logsumexp,
                                                           float scale) {
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  return {q.data<T>(),
          kv.data<T>(),
          q_positions.data<int64_t>(),
          k_positions.data<int64_t>(),
          out.data<float>(),
          logsumexp.data<float>(),
          rows,
          attention_scale(scale, rows.head_dim)};
}
template <typename T>
BlockAttentionBackwardArgs<T> block_backward_args(const Tensor& grad_out, const Tensor& q, const Tensor& kv,
                                                  const Tensor& logsumexp, const Tensor& delta,
                                                  const Tensor& q_positions, const Tensor& k_positions, Tensor& grad_q,
                                                  Tensor& grad_kv, float scale) {
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  return {grad_out.data<T>(),
          q.data<T>(),
          kv.data<T>(),
          q_positions.data<int64_t>(),
          k_positions.data<int64_t>(),
          logsumexp.data<float>(),
          delta.data<float>(),
          grad_q.data<float>(),
          grad_kv.data<float>(),
          rows,
          attention_scale(scale, rows.head_dim)};
}
inline BlockAttentionMerge block_merge(const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out,
                                       Tensor& logsumexp) {
  return {block_out.data<float>(), block_logsumexp.data<float>(), out.data<float>(), logsumexp.data<float>(),
          block_rows_of(out.shape())};
}

}  // namespace tessera
