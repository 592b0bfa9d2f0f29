// Helpers shared by the attention tests of both projection layouts (the GPT's
// packed qkv, tests/kernels/test_attention.cpp; Llama's grouped qkv,
// tests/kernels/test_grouped_attention.cpp): tolerances, token slices of a
// sequence, the chunks the cached attention is fed, and the GPU's way of
// computing the cached attention (blocks merged by log-sum-exp) run on the CPU;
// the dropout mask the kernels draw, as the reference takes it, and the
// checks of dropout both layouts share.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "core/context.h"
#include "kernels/functors/attention.h"
#include "kernels/functors/row_group.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/reference_attention.h"
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

// The multipliers of `dropout`'s mask as the kernels draw them
// (attention_dropout_multiplier, whose keep rate and independence
// tests/kernels/test_attention_dropout.cpp checks); none for p = 0.
inline AttentionMask dropout_mask(const ops::AttentionDropout& dropout) {
  if (dropout.p == 0.0f) return {};
  return [dropout](int64_t b, int64_t h, int64_t t, int64_t s) {
    return double(attention_dropout_multiplier(dropout, b, h, t, s));
  };
}

// Elements [first, first + count) of every row of `row_length` elements of
// `values`: a range of heads of out [B, T, H, Dh] (rows of H·Dh), of the GPT's
// qkv [B, T, 3, H, Dh] (rows of H·Dh, each projection's) or of whole groups
// of Llama's qkv [B, T, G, R + 2, Dh] (rows of G·(R + 2)·Dh).
inline std::vector<double> row_range(const std::vector<double>& values, int64_t row_length, int64_t first,
                                     int64_t count) {
  std::vector<double> part;
  for (size_t row = 0; row < values.size(); row += size_t(row_length))
    part.insert(part.end(), values.begin() + int64_t(row) + first, values.begin() + int64_t(row) + first + count);
  return part;
}

// One forward and backward of either layout's attention (ops::attention_* or
// ops::grouped_attention_*) into poisoned outputs: out and grad_out
// [B, T, H, Dh], logsumexp [B, H, T].
using AttentionForward = void (*)(const Tensor&, Tensor&, Tensor&, float, const ops::AttentionDropout&);
using AttentionBackward = void (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, float,
                                   const ops::AttentionDropout&);
struct AttentionRun {
  Tensor out, lse, grad_qkv;
};
inline AttentionRun run_attention(Context& ctx, AttentionForward forward, AttentionBackward backward, const Tensor& qkv,
                                  const Tensor& grad_out, float scale, const ops::AttentionDropout& dropout) {
  const DType dtype = qkv.dtype();
  AttentionRun run{poisoned(ctx, grad_out.shape(), dtype),
                   poisoned(ctx, Shape{qkv.size(0), grad_out.size(2), qkv.size(1)}, DType::f32),
                   poisoned(ctx, qkv.shape(), dtype)};
  forward(qkv, run.out, run.lse, scale, dropout);
  backward(grad_out, qkv, run.out, run.lse, run.grad_qkv, scale, dropout);
  return run;
}

// The GPU's forward and backward against the CPU's, with or without dropout
// (the GPU must draw the CPU's mask); both backwards from the CPU's forward
// results, so that only the backward differs.
inline void expect_gpu_matches_cpu(Context& ctx, AttentionForward forward, AttentionBackward backward,
                                   const Tensor& qkv, const Tensor& grad_out, float scale,
                                   const ops::AttentionDropout& dropout, Device gpu) {
  const DType dtype = qkv.dtype();
  const Shape lse_shape{qkv.size(0), grad_out.size(2), qkv.size(1)};
  const Tensor qkv_gpu = qkv.to(gpu), grad_out_gpu = grad_out.to(gpu);
  Tensor out_cpu = poisoned(ctx, grad_out.shape(), dtype), lse_cpu = poisoned(ctx, lse_shape, DType::f32);
  Tensor out_gpu = poisoned(ctx, grad_out.shape(), dtype, gpu), lse_gpu = poisoned(ctx, lse_shape, DType::f32, gpu);
  forward(qkv, out_cpu, lse_cpu, scale, dropout);
  forward(qkv_gpu, out_gpu, lse_gpu, scale, dropout);
  // f32: both devices carry the score rounding explained at output_tolerance.
  const Tolerance tolerance = attention_device_tolerance(dtype);
  EXPECT_TRUE(all_close(out_gpu, out_cpu, tolerance)) << "out";
  EXPECT_TRUE(all_close(lse_gpu, lse_cpu, device_tolerance(DType::f32))) << "logsumexp";
  const Tensor out_gpu_in = out_cpu.to(gpu), lse_gpu_in = lse_cpu.to(gpu);
  Tensor grad_cpu = poisoned(ctx, qkv.shape(), dtype), grad_gpu = poisoned(ctx, qkv.shape(), dtype, gpu);
  backward(grad_out, qkv, out_cpu, lse_cpu, grad_cpu, scale, dropout);
  backward(grad_out_gpu, qkv_gpu, out_gpu_in, lse_gpu_in, grad_gpu, scale, dropout);
  EXPECT_TRUE(all_close(grad_gpu, grad_cpu, tolerance)) << "grad_qkv";
}

