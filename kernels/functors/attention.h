// Causal attention: the per-row math shared by the CPU (blocked, flash-attention
// style) and CUDA (a warp per row) backends: the online softmax (running maximum
// and sum, with the factor that rescales what was accumulated so far), the
// probabilities and score gradients of the backward pass recomputed from the
// saved logsumexp, and the row functor computing delta = rowsum(dO∘O).
// Exponentials use exp_f32 (kernels/functors/float_math.h), which CPU loops vectorise.
// Two layouts of the projections share every kernel through QkvLayout: the
// GPT's packed qkv [B, T, 3, H, Dh] and Llama's grouped [B, T, G, R + 2, Dh]
// (grouped-query attention: R query heads share a key/value head).
// Training on a GPU: row functors, a group of lanes per query row (forward,
// dQ) or per key row of a key/value group (dK, dV summed over the group's
// query heads), written for any group size so the tests run them on the CPU
// (SerialGroup) against the reference.
// Generation's cached attention: KvAppend (an index functor both backends
// run) writes the new keys and values; the CPU then runs CachedAttentionRow,
// one query row per call. A GPU splits each row's cache positions into
// blocks instead (CacheBlocks): a warp per (row, block) computes the block's
// online-softmax partials (CachedAttentionBlock, a row functor), and an index
// functor merges each row's blocks by log-sum-exp (CachedAttentionMerge), so
// that a decode step of a dozen rows still fills the GPU.
// Dropout on the attention probabilities (ops::AttentionDropout): the mask of
// each (b, head, t, s) drawn on the spot from Philox (attention_dropout_*),
// in the forward and again in the backward, by both backends.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/shape.h"
#include "kernels/functors/dropout.h"
#include "kernels/functors/float_math.h"
#include "kernels/functors/row_group.h"
#include "kernels/ops.h"

namespace tessera {

// The score scale: `scale`, or 1/√Dh when scale ≤ 0 (see ops::attention_forward).
TESSERA_HD float attention_scale(float scale, int64_t head_dim) {
  return scale > 0.0f ? scale : 1.0f / sqrtf(float(head_dim));
}

// The online softmax of one query row: keys arrive in chunks; the row keeps
// max = the largest scaled score so far and sum = Σ exp(score − max), and the
// outputs accumulated so far, Σ exp(score − max)·v, are multiplied by
// online_softmax_rescale(old max, new max) whenever the maximum grows.
// The CPU keeps max and sum in arrays (one lane per query row); the GPU keeps
// an OnlineSoftmax per warp.
TESSERA_HD float online_softmax_rescale(float old_max, float new_max) {
  return exp_f32(old_max - new_max);
}
TESSERA_HD float online_softmax_weight(float score, float max) {
  return exp_f32(score - max);
}
TESSERA_HD float online_softmax_logsumexp(float max, float sum) {
  return max + logf(sum);
}
// Makes `chunk_max` (the largest scaled score of the next chunk) part of the
// running maximum and rescales the sum to it; returns the factor (≤ 1) that
// rescales the accumulated outputs the same way.
TESSERA_HD float online_softmax_raise_max(float& max, float& sum, float chunk_max) {
  const float new_max = chunk_max > max ? chunk_max : max;
  const float factor = online_softmax_rescale(max, new_max);
  max = new_max;
  sum *= factor;
  return factor;
}

struct OnlineSoftmax {
  float max = -INFINITY;
  float sum = 0.0f;

