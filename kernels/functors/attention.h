// Causal attention: the per-row math shared by the CPU (blocked, flash-attention
// style) and CUDA (warp per row) backends: the online softmax (running maximum
// and sum, with the factor that rescales what was accumulated so far), the
// probabilities and score gradients of the backward pass recomputed from the
// saved logsumexp, and the row functor computing delta = rowsum(dO∘O).
// Exponentials use exp_f32 (kernels/functors/float_math.h), which CPU loops vectorise.
// Generation's cached attention: KvAppend (an index functor both backends
// run) writes the new keys and values; the CPU then runs CachedAttentionRow,
// one query row per call. A GPU splits each row's cache positions into
// blocks instead (CacheBlocks): a warp per (row, block) computes the block's
// online-softmax partials (CachedAttentionBlock, a row functor), and an index
// functor merges each row's blocks by log-sum-exp (CachedAttentionMerge), so
// that a decode step of a dozen rows still fills the GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "kernels/functors/float_math.h"
#include "kernels/functors/row_group.h"

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

// The longest head vector CachedAttentionRow accumulates (ops:: checks it).
inline constexpr int64_t kCachedAttentionMaxHeadDim = 256;

// The packed projections qkv [B, T, 3, H, Dh] (which: 0 query, 1 key, 2
// value), as the training kernels of both backends and the cached attention
// index them. Elements from token t to t + 1:
TESSERA_HD int64_t packed_qkv_token_stride(int64_t heads, int64_t head_dim) {
  return 3 * heads * head_dim;
}

// Element offset of (b, t, which, h, 0) in qkv [B, T, 3, H, Dh].
TESSERA_HD int64_t packed_qkv_offset(int64_t b, int64_t t, int64_t which, int64_t h, int64_t tokens, int64_t heads,
                                     int64_t head_dim) {
  return (b * tokens + t) * packed_qkv_token_stride(heads, head_dim) + (which * heads + h) * head_dim;
}

// Where the cache [B, H, S, Dh] and the new tokens qkv [B, Tn, 3, H, Dh] are.
struct CacheLayout {
  int64_t new_tokens, heads, head_dim, capacity, position;

  TESSERA_HD int64_t cache_offset(int64_t b, int64_t h, int64_t s) const {
    return ((b * heads + h) * capacity + s) * head_dim;
  }
};

// keys/values[b, h, position + t, d] = qkv[b, t, 1/2, h, d]: an index functor
// over the elements (b, t, h, d) of the new tokens' keys.
template <typename T>
struct KvAppend {
  const T* qkv;
  T* keys;
  T* values;
  CacheLayout cache;

  TESSERA_HD void operator()(int64_t i) const {
    const int64_t d = i % cache.head_dim, h = (i / cache.head_dim) % cache.heads;
    const int64_t t = (i / (cache.head_dim * cache.heads)) % cache.new_tokens;
    const int64_t b = i / (cache.head_dim * cache.heads * cache.new_tokens);
    const int64_t key = packed_qkv_offset(b, t, 1, h, cache.new_tokens, cache.heads, cache.head_dim) + d;
    const int64_t to = cache.cache_offset(b, h, cache.position + t) + d;
    const int64_t value = packed_qkv_offset(b, t, 2, h, cache.new_tokens, cache.heads, cache.head_dim) + d;
    keys[to] = qkv[key];
    values[to] = qkv[value];
  }
};

// out[b, t, h] for one new token: an index functor over the rows
// (b·Tn + t)·H + h of out [B, Tn, H, Dh]; the query at position + t attends to
// cached positions 0 ..= position + t with the online softmax above.
template <typename T>
struct CachedAttentionRow {
  const T* qkv;
  const T* keys;
  const T* values;
  T* out;
  CacheLayout cache;
  float scale;

  TESSERA_HD void operator()(int64_t row) const {
    const int64_t h = row % cache.heads, t = (row / cache.heads) % cache.new_tokens;
    const int64_t b = row / (cache.heads * cache.new_tokens), dh = cache.head_dim;
    const T* q = qkv + packed_qkv_offset(b, t, 0, h, cache.new_tokens, cache.heads, dh);
    float accumulated[kCachedAttentionMaxHeadDim];
    for (int64_t d = 0; d < dh; ++d) accumulated[d] = 0.0f;
    OnlineSoftmax softmax;
    for (int64_t s = 0; s <= cache.position + t; ++s) {
      const T* k = keys + cache.cache_offset(b, h, s);
      const T* v = values + cache.cache_offset(b, h, s);
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
// hold the lane-strided elements d = lane + lanes·i of the query and the
// accumulated values in registers (kMaxHeadDim / lanes of them, so a warp
// needs 8 for Dh = 256), and a score is a group sum.
template <typename T, int kMaxHeadDim>
struct CachedAttentionBlock {
  const T* qkv;  // the new tokens [B, Tn, 3, H, Dh]
  const T* keys;
  const T* values;
  CachePartials partials;
  CacheLayout cache;
  CacheBlocks blocks;
  float scale;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t item) const {
    constexpr int kLanes = int(kGroupLanes<Group>), kPerLane = (kMaxHeadDim + kLanes - 1) / kLanes;
    const int64_t row = item / blocks.per_row, first = (item % blocks.per_row) * blocks.positions;
    const int64_t h = row % cache.heads, t = (row / cache.heads) % cache.new_tokens;
    const int64_t b = row / (cache.heads * cache.new_tokens);
    const int64_t limit = cache.position + t + 1;  // the row attends to positions [0, limit)
    const int64_t end = first + blocks.positions < limit ? first + blocks.positions : limit;
    if (first >= end) return;  // past the row's causal limit: the merge leaves it out
    const int dh = int(cache.head_dim), lane = g.lane();
    const T* q = qkv + packed_qkv_offset(b, t, 0, h, cache.new_tokens, cache.heads, dh);
    float query[kPerLane], acc[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + kLanes * i;
      query[i] = d < dh ? scale * to_float(q[d]) : 0.0f;
      acc[i] = 0.0f;
    }
    OnlineSoftmax softmax;
    for (int64_t s = first; s < end; ++s) {
      const T* k = keys + cache.cache_offset(b, h, s);
      const T* v = values + cache.cache_offset(b, h, s);
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + kLanes * i;
        if (d < dh) partial += query[i] * to_float(k[d]);
      }
      const float score = g.sum(partial);
      const float factor = softmax.raise_max(score);
      const float weight = softmax.weight(score);
      softmax.add(weight);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + kLanes * i;
        acc[i] = acc[i] * factor + (d < dh ? weight * to_float(v[d]) : 0.0f);
      }
    }
    float* out = partials.acc + item * dh;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + kLanes * i;
      if (d < dh) out[d] = acc[i];
    }
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
    const int64_t dh = cache.head_dim, row = i / dh, d = i % dh;
    const int64_t t = (row / cache.heads) % cache.new_tokens;
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