// p = 0 draws nothing: whatever the seed and offsets, the plain attention's
// results (no dropout argument) bit for bit.
inline void expect_dropout_zero_is_the_plain_attention(Context& ctx, AttentionForward forward,
                                                       AttentionBackward backward, const Tensor& qkv,
                                                       const Tensor& grad_out, uint64_t seed) {
  const AttentionRun plain = run_attention(ctx, forward, backward, qkv, grad_out, 0.0f, {});
  const AttentionRun zero = run_attention(ctx, forward, backward, qkv, grad_out, 0.0f, {0.0f, seed, 4, 9});
  EXPECT_TRUE(all_close(zero.out, plain.out.to_doubles(), Tolerance{0, 0})) << "out";
  EXPECT_TRUE(all_close(zero.lse, plain.lse.to_doubles(), Tolerance{0, 0})) << "logsumexp";
  EXPECT_TRUE(all_close(zero.grad_qkv, plain.grad_qkv.to_doubles(), Tolerance{0, 0})) << "grad_qkv";
}

// Forward and backward of `qkv` with `dropout` against the reference with
// the kernels' mask: out, logsumexp (undropped), and the gradient against the
// reference's backward from the stored output and, with `numeric`, against
// central differences of the reference with the mask fixed (plus what the
// stored output's rounding changes, stored_output_rounding).
inline void expect_dropout_matches_the_reference(Context& ctx, AttentionForward forward, AttentionBackward backward,
                                                 const AttentionProblem& problem, const RandomTensor& qkv,
                                                 const RandomTensor& grad_out, float scale,
                                                 const ops::AttentionDropout& dropout, bool numeric) {
  const DType dtype = qkv.tensor.dtype();
  const AttentionMask mask = dropout_mask(dropout);
  const AttentionRun run = run_attention(ctx, forward, backward, qkv.tensor, grad_out.tensor, scale, dropout);
  const AttentionReference ref = reference_attention(problem, qkv.values, mask);
  EXPECT_TRUE(all_close(run.out, ref.out, output_tolerance(dtype))) << "out";
  EXPECT_TRUE(all_close(run.lse, ref.lse, forward_tolerance(DType::f32))) << "logsumexp";
  EXPECT_FALSE(all_close(run.out, reference_attention(problem, qkv.values).out, output_tolerance(dtype)))
      << "nothing was dropped";
  const std::vector<double> stored = run.out.to_doubles();
  EXPECT_TRUE(all_close(run.grad_qkv, reference_attention_backward(problem, qkv.values, grad_out.values, stored, mask),
                        gradient_tolerance(dtype)))
      << "analytic";
  if (!numeric) return;
  const auto f = [&](const Inputs& in) { return reference_attention(problem, in[0], mask).out; };
  std::vector<double> expected = numeric_gradient(f, Inputs{qkv.values}, 0, grad_out.values);
  const std::vector<double> rounding = stored_output_rounding(problem, qkv.values, grad_out.values, stored, mask);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += rounding[i];
  EXPECT_TRUE(all_close(run.grad_qkv, expected, gradient_tolerance(dtype))) << "numeric";
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