  // See online_softmax_raise_max; returns the factor for the accumulated outputs.
  TESSERA_HD float raise_max(float chunk_max) { return online_softmax_raise_max(max, sum, chunk_max); }
  // The unnormalised weight of a key with this scaled score; add() it to the sum.
  TESSERA_HD float weight(float score) const { return online_softmax_weight(score, max); }
  TESSERA_HD void add(float weights) { sum += weights; }
  TESSERA_HD float logsumexp() const { return online_softmax_logsumexp(max, sum); }
  TESSERA_HD float normaliser() const { return 1.0f / sum; }
};

// Backward: the softmax probability of a key, recomputed from its scaled score
// and the row's saved logsumexp.
TESSERA_HD float attention_probability(float score, float logsumexp) {
  return online_softmax_weight(score, logsumexp);
}

// Backward: d loss / d score (before the scale) for probability p, dp = dO·v
// and the row's delta = rowsum(dO∘O): dS = p·(dp − delta).
TESSERA_HD float attention_score_grad(float p, float dp, float delta) {
  return p * (dp - delta);
}

// ---------------------------------------------------------------------------
// Dropout on the attention probabilities (ops::AttentionDropout)
// ---------------------------------------------------------------------------
// The keep-mask M[b, head, t, s] of the global head = head_offset + h is a
// pure function of (seed, offset + b, head, t, s): Philox4x32-10 under the key
// `seed` with the counter (⌊s/4⌋, t, head, offset + b), whose four words are
// the uniforms of keys 4·⌊s/4⌋ .. 4·⌊s/4⌋ + 3 of query t (the CPU draws a
// tile's mask with a quarter of the calls). A key is kept when its uniform is
// ≥ p, as ops::dropout keeps an element (dropout_keep).
TESSERA_HD PhiloxOutput attention_dropout_bits(const ops::AttentionDropout& d, int64_t b, int64_t h, int64_t t,
                                               int64_t s) {
  const uint64_t head = uint64_t(d.head_offset + h) & 0xffffffffu, batch = d.offset + uint64_t(b);
  return philox_bits(d.seed, (batch << 32) | head, (uint64_t(t) << 32) | uint64_t(s >> 2));
}
// Word i of a Philox output, without indexing an array by a runtime value
// (which would move a GPU's registers to memory).
TESSERA_HD uint32_t philox_word(const PhiloxOutput& bits, int64_t i) {
  return i == 0 ? bits.v[0] : i == 1 ? bits.v[1] : i == 2 ? bits.v[2] : bits.v[3];
}
// What a probability is multiplied by, given its random word: 1/(1 − p) =
// `scale` (dropout_scale(p)) if kept, 0 if dropped.
TESSERA_HD float attention_dropout_multiplier(float p, float scale, uint32_t bits) {
  return bits_to_unit_float(bits) >= p ? scale : 0.0f;
}
// M[b, head_offset + h, t, s]/(1 − p): the multiplier of probability (t, s) of
// query head h (numbered within the call) of sequence b.
TESSERA_HD float attention_dropout_multiplier(const ops::AttentionDropout& d, int64_t b, int64_t h, int64_t t,
                                              int64_t s) {
  return attention_dropout_multiplier(d.p, dropout_scale(d.p),
                                      philox_word(attention_dropout_bits(d, b, h, t, s), s & 3));
}

// ---------------------------------------------------------------------------
// Where the query, key and value of each head are
// ---------------------------------------------------------------------------
// One token's projections in either of the two layouts the kernels serve:
//   packed  [3, H, Dh] (the GPT's): the H queries, then the H keys, then the H
//           values; every query head has its own key/value head (G = H, R = 1);
//   grouped [G, R + 2, Dh] (Llama's, as Megatron lays it out): for each
//           key/value group g, its R query heads, then its key, then its value;
//           query head h = g·R + j attends with group g's key and value, which
//           are never repeated in memory (grouped-query attention; G = 1 is
//           multi-query, G = H multi-head).
struct QkvLayout {
  int64_t heads;         // H, query heads
  int64_t groups;        // G, key/value heads (what a cache holds)
  int64_t head_dim;      // Dh
  int64_t group_stride;  // elements from group g to g + 1
  int64_t key_slot;      // the key's element offset within a group
  int64_t value_slot;    // the value's element offset within a group
  int64_t token_stride;  // elements from token t to t + 1

