// Helpers shared by the attention tests of both projection layouts (the GPT's
// packed qkv, tests/kernels/test_attention.cpp; Llama's grouped qkv,
// tests/kernels/test_grouped_attention.cpp): tolerances, token slices of a
// sequence, the chunks the cached attention is fed, and the GPU's way of
// computing the cached attention (blocks merged by log-sum-exp) run on the CPU.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "core/context.h"
#include "kernels/functors/attention.h"
#include "kernels/functors/row_group.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/test_support.h"

namespace tessera::testing {

// f32 outputs: a score is a sum of Dh products, rounded to ~Dh·2^-24·Σ|q·k|·scale
// (≈ 3e-6 for Dh = 80 and scores of spread ~4); exp turns that into a relative
// error of the weights, and the output, a weighted mean of values of size ~2
// that may cancel to near 0, inherits it as an absolute error.
inline Tolerance output_tolerance(DType dtype) {
  Tolerance tolerance = forward_tolerance(dtype);
  tolerance.abs = std::max(tolerance.abs, 2e-5);
  return tolerance;
}
inline Tolerance gradient_tolerance(DType dtype) {
  Tolerance tolerance = backward_tolerance(dtype);
  tolerance.abs = std::max(tolerance.abs, 2e-5);
  return tolerance;
}
// GPU against CPU: both carry the score rounding explained at output_tolerance.
inline Tolerance attention_device_tolerance(DType dtype) {
  Tolerance tolerance = device_tolerance(dtype);
  tolerance.abs = std::max(tolerance.abs, 2e-5);
  return tolerance;
}

// Tokens [t0, t1) of every sequence of `values`, laid out [B, T, per token...].
inline std::vector<double> token_slice(const std::vector<double>& values, int64_t batch, int64_t seq_len, int64_t t0,
                                       int64_t t1) {
  const int64_t per_token = int64_t(values.size()) / (batch * seq_len);
  std::vector<double> slice;
  for (int64_t b = 0; b < batch; ++b)
    slice.insert(slice.end(), values.begin() + (b * seq_len + t0) * per_token,
                 values.begin() + (b * seq_len + t1) * per_token);
  return slice;
}

// The same as a tensor [B, t1 − t0, shape[2:]...] of `dtype` on `device`
// (`values` hold a tensor of `shape`, representable in `dtype`).
inline Tensor token_rows(Context& ctx, const Shape& shape, const std::vector<double>& values, int64_t t0, int64_t t1,
                         DType dtype, Device device = Device::cpu()) {
  return ctx.from_doubles(shape.with_dim(1, t1 - t0), dtype, token_slice(values, shape[0], shape[1], t0, t1), device);
}

// Chunk lengths covering T: a prompt of `prompt` tokens, then 1, 1, 3, 1, 1, 3, ...
inline std::vector<int64_t> chunk_lengths(int64_t seq_len, int64_t prompt) {
  std::vector<int64_t> lengths{std::min(prompt, seq_len)};
  for (int64_t done = lengths[0], i = 0; done < seq_len; ++i) {
    lengths.push_back(std::min<int64_t>(i % 3 == 2 ? 3 : 1, seq_len - done));
    done += lengths.back();
  }
  return lengths;
}

// Blocks of `positions` covering `longest` positions.
inline CacheBlocks blocks_of(int64_t longest, int64_t positions) {
  return CacheBlocks{(longest + positions - 1) / positions, positions};
}

// The GPU's cached attention run on the CPU for the new tokens `chunk`
// [B, Tn, ...] in `layout`: each query row's cache positions in `blocks`, a
// block's partials by CachedAttentionBlock (one lane), merged by
// CachedAttentionMerge into a poisoned out [B, Tn, H, Dh]. The partials start
// as NaN, so a block the merge reads but no item wrote shows in the output.
inline Tensor blocked_cached_attention(Context& ctx, const Tensor& chunk, const QkvLayout& layout, const Tensor& keys,
                                       const Tensor& values, int64_t position, float scale, const CacheBlocks& blocks) {
  const CacheLayout cache{AttentionRows{chunk.size(0), chunk.size(1), layout}, keys.size(2), position};
  const int64_t rows = chunk.size(0) * chunk.size(1) * layout.heads, items = rows * blocks.per_row;
  std::vector<float> scratch(size_t(items * (layout.head_dim + 2)), std::numeric_limits<float>::quiet_NaN());
  const CachePartials partials{scratch.data(), scratch.data() + items * layout.head_dim,
                               scratch.data() + items * (layout.head_dim + 1)};
  Tensor out = poisoned(ctx, Shape{chunk.size(0), chunk.size(1), layout.heads, layout.head_dim}, chunk.dtype());
  dispatch_float(chunk.dtype(), "blocked_cached_attention", [&](auto tag) {
    using T = decltype(tag);
    const float s = attention_scale(scale, layout.head_dim);
    const CachedAttentionBlock<T, kCachedAttentionMaxHeadDim> block{
        chunk.data<T>(), keys.data<T>(), values.data<T>(), partials, cache, blocks, s};
    for (int64_t item = 0; item < items; ++item) block(SerialGroup{}, item);
    const CachedAttentionMerge<T> merge{partials, out.data<T>(), cache, blocks};
    for (int64_t i = 0; i < rows * layout.head_dim; ++i) merge(i);
  });
  return out;
}

}  // namespace tessera::testing