  TESSERA_HD int64_t queries_per_group() const { return heads / groups; }
  TESSERA_HD int64_t group_of(int64_t h) const { return h / queries_per_group(); }
  // Element offsets within one token's projections.
  TESSERA_HD int64_t query(int64_t h) const {
    return group_of(h) * group_stride + (h % queries_per_group()) * head_dim;
  }
  TESSERA_HD int64_t key(int64_t g) const { return g * group_stride + key_slot; }
  TESSERA_HD int64_t value(int64_t g) const { return g * group_stride + value_slot; }
};

// qkv [B, T, 3, H, Dh].
TESSERA_HD QkvLayout packed_qkv_layout(int64_t heads, int64_t head_dim) {
  return QkvLayout{heads, heads, head_dim, head_dim, heads * head_dim, 2 * heads * head_dim, 3 * heads * head_dim};
}

// qkv [B, T, G, R + 2, Dh].
TESSERA_HD QkvLayout grouped_qkv_layout(int64_t groups, int64_t queries_per_group, int64_t head_dim) {
  const int64_t group_stride = (queries_per_group + 2) * head_dim;
  return QkvLayout{groups * queries_per_group,
                   groups,
                   head_dim,
                   group_stride,
                   queries_per_group * head_dim,
                   (queries_per_group + 1) * head_dim,
                   groups * group_stride};
}

// The same from the shape of a qkv tensor.
inline QkvLayout packed_qkv_layout(const Shape& qkv) {  // [B, T, 3, H, Dh]
  return packed_qkv_layout(qkv[3], qkv[4]);
}
inline QkvLayout grouped_qkv_layout(const Shape& qkv) {  // [B, T, G, R + 2, Dh]
  return grouped_qkv_layout(qkv[2], qkv[3] - 2, qkv[4]);
}

// The tensors of one call: qkv [B, T, ...] in `qkv`'s layout, out [B, T, H, Dh],
// logsumexp and delta [B, H, T].
struct AttentionRows {
  int64_t batch, seq_len;
  QkvLayout qkv;

  TESSERA_HD int64_t token_offset(int64_t b, int64_t t) const { return (b * seq_len + t) * qkv.token_stride; }
  // Element offsets of (b, t, query head h, 0), (b, t, key/value group g, 0) in qkv.
  TESSERA_HD int64_t query_offset(int64_t b, int64_t t, int64_t h) const { return token_offset(b, t) + qkv.query(h); }
  TESSERA_HD int64_t key_offset(int64_t b, int64_t t, int64_t g) const { return token_offset(b, t) + qkv.key(g); }
  TESSERA_HD int64_t value_offset(int64_t b, int64_t t, int64_t g) const { return token_offset(b, t) + qkv.value(g); }
  TESSERA_HD int64_t out_offset(int64_t b, int64_t t, int64_t h) const {
    return ((b * seq_len + t) * qkv.heads + h) * qkv.head_dim;
  }
  TESSERA_HD int64_t stats_offset(int64_t b, int64_t h, int64_t t) const { return (b * qkv.heads + h) * seq_len + t; }
  // Query row (b·H + h)·T + t, the order of logsumexp [B, H, T], as (b, h, t).
  TESSERA_HD int64_t batch_of_query_row(int64_t row) const { return row / seq_len / qkv.heads; }
  TESSERA_HD int64_t head_of_query_row(int64_t row) const { return row / seq_len % qkv.heads; }
};

// delta[b, h, t] = Σ_d grad_out[b, t, h, d]·out[b, t, h, d], an index functor
// over the rows i = (b·T + t)·H + h of out [B, T, H, Dh]; delta is [B, H, T] f32.
template <typename T>
struct AttentionDelta {
  const T* grad_out;
  const T* out;
  float* delta;
  int64_t seq_len, heads, head_dim;

  TESSERA_HD void operator()(int64_t row) const {
    const T* dy = grad_out + row * head_dim;
    const T* y = out + row * head_dim;
    float total = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) total += to_float(dy[d]) * to_float(y[d]);
    const int64_t h = row % heads, t = (row / heads) % seq_len, b = row / (heads * seq_len);
    delta[(b * heads + h) * seq_len + t] = total;
  }
};

// ---------------------------------------------------------------------------
// Head vectors across a group's lanes (the row functors below)
// ---------------------------------------------------------------------------
// Lane l of a group of kLanes holds the elements d = l + kLanes·i (i < kPerLane)
// of a head vector in registers: a warp needs Dh/32 per lane, SerialGroup
// (the CPU, which runs these functors in the tests) the whole vector.
template <int kLanes, int kMaxHeadDim>
inline constexpr int kPerLane = (kMaxHeadDim + kLanes - 1) / kLanes;

// dst[i] = scale·src[lane + kLanes·i] (0 past the head dimension).
template <int kLanes, int kCount, typename T>
TESSERA_HD void load_lanes(const T* src, int head_dim, int lane, float scale, float (&dst)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int d = lane + kLanes * i;
    dst[i] = d < head_dim ? scale * to_float(src[d]) : 0.0f;
  }
}

// dst[lane + kLanes·i] = scale·src[i] within the head dimension.
template <int kLanes, int kCount, typename T>
TESSERA_HD void store_lanes(T* dst, int head_dim, int lane, float scale, const float (&src)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int d = lane + kLanes * i;
    if (d < head_dim) dst[d] = from_float<T>(scale * src[i]);
  }
}

// Σ_d a[d]·src[d] over the group, a in registers, src in memory.
template <typename Group, int kCount, typename T>
TESSERA_HD float group_dot(const Group& g, const float (&a)[kCount], const T* src, int head_dim) {
  constexpr int kLanes = int(kGroupLanes<Group>);
  float partial = 0.0f;
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int d = g.lane() + kLanes * i;
    if (d < head_dim) partial += a[i] * to_float(src[d]);
  }
  return g.sum(partial);
}

// acc[i] = acc[i]·factor + weight·src[lane + kLanes·i] (the online softmax's update).
template <int kLanes, int kCount, typename T>
TESSERA_HD void rescale_add_lanes(float (&acc)[kCount], float factor, float weight, const T* src, int head_dim,
                                  int lane) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int d = lane + kLanes * i;
    acc[i] = acc[i] * factor + (d < head_dim ? weight * to_float(src[d]) : 0.0f);
  }
}

// Calls fn(std::integral_constant<int, kMaxHeadDim>) with the smallest of 32,
// 64, 128, 256 holding head_dim: the row functors' register arrays are sized
// by it (a warp holds Dh/32 floats per lane, SerialGroup the whole vector).
template <typename Fn>
void dispatch_attention_head_dim(int64_t head_dim, Fn&& fn) {
  TESSERA_CHECK(head_dim <= 256, "attention: head dimension ", head_dim, " exceeds 256");
  if (head_dim <= 32) return fn(std::integral_constant<int, 32>{});
  if (head_dim <= 64) return fn(std::integral_constant<int, 64>{});
  if (head_dim <= 128) return fn(std::integral_constant<int, 128>{});
  return fn(std::integral_constant<int, 256>{});
}

// ---------------------------------------------------------------------------
// Training, a group of lanes per row (the CUDA backend's kernels; the CPU has
// its own blocked kernels, and runs these only in tests)
// ---------------------------------------------------------------------------
// Forward, a row functor over the query rows row = (b·H + h)·T + t (also the
// index of (b, h, t) in logsumexp): online softmax over the keys s ≤ t of
// head h's group → out, logsumexp. With dropout, a key's weight enters the
// output times its multiplier (0 or 1/(1 − p)) and the sum undropped.
template <typename T, int kMaxHeadDim>
struct AttentionForwardRow {
  const T* qkv;
  T* out;
  float* logsumexp;
  AttentionRows rows;
  float scale;
  ops::AttentionDropout dropout;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const int lane = g.lane(), dh = int(rows.qkv.head_dim);
    const int64_t t = row % rows.seq_len, b = rows.batch_of_query_row(row), h = rows.head_of_query_row(row);
    const int64_t kv = rows.qkv.group_of(h), stride = rows.qkv.token_stride;
    float q[kCount], acc[kCount];
    load_lanes<kLanes>(qkv + rows.query_offset(b, t, h), dh, lane, scale, q);
#pragma unroll
    for (int i = 0; i < kCount; ++i) acc[i] = 0.0f;
    const T* key = qkv + rows.key_offset(b, 0, kv);
    const T* value = qkv + rows.value_offset(b, 0, kv);
    OnlineSoftmax softmax;
    const bool dropping = dropout.p > 0.0f;
    for (int64_t s = 0; s <= t; ++s, key += stride, value += stride) {
      const float score = group_dot(g, q, key, dh);
      const float factor = softmax.raise_max(score);
      const float weight = softmax.weight(score);
      softmax.add(weight);
      const float kept = dropping ? attention_dropout_multiplier(dropout, b, h, t, s) : 1.0f;
      rescale_add_lanes<kLanes>(acc, factor, weight * kept, value, dh, lane);
    }
    store_lanes<kLanes>(out + rows.out_offset(b, t, h), dh, lane, softmax.normaliser(), acc);
    if (lane == 0) logsumexp[row] = softmax.logsumexp();
  }
};

// What the two backward row functors read and write.
template <typename T>
struct AttentionBackwardArgs {
  const T* grad_out;  // [B, T, H, Dh]
  const T* qkv;
  const float* logsumexp;  // [B, H, T]
  const float* delta;      // [B, H, T]: rowsum(dO∘O), AttentionDelta's
  T* grad_qkv;
  AttentionRows rows;
  float scale;
  ops::AttentionDropout dropout;  // the forward's
};

// Backward, a row functor over the query rows (numbered as the forward's):
// dQ = scale·Σ_{s≤t} dS[t, s]·k_s, with dS = P∘(dP∘M/(1 − p) − delta) under dropout.
template <typename T, int kMaxHeadDim>
struct AttentionGradQueryRow {
  AttentionBackwardArgs<T> args;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const AttentionRows& rows = args.rows;
    const int lane = g.lane(), dh = int(rows.qkv.head_dim);
    const int64_t t = row % rows.seq_len, b = rows.batch_of_query_row(row), h = rows.head_of_query_row(row);
    const int64_t kv = rows.qkv.group_of(h), stride = rows.qkv.token_stride;
    float q[kCount], dout[kCount], grad[kCount];
    load_lanes<kLanes>(args.qkv + rows.query_offset(b, t, h), dh, lane, args.scale, q);
    load_lanes<kLanes>(args.grad_out + rows.out_offset(b, t, h), dh, lane, 1.0f, dout);
#pragma unroll
    for (int i = 0; i < kCount; ++i) grad[i] = 0.0f;
    const float lse = args.logsumexp[row], row_delta = args.delta[row];
    const T* key = args.qkv + rows.key_offset(b, 0, kv);
    const T* value = args.qkv + rows.value_offset(b, 0, kv);
    const bool dropping = args.dropout.p > 0.0f;
    for (int64_t s = 0; s <= t; ++s, key += stride, value += stride) {
      const float p = attention_probability(group_dot(g, q, key, dh), lse);
      const float kept = dropping ? attention_dropout_multiplier(args.dropout, b, h, t, s) : 1.0f;
      const float ds = attention_score_grad(p, group_dot(g, dout, value, dh) * kept, row_delta);
      rescale_add_lanes<kLanes>(grad, 1.0f, ds, key, dh, lane);
    }
    store_lanes<kLanes>(args.grad_qkv + rows.query_offset(b, t, h), dh, lane, args.scale, grad);
  }
};

// Backward, a row functor over the key rows row = (b·G + g)·T + s: the
// gradients of group g's key and value at token s, summed over the group's R
// query heads and their queries t ≥ s: dV = Σ P[t, s]·dO_t,
// dK = scale·Σ dS[t, s]·q_t (under dropout P∘M/(1 − p) in dV, and dS as
// AttentionGradQueryRow's). One writer per key row: no atomics.
template <typename T, int kMaxHeadDim>
struct AttentionGradKeyValueRow {
  AttentionBackwardArgs<T> args;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const AttentionRows& rows = args.rows;
    const int lane = g.lane(), dh = int(rows.qkv.head_dim);
    const int64_t s = row % rows.seq_len, b = row / rows.seq_len / rows.qkv.groups;
    const int64_t kv = row / rows.seq_len % rows.qkv.groups, per_group = rows.qkv.queries_per_group();
    float k[kCount], v[kCount], grad_k[kCount], grad_v[kCount];
    load_lanes<kLanes>(args.qkv + rows.key_offset(b, s, kv), dh, lane, 1.0f, k);
    load_lanes<kLanes>(args.qkv + rows.value_offset(b, s, kv), dh, lane, 1.0f, v);
#pragma unroll
    for (int i = 0; i < kCount; ++i) grad_k[i] = grad_v[i] = 0.0f;
    const int64_t qkv_stride = rows.qkv.token_stride, out_stride = rows.qkv.heads * rows.qkv.head_dim;
    const bool dropping = args.dropout.p > 0.0f;
    for (int64_t h = kv * per_group; h < (kv + 1) * per_group; ++h) {
      const T* query = args.qkv + rows.query_offset(b, s, h);
      const T* grad_out = args.grad_out + rows.out_offset(b, s, h);
      const int64_t stats = rows.stats_offset(b, h, 0);
      for (int64_t t = s; t < rows.seq_len; ++t, query += qkv_stride, grad_out += out_stride) {
        float q[kCount], dout[kCount];
        load_lanes<kLanes>(query, dh, lane, args.scale, q);
        load_lanes<kLanes>(grad_out, dh, lane, 1.0f, dout);
        float score = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < kCount; ++i) score += q[i] * k[i], dp += dout[i] * v[i];
        const float p = attention_probability(g.sum(score), args.logsumexp[stats + t]);
        const float kept = dropping ? attention_dropout_multiplier(args.dropout, b, h, t, s) : 1.0f;
        const float ds = attention_score_grad(p, g.sum(dp) * kept, args.delta[stats + t]);
        const float dropped_p = p * kept;
#pragma unroll
        for (int i = 0; i < kCount; ++i) grad_v[i] += dropped_p * dout[i], grad_k[i] += ds * q[i];
      }
    }
    store_lanes<kLanes>(args.grad_qkv + rows.key_offset(b, s, kv), dh, lane, 1.0f, grad_k);  // q was scaled already
    store_lanes<kLanes>(args.grad_qkv + rows.value_offset(b, s, kv), dh, lane, 1.0f, grad_v);
  }
};

// ---------------------------------------------------------------------------
// Generation: attention over a key/value cache
// ---------------------------------------------------------------------------
// The longest head vector CachedAttentionRow accumulates (ops:: checks it).
inline constexpr int64_t kCachedAttentionMaxHeadDim = 256;

// Where the cache keys/values [B, G, S, Dh] (G = the layout's key/value
// heads; H for the packed layout) and the new tokens qkv [B, Tn, ...] are.
struct CacheLayout {
  AttentionRows rows;  // the new tokens: seq_len = Tn
  int64_t capacity, position;

  TESSERA_HD int64_t new_tokens() const { return rows.seq_len; }
  TESSERA_HD int64_t head_dim() const { return rows.qkv.head_dim; }
  TESSERA_HD int64_t cache_offset(int64_t b, int64_t g, int64_t s) const {
    return ((b * rows.qkv.groups + g) * capacity + s) * rows.qkv.head_dim;
  }
};

// keys/values[b, g, position + t, d] = the key/value of group g of new token t:
// an index functor over the elements (b, t, g, d) of the new tokens' keys.
template <typename T>
struct KvAppend {
  const T* qkv;
  T* keys;
  T* values;
  CacheLayout cache;

  TESSERA_HD void operator()(int64_t i) const {
    const int64_t dh = cache.head_dim(), groups = cache.rows.qkv.groups, tokens = cache.new_tokens();
    const int64_t d = i % dh, g = (i / dh) % groups, t = (i / (dh * groups)) % tokens, b = i / (dh * groups * tokens);
    const int64_t to = cache.cache_offset(b, g, cache.position + t) + d;
    keys[to] = qkv[cache.rows.key_offset(b, t, g) + d];
    values[to] = qkv[cache.rows.value_offset(b, t, g) + d];
  }
};

// out[b, t, h] for one new token: an index functor over the rows
// (b·Tn + t)·H + h of out [B, Tn, H, Dh]; the query at position + t attends to
// cached positions 0 ..= position + t of its group with the online softmax above.
template <typename T>
struct CachedAttentionRow {
  const T* qkv;
  const T* keys;
  const T* values;
  T* out;
  CacheLayout cache;
  float scale;

  TESSERA_HD void operator()(int64_t row) const {
    const int64_t heads = cache.rows.qkv.heads, h = row % heads, t = (row / heads) % cache.new_tokens();
    const int64_t b = row / (heads * cache.new_tokens()), dh = cache.head_dim(), kv = cache.rows.qkv.group_of(h);
    const T* q = qkv + cache.rows.query_offset(b, t, h);
    float accumulated[kCachedAttentionMaxHeadDim];
    for (int64_t d = 0; d < dh; ++d) accumulated[d] = 0.0f;
    OnlineSoftmax softmax;
    for (int64_t s = 0; s <= cache.position + t; ++s) {
      const T* k = keys + cache.cache_offset(b, kv, s);
      const T* v = values + cache.cache_offset(b, kv, s);
      float score = 0.0f;
      for (int64_t d = 0; d < dh; ++d) score += to_float(q[d]) * to_float(k[d]);
      score *= scale;
      const float factor = softmax.raise_max(score);
      const float weight = softmax.weight(score);
      softmax.add(weight);
      for (int64_t d = 0; d < dh; ++d) accumulated[d] = accumulated[d] * factor + weight * to_float(v[d]);
    }
    const float normaliser = softmax.normaliser();
    T* y = out + row * dh;
    for (int64_t d = 0; d < dh; ++d) y[d] = from_float<T>(accumulated[d] * normaliser);
  }
};

// How the cached attention on a GPU splits the cache positions of each query
// row (b, t, h) into blocks of `positions`: `per_row` blocks cover the longest
// row (position + Tn positions); a row of length L uses the first covering(L).
struct CacheBlocks {
  int64_t per_row, positions;

  TESSERA_HD int64_t covering(int64_t length) const { return (length + positions - 1) / positions; }
};

// Blocks for `rows` query rows, the longest attending to `longest` positions:
// enough (row, block) items to fill a large GPU (kCacheBlockItems warps,
// about 16 per SM of a 132-SM H100) where the rows alone are too few, but
// blocks no shorter than kCacheBlockMinPositions, below which the merge costs
// more than the split gains.
inline constexpr int64_t kCacheBlockItems = 2048;
inline constexpr int64_t kCacheBlockMinPositions = 32;
inline CacheBlocks cache_blocks(int64_t rows, int64_t longest) {
  const int64_t wanted = std::max<int64_t>(1, (kCacheBlockItems + rows - 1) / std::max<int64_t>(1, rows));
  const int64_t most = std::max<int64_t>(1, longest / kCacheBlockMinPositions);
  const int64_t count = std::min(wanted, most);
  const int64_t positions = std::max<int64_t>(1, (longest + count - 1) / count);
  return CacheBlocks{(longest + positions - 1) / positions, positions};
}

// The partials of each (row, block) item, item = row·per_row + block, f32:
// max [items] the block's largest scaled score, sum [items] Σ e^(score − max),
// acc [items, Dh] Σ e^(score − max)·v. Blocks past a row's length are not written.
struct CachePartials {
  float* acc;
  float* max;
  float* sum;
};

// One (row, block) item: the online softmax of CachedAttentionRow over the
// block's positions, written as partials. A row functor: the group's lanes
// hold the query and the accumulated values in registers (load_lanes above),
// and a score is a group sum.
template <typename T, int kMaxHeadDim>
struct CachedAttentionBlock {
  const T* qkv;  // the new tokens [B, Tn, ...]
  const T* keys;
  const T* values;
  CachePartials partials;
  CacheLayout cache;
  CacheBlocks blocks;
  float scale;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t item) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kCount = kPerLane<kLanes, kMaxHeadDim>;
    const int64_t row = item / blocks.per_row, first = (item % blocks.per_row) * blocks.positions;
    const int64_t heads = cache.rows.qkv.heads, h = row % heads, t = (row / heads) % cache.new_tokens();
    const int64_t b = row / (heads * cache.new_tokens()), kv = cache.rows.qkv.group_of(h);
    const int64_t limit = cache.position + t + 1;  // the row attends to positions [0, limit)
    const int64_t end = first + blocks.positions < limit ? first + blocks.positions : limit;
    if (first >= end) return;  // past the row's causal limit: the merge leaves it out
    const int dh = int(cache.head_dim()), lane = g.lane();
    float query[kCount], acc[kCount];
    load_lanes<kLanes>(qkv + cache.rows.query_offset(b, t, h), dh, lane, scale, query);
#pragma unroll
    for (int i = 0; i < kCount; ++i) acc[i] = 0.0f;
    OnlineSoftmax softmax;
    for (int64_t s = first; s < end; ++s) {
      const float score = group_dot(g, query, keys + cache.cache_offset(b, kv, s), dh);
      const float factor = softmax.raise_max(score);
      const float weight = softmax.weight(score);
      softmax.add(weight);
      rescale_add_lanes<kLanes>(acc, factor, weight, values + cache.cache_offset(b, kv, s), dh, lane);
    }
    store_lanes<kLanes>(partials.acc + item * dh, dh, lane, 1.0f, acc);
    if (lane == 0) {
      partials.max[item] = softmax.max;
      partials.sum[item] = softmax.sum;
    }
  }
};

// out[row, d] from the partials of the row's blocks, merged by log-sum-exp:
// with m = max_j max_j,  out = Σ_j e^(max_j − m)·acc_j[d] / Σ_j e^(max_j − m)·sum_j.
// An index functor over the elements i = row·Dh + d of out [B, Tn, H, Dh].
template <typename T>
struct CachedAttentionMerge {
  CachePartials partials;
  T* out;
  CacheLayout cache;
  CacheBlocks blocks;

  TESSERA_HD void operator()(int64_t i) const {
    const int64_t dh = cache.head_dim(), row = i / dh, d = i % dh;
    const int64_t t = (row / cache.rows.qkv.heads) % cache.new_tokens();
    const int64_t first = row * blocks.per_row, used = blocks.covering(cache.position + t + 1);
    float max = -INFINITY;
    for (int64_t j = first; j < first + used; ++j) max = fmaxf(max, partials.max[j]);
    float numerator = 0.0f, denominator = 0.0f;
    for (int64_t j = first; j < first + used; ++j) {
      const float factor = online_softmax_rescale(partials.max[j], max);
      numerator += factor * partials.acc[j * dh + d];
      denominator += factor * partials.sum[j];
    }
    out[i] = from_float<T>(numerator / denominator);
  }
};

}  // namespace tessera
