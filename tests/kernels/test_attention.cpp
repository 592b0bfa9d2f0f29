// Causal attention: forward against a naive double reference that builds the
// full score matrix, backward against central differences of that reference
// and against a naive analytic double backward, GPU against CPU, a long
// sequence whose scratch memory must stay far below T×T, and argument checks.
// The cached attention of generation (ops::attention_with_cache) against the
// same reference, fed the sequence in chunks (a prompt, then tokens one at a
// time and a few together), and its cache against the keys and values given;
// the GPU's way of computing it (the cache split into blocks, partial softmaxes
// merged by log-sum-exp) run on the CPU against the same reference. The packed
// qkv layout all of them index through (QkvLayout), against the elements
// walked in memory order. Dropout on the probabilities: forward and backward
// against the reference with the kernels' mask, p = 0 whatever the seed the
// plain attention bit for bit, and heads split in two calls with head_offset
// (as tensor-parallel ranks hold them) the whole call's results bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/functors/attention.h"
#include "kernels/ops.h"
#include "tests/kernels/attention_support.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/reference_attention.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Dims {
  int64_t batch, seq_len, heads, head_dim;
  float scale = 0.0f;  // ≤ 0: 1/√Dh

  Shape qkv() const { return Shape{batch, seq_len, 3, heads, head_dim}; }
  Shape out() const { return Shape{batch, seq_len, heads, head_dim}; }
  Shape lse() const { return Shape{batch, heads, seq_len}; }
  double effective_scale() const { return scale > 0 ? double(scale) : 1.0 / std::sqrt(double(head_dim)); }
  size_t qkv_index(int64_t b, int64_t t, int which, int64_t h, int64_t d) const {
    return size_t((((b * seq_len + t) * 3 + which) * heads + h) * head_dim + d);
  }
  size_t out_index(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return size_t(((b * seq_len + t) * heads + h) * head_dim + d);
  }
};

// The reference sees the packed layout through its index.
AttentionProblem problem_of(const Dims& g) {
  return AttentionProblem{
      g.batch,
      g.seq_len,
      g.heads,
      g.head_dim,
      g.effective_scale(),
      [g](int64_t b, int64_t t, int which, int64_t h, int64_t d) { return g.qkv_index(b, t, which, h, d); }};
}

AttentionReference reference_forward(const Dims& g, const std::vector<double>& qkv, const AttentionMask& mask = {}) {
  return reference_attention(problem_of(g), qkv, mask);
}

std::vector<double> reference_backward(const Dims& g, const std::vector<double>& qkv,
                                       const std::vector<double>& grad_out, const std::vector<double>& stored_out,
                                       const AttentionMask& mask = {}) {
  return reference_attention_backward(problem_of(g), qkv, grad_out, stored_out, mask);
}

// Scores of O(1) spread, so the softmax is neither flat nor one-hot.
RandomTensor random_qkv(Context& ctx, const Dims& g, DType dtype, std::mt19937_64& rng, Device device = Device::cpu()) {
  return random_tensor(ctx, g.qkv(), dtype, rng, -2.0, 2.0, device);
}

class Attention : public DtypeTest {};

TEST_P(Attention, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  // One token; odd sizes; several 64-row tiles with a partial last one;
  // head dims covering every micro-kernel width; a custom scale.
  for (const Dims& g :
       {Dims{2, 1, 2, 8}, Dims{1, 7, 3, 5}, Dims{2, 130, 2, 64}, Dims{1, 100, 1, 40}, Dims{1, 67, 2, 80, 0.37f}}) {
    SCOPED_TRACE("B=" + std::to_string(g.batch) + " T=" + std::to_string(g.seq_len) + " H=" + std::to_string(g.heads) +
                 " Dh=" + std::to_string(g.head_dim));
    auto qkv = random_qkv(ctx, g, dtype, rng);
    Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
    ops::attention_forward(qkv.tensor, out, lse, g.scale);
    const AttentionReference ref = reference_forward(g, qkv.values);
    EXPECT_TRUE(all_close(out, ref.out, output_tolerance(dtype))) << "out";
    // logsumexp is f32 computed in f32 from the stored inputs whatever their dtype.
    EXPECT_TRUE(all_close(lse, ref.lse, forward_tolerance(DType::f32))) << "logsumexp";
  }
}

TEST_P(Attention, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();

  // Against central differences of the reference forward, on a small case.
  {
    const Dims g{1, 9, 2, 4};
    auto qkv = random_qkv(ctx, g, dtype, rng);
    auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
    Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
    ops::attention_forward(qkv.tensor, out, lse);
    Tensor grad_qkv = poisoned(ctx, g.qkv(), dtype);
    ops::attention_backward(grad_out.tensor, qkv.tensor, out, lse, grad_qkv);
    const auto f = [&](const Inputs& in) { return reference_forward(g, in[0]).out; };
    const auto expected = numeric_gradient(f, Inputs{qkv.values}, 0, grad_out.values);
    EXPECT_TRUE(all_close(grad_qkv, expected, gradient_tolerance(dtype))) << "numeric, T=9";
  }

  // Against the analytic double backward across tile boundaries (T = 64 + 6),
  // with a custom scale; and twice, bit for bit (deterministic).
  {
    const Dims g{2, 70, 2, 24, 0.3f};
    auto qkv = random_qkv(ctx, g, dtype, rng);
    auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
    Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
    ops::attention_forward(qkv.tensor, out, lse, g.scale);
    Tensor grad_qkv = poisoned(ctx, g.qkv(), dtype);
    ops::attention_backward(grad_out.tensor, qkv.tensor, out, lse, grad_qkv, g.scale);
    EXPECT_TRUE(all_close(grad_qkv, reference_backward(g, qkv.values, grad_out.values, out.to_doubles()),
                          gradient_tolerance(dtype)))
        << "analytic, T=70";
    Tensor again = poisoned(ctx, g.qkv(), dtype);
    ops::attention_backward(grad_out.tensor, qkv.tensor, out, lse, again, g.scale);
    EXPECT_TRUE(all_close(again, grad_qkv, Tolerance{0, 0})) << "not deterministic";
  }
}

TEST_P(Attention, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  // Without dropout, and with it (the GPU must draw the CPU's mask).
  for (const Dims& g : {Dims{2, 130, 3, 64}, Dims{1, 37, 2, 5, 0.4f}, Dims{1, 70, 1, 256}, Dims{2, 1, 2, 100}})
    for (const ops::AttentionDropout& dropout : {ops::AttentionDropout{}, ops::AttentionDropout{0.3f, rng(), 2, 3}}) {
      SCOPED_TRACE("T=" + std::to_string(g.seq_len) + " Dh=" + std::to_string(g.head_dim) +
                   " dropout=" + std::to_string(dropout.p));
      expect_gpu_matches_cpu(ctx, ops::attention_forward, ops::attention_backward,
                             random_qkv(ctx, g, dtype, rng).tensor, random_tensor(ctx, g.out(), dtype, rng).tensor,
                             g.scale, dropout, gpu);
    }
}

// Dropout on the probabilities: out = (P∘M/(1 − p))·V, logsumexp undropped,
// the backward with the forward's mask, over odd sizes and several 64-row
// tiles with a custom scale, sequences and heads numbered from an offset (as
// a part of a batch on a tensor-parallel rank); small cases against central
// differences too.
TEST_P(Attention, ForwardAndBackwardWithDropout) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Dims& g : {Dims{2, 9, 2, 4}, Dims{2, 9, 3, 8}, Dims{1, 130, 2, 64}, Dims{2, 70, 2, 24, 0.3f}})
    for (const float p : {0.1f, 0.5f}) {
      SCOPED_TRACE("B=" + std::to_string(g.batch) + " T=" + std::to_string(g.seq_len) + " p=" + std::to_string(p));
      expect_dropout_matches_the_reference(ctx, ops::attention_forward, ops::attention_backward, problem_of(g),
                                           random_qkv(ctx, g, dtype, rng), random_tensor(ctx, g.out(), dtype, rng),
                                           g.scale, ops::AttentionDropout{p, rng(), 3, 5}, g.head_dim == 4);
    }
}

// p = 0 draws nothing: the plain attention's results bit for bit.
TEST_P(Attention, DropoutZeroIsThePlainAttention) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const Dims g{2, 70, 2, 24};
  expect_dropout_zero_is_the_plain_attention(ctx, ops::attention_forward, ops::attention_backward,
                                             random_qkv(ctx, g, dtype, rng).tensor,
                                             random_tensor(ctx, g.out(), dtype, rng).tensor, rng());
}

// Tensor parallelism's split: each half of the heads in a call of its own,
// numbered from its first head (head_offset), gives the whole call's
// outputs and gradients of those heads bit for bit: the same masks.
TEST_P(Attention, HeadsSplitWithHeadOffsetDrawTheWholeCallsMasks) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const Dims g{2, 70, 4, 16};
  const ops::AttentionDropout dropout{0.25f, rng(), 0, 0};
  auto qkv = random_qkv(ctx, g, dtype, rng);
  auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
  const AttentionRun whole =
      run_attention(ctx, ops::attention_forward, ops::attention_backward, qkv.tensor, grad_out.tensor, 0.0f, dropout);
  const int64_t half = g.heads / 2, row = g.heads * g.head_dim;  // qkv and out: rows of H heads
  const Dims part{g.batch, g.seq_len, half, g.head_dim};
  for (const int64_t first : {int64_t(0), half}) {
    SCOPED_TRACE("heads from " + std::to_string(first));
    const int64_t begin = first * g.head_dim, count = half * g.head_dim;
    ops::AttentionDropout rank = dropout;
    rank.head_offset = first;
    const AttentionRun split =
        run_attention(ctx, ops::attention_forward, ops::attention_backward,
                      ctx.from_doubles(part.qkv(), dtype, row_range(qkv.values, row, begin, count)),
                      ctx.from_doubles(part.out(), dtype, row_range(grad_out.values, row, begin, count)), 0.0f, rank);
    EXPECT_TRUE(all_close(split.out, row_range(whole.out.to_doubles(), row, begin, count), Tolerance{0, 0})) << "out";
    EXPECT_TRUE(all_close(split.grad_qkv, row_range(whole.grad_qkv.to_doubles(), row, begin, count), Tolerance{0, 0}))
        << "grad_qkv";
  }
}

// T = 4096: a T×T f32 matrix would be 64 MiB; forward and backward together
// must allocate less than a sixteenth of that beyond their inputs and outputs.
TEST_P(Attention, LongSequenceNeedsNoQuadraticMemory) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const Dims g{1, 4096, 1, 32};
  auto qkv = random_qkv(ctx, g, dtype, rng);
  auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
  Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
  Tensor grad_qkv = poisoned(ctx, g.qkv(), dtype);
  Allocator& host = ctx.allocator(Device::cpu());
  host.reset_peak_stats();
  const size_t before = host.stats().allocated_bytes;
  ops::attention_forward(qkv.tensor, out, lse);
  ops::attention_backward(grad_out.tensor, qkv.tensor, out, lse, grad_qkv);
  const size_t growth = host.stats().peak_allocated_bytes - before;
  const size_t quadratic = size_t(g.seq_len * g.seq_len) * sizeof(float);
  EXPECT_LT(growth, quadratic / 16) << "scratch memory grows like T×T";

  // Spot-check a few rows (first, tile edges, last) against the reference row.
  const auto got = out.to_doubles();
  const auto got_lse = lse.to_doubles();
  const double scale = g.effective_scale();
  for (const int64_t t : {int64_t(0), int64_t(63), int64_t(64), g.seq_len - 1}) {
    std::vector<double> scores(static_cast<size_t>(t + 1));
    double max = -INFINITY;
    for (int64_t s = 0; s <= t; ++s) {
      double dot = 0;
      for (int64_t d = 0; d < g.head_dim; ++d)
        dot += qkv.values[g.qkv_index(0, t, 0, 0, d)] * qkv.values[g.qkv_index(0, s, 1, 0, d)];
      scores[size_t(s)] = scale * dot;
      max = std::max(max, scores[size_t(s)]);
    }
    double sum = 0;
    for (const double x : scores) sum += std::exp(x - max);
    std::vector<double> expected(static_cast<size_t>(g.head_dim)), actual(static_cast<size_t>(g.head_dim));
    for (int64_t d = 0; d < g.head_dim; ++d) {
      for (int64_t s = 0; s <= t; ++s)
        expected[size_t(d)] += std::exp(scores[size_t(s)] - max) / sum * qkv.values[g.qkv_index(0, s, 2, 0, d)];
      actual[size_t(d)] = got[g.out_index(0, t, 0, d)];
    }
    EXPECT_TRUE(all_close(actual, expected, output_tolerance(dtype))) << "row " << t;
    EXPECT_NEAR(got_lse[size_t(t)], max + std::log(sum), 1e-4) << "logsumexp row " << t;
  }
  const auto grads = grad_qkv.to_doubles();
  EXPECT_TRUE(std::all_of(grads.begin(), grads.end(), [](double x) { return std::isfinite(x); }));
}

TEST_P(Attention, RejectsBadArguments) {
  const DType dtype = GetParam();
  Context ctx;
  const Dims g{2, 5, 3, 4};
  Tensor qkv = ctx.zeros(g.qkv(), dtype), out = ctx.zeros(g.out(), dtype), lse = ctx.zeros(g.lse(), DType::f32);
  Tensor grad_qkv = ctx.zeros(g.qkv(), dtype);
  EXPECT_NO_THROW(ops::attention_forward(qkv, out, lse));
  EXPECT_NO_THROW(ops::attention_backward(out, qkv, out, lse, grad_qkv));
  const Dims empty{2, 0, 3, 4};  // no tokens: nothing to do, but valid
  Tensor qkv0 = ctx.zeros(empty.qkv(), dtype), out0 = ctx.zeros(empty.out(), dtype);
  Tensor lse0 = ctx.zeros(empty.lse(), DType::f32), grad0 = ctx.zeros(empty.qkv(), dtype);
  EXPECT_NO_THROW(ops::attention_forward(qkv0, out0, lse0));
  EXPECT_NO_THROW(ops::attention_backward(out0, qkv0, out0, lse0, grad0));

  Tensor not_packed = ctx.zeros(Shape{2, 5, 2, 3, 4}, dtype);  // only two projections
  EXPECT_THROW(ops::attention_forward(not_packed, out, lse), Error);
  Tensor four_dims = ctx.zeros(Shape{2, 5, 3, 12}, dtype);
  EXPECT_THROW(ops::attention_forward(four_dims, out, lse), Error);
  Tensor wrong_out = ctx.zeros(Shape{2, 5, 3, 5}, dtype);
  EXPECT_THROW(ops::attention_forward(qkv, wrong_out, lse), Error);
  Tensor other_dtype = ctx.zeros(g.out(), dtype == DType::f32 ? DType::bf16 : DType::f32);
  EXPECT_THROW(ops::attention_forward(qkv, other_dtype, lse), Error);
  Tensor lse_low = ctx.zeros(g.lse(), DType::bf16);
  EXPECT_THROW(ops::attention_forward(qkv, out, lse_low), Error);
  Tensor lse_shape = ctx.zeros(Shape{2, 5, 3}, DType::f32);  // [B, T, H] instead of [B, H, T]
  EXPECT_THROW(ops::attention_forward(qkv, out, lse_shape), Error);
  Tensor ints = ctx.zeros(g.qkv(), DType::i32);
  EXPECT_THROW(ops::attention_forward(ints, out, lse), Error);

  Tensor wrong_grad = ctx.zeros(Shape{2, 5, 3, 3, 5}, dtype);
  EXPECT_THROW(ops::attention_backward(out, qkv, out, lse, wrong_grad), Error);
  EXPECT_THROW(ops::attention_backward(wrong_out, qkv, out, lse, grad_qkv), Error);
  EXPECT_THROW(ops::attention_backward(out, qkv, out, lse_shape, grad_qkv), Error);
  EXPECT_THROW(ops::attention_backward(out, qkv, out, lse, qkv), Error);  // grad_qkv overwrites qkv

  // The dropout probability in [0, 1) and a head offset that is an index, named.
  for (const ops::AttentionDropout& bad :
       {ops::AttentionDropout{1.0f}, ops::AttentionDropout{-0.1f}, ops::AttentionDropout{0.1f, 0, 0, -1}}) {
    EXPECT_THROW(ops::attention_forward(qkv, out, lse, 0.0f, bad), Error);
    EXPECT_THROW(ops::attention_backward(out, qkv, out, lse, grad_qkv, 0.0f, bad), Error);
  }
  try {
    ops::attention_forward(qkv, out, lse, 0.0f, ops::AttentionDropout{1.0f});
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("attention_forward: attention dropout probability must be in [0, 1)"),
              std::string::npos)
        << error.what();
  }
}

// The CUDA kernels hold a head in registers: Dh > 256 is refused up front.
TEST_P(Attention, GpuRejectsLargeHeadDim) {
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  const Dims g{1, 3, 1, 264};
  Tensor qkv = ctx.zeros(g.qkv(), dtype, gpu), out = ctx.zeros(g.out(), dtype, gpu);
  Tensor lse = ctx.zeros(g.lse(), DType::f32, gpu), grad_qkv = ctx.zeros(g.qkv(), dtype, gpu);
  EXPECT_THROW(ops::attention_forward(qkv, out, lse), Error);
  EXPECT_THROW(ops::attention_backward(out, qkv, out, lse, grad_qkv), Error);
}

// The sequence of random qkv of `g` fed to ops::attention_with_cache in chunks
// (chunk_lengths, a third of it as the prompt) over a poisoned cache with room
// to spare; after each chunk, check(chunk, keys, values, position, out,
// expected) with the chunk's rows of out and of the whole-sequence reference.
struct ChunkedRun {
  RandomTensor qkv;
  Tensor keys, values;  // [B, H, T + 5, Dh]
};
template <typename Check>
ChunkedRun run_in_chunks(Context& ctx, const Dims& g, DType dtype, std::mt19937_64& rng, Check&& check) {
  ChunkedRun run{random_qkv(ctx, g, dtype, rng), Tensor{}, Tensor{}};
  const AttentionReference ref = reference_forward(g, run.qkv.values);
  const int64_t capacity = g.seq_len + 5;  // room the sequence does not use
  run.keys = poisoned(ctx, Shape{g.batch, g.heads, capacity, g.head_dim}, dtype);
  run.values = poisoned(ctx, run.keys.shape(), dtype);
  int64_t position = 0;
  for (const int64_t n : chunk_lengths(g.seq_len, g.seq_len / 3 + 1)) {
    SCOPED_TRACE("tokens [" + std::to_string(position) + ", " + std::to_string(position + n) + ")");
    const Tensor chunk = token_rows(ctx, g.qkv(), run.qkv.values, position, position + n, dtype);
    Tensor out = poisoned(ctx, Shape{g.batch, n, g.heads, g.head_dim}, dtype);
    ops::attention_with_cache(chunk, run.keys, run.values, position, out, g.scale);
    check(chunk, run.keys, run.values, position, out, token_slice(ref.out, g.batch, g.seq_len, position, position + n));
    position += n;
  }
  return run;
}

std::string describe(const Dims& g) {
  return "B=" + std::to_string(g.batch) + " T=" + std::to_string(g.seq_len) + " H=" + std::to_string(g.heads) +
         " Dh=" + std::to_string(g.head_dim);
}

TEST_P(Attention, WithCacheInChunksMatchesTheWholeSequence) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Dims& g : {Dims{1, 9, 2, 8}, Dims{2, 40, 3, 16}, Dims{1, 70, 2, 64, 0.3f}, Dims{2, 12, 1, 256}}) {
    SCOPED_TRACE(describe(g));
    const auto expect_reference = [&](const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor& out,
                                      const std::vector<double>& expected) {
      EXPECT_TRUE(all_close(out, expected, output_tolerance(dtype)));
    };
    const ChunkedRun run = run_in_chunks(ctx, g, dtype, rng, expect_reference);
    // The cache holds every token's key and value, exactly as given.
    const int64_t capacity = run.keys.size(2);
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t h = 0; h < g.heads; ++h)
        for (int64_t t = 0; t < g.seq_len; ++t)
          for (int64_t d = 0; d < g.head_dim; d += 7) {
            const int64_t at = ((b * g.heads + h) * capacity + t) * g.head_dim + d;
            const Tensor k = run.keys.flatten().slice(at, at + 1), v = run.values.flatten().slice(at, at + 1);
            ASSERT_TRUE(all_close(k, {run.qkv.values[g.qkv_index(b, t, 1, h, d)]}, Tolerance{0, 0}));
            ASSERT_TRUE(all_close(v, {run.qkv.values[g.qkv_index(b, t, 2, h, d)]}, Tolerance{0, 0}));
          }
  }
}

// Each chunk again the GPU's way (the cache after the op appended the chunk):
// the GPU's plan for its rows, then one position a block, odd blocks, a single block.
TEST_P(Attention, WithCacheInBlocksMergedByLogSumExpMatchesTheWholeSequence) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Dims& g :
       {Dims{1, 9, 2, 8}, Dims{2, 40, 3, 16}, Dims{1, 100, 2, 64, 0.3f}, Dims{1, 75, 1, 256}, Dims{1, 50, 2, 5}}) {
    SCOPED_TRACE(describe(g));
    const auto expect_blocked = [&](const Tensor& chunk, const Tensor& keys, const Tensor& values, int64_t position,
                                    const Tensor&, const std::vector<double>& expected) {
      const int64_t longest = position + chunk.size(1), rows = g.batch * chunk.size(1) * g.heads;
      for (const CacheBlocks& blocks :
           {cache_blocks(rows, longest), blocks_of(longest, 1), blocks_of(longest, 7), blocks_of(longest, longest)}) {
        const Tensor out = blocked_cached_attention(ctx, chunk, packed_qkv_layout(chunk.shape()), keys, values,
                                                    position, g.scale, blocks);
        EXPECT_TRUE(all_close(out, expected, output_tolerance(dtype)))
            << blocks.per_row << " blocks of " << blocks.positions << " positions";
      }
    };
    run_in_chunks(ctx, g, dtype, rng, expect_blocked);
  }
}

// The GPU's blocks cover every position of the longest row with no block left
// empty, are no shorter than kCacheBlockMinPositions when there are several,
// and give a few rows enough (row, block) items to fill a GPU without
// multiplying many rows' work.
TEST(CacheBlocks, CoverTheCacheInEnoughBlocksOfUsefulLength) {
  for (const int64_t rows : {1, 6, 12, 100, 5000})
    for (const int64_t longest : {1, 2, 31, 32, 33, 65, 100, 1024, 4097, 100000}) {
      SCOPED_TRACE("rows=" + std::to_string(rows) + " longest=" + std::to_string(longest));
      const CacheBlocks blocks = cache_blocks(rows, longest);
      EXPECT_GE(blocks.per_row * blocks.positions, longest);
      EXPECT_LT((blocks.per_row - 1) * blocks.positions, longest);
      EXPECT_EQ(blocks.covering(longest), blocks.per_row);
      if (blocks.per_row > 1) {
        EXPECT_GE(blocks.positions, kCacheBlockMinPositions);
      }
      const int64_t items = rows * blocks.per_row;
      EXPECT_LE(items, kCacheBlockItems + rows);
      EXPECT_GE(items, std::min(rows * (longest / kCacheBlockMinPositions), kCacheBlockItems) / 2);
    }
}

TEST_P(Attention, WithCacheRejectsBadArguments) {
  const DType dtype = GetParam();
  Context ctx;
  const Dims g{1, 4, 2, 8};
  Tensor qkv = ctx.zeros(g.qkv(), dtype), out = ctx.zeros(g.out(), dtype);
  Tensor keys = ctx.zeros(Shape{1, 2, 6, 8}, dtype), values = ctx.zeros(Shape{1, 2, 6, 8}, dtype);
  EXPECT_NO_THROW(ops::attention_with_cache(qkv, keys, values, 2, out));
  EXPECT_THROW(ops::attention_with_cache(qkv, keys, values, 3, out), Error);   // 3 + 4 > 6 positions
  EXPECT_THROW(ops::attention_with_cache(qkv, keys, values, -1, out), Error);  // before the start
  Tensor three_heads = ctx.zeros(Shape{1, 3, 6, 8}, dtype);
  EXPECT_THROW(ops::attention_with_cache(qkv, three_heads, values, 0, out), Error);
  EXPECT_THROW(ops::attention_with_cache(qkv, keys, three_heads, 0, out), Error);
  EXPECT_THROW(ops::attention_with_cache(qkv, keys, keys, 0, out), Error);  // keys and values the same memory
  Tensor other = ctx.zeros(Shape{1, 2, 6, 8}, dtype == DType::f32 ? DType::bf16 : DType::f32);
  EXPECT_THROW(ops::attention_with_cache(qkv, other, values, 0, out), Error);
  const Dims wide{1, 1, 1, 264};
  Tensor wide_qkv = ctx.zeros(wide.qkv(), dtype), wide_out = ctx.zeros(wide.out(), dtype);
  Tensor wide_cache = ctx.zeros(Shape{1, 1, 2, 264}, dtype), wide_values = ctx.zeros(Shape{1, 1, 2, 264}, dtype);
  EXPECT_THROW(ops::attention_with_cache(wide_qkv, wide_cache, wide_values, 0, wide_out), Error);
}

TEST_P(Attention, GpuWithCacheMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  // A short cache (one or two blocks a row), a long one decoded a token at a
  // time (many blocks, a partial last one), odd and widest head dimensions.
  for (const Dims& g : {Dims{2, 33, 3, 64}, Dims{1, 300, 2, 80, 0.3f}, Dims{1, 70, 1, 256}, Dims{2, 45, 2, 5}}) {
    SCOPED_TRACE("T=" + std::to_string(g.seq_len) + " Dh=" + std::to_string(g.head_dim));
    auto qkv = random_qkv(ctx, g, dtype, rng);
    const Shape cache{g.batch, g.heads, g.seq_len, g.head_dim};
    Tensor keys_cpu = poisoned(ctx, cache, dtype), values_cpu = poisoned(ctx, cache, dtype);
    Tensor keys_gpu = poisoned(ctx, cache, dtype, gpu), values_gpu = poisoned(ctx, cache, dtype, gpu);
    int64_t position = 0;
    for (const int64_t n : chunk_lengths(g.seq_len, 10)) {
      const Shape out_shape{g.batch, n, g.heads, g.head_dim};
      Tensor out_cpu = poisoned(ctx, out_shape, dtype), out_gpu = poisoned(ctx, out_shape, dtype, gpu);
      ops::attention_with_cache(token_rows(ctx, g.qkv(), qkv.values, position, position + n, dtype), keys_cpu,
                                values_cpu, position, out_cpu, g.scale);
      ops::attention_with_cache(token_rows(ctx, g.qkv(), qkv.values, position, position + n, dtype, gpu), keys_gpu,
                                values_gpu, position, out_gpu, g.scale);
      EXPECT_TRUE(all_close(out_gpu, out_cpu, attention_device_tolerance(dtype))) << "tokens from " << position;
      position += n;
    }
  }
}

INSTANTIATE_FLOAT_DTYPES(Attention);

// The training kernels (CPU and CUDA) and the cached attention find q, k and v
// through QkvLayout: walking qkv [B, T, 3, H, Dh] in memory order, the n-th
// element must be (b, t, which, h, d) at offset n.
TEST(PackedQkv, OffsetsFollowTheElementsInMemoryOrder) {
  for (const Dims& g : {Dims{2, 5, 3, 7}, Dims{3, 1, 1, 4}, Dims{1, 4, 2, 1}}) {
    SCOPED_TRACE(g.qkv().to_string());
    const AttentionRows rows{g.batch, g.seq_len, packed_qkv_layout(g.qkv())};
    ASSERT_EQ(rows.qkv.heads, g.heads);
    ASSERT_EQ(rows.qkv.groups, g.heads);
    int64_t next = 0;
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t t = 0; t < g.seq_len; ++t)
        for (int64_t which = 0; which < 3; ++which)
          for (int64_t h = 0; h < g.heads; ++h)
            for (int64_t d = 0; d < g.head_dim; ++d, ++next) {
              const int64_t offset = which == 0   ? rows.query_offset(b, t, h)
                                     : which == 1 ? rows.key_offset(b, t, h)
                                                  : rows.value_offset(b, t, h);
              ASSERT_EQ(offset + d, next) << "b " << b << " t " << t << " which " << which << " h " << h << " d " << d;
            }
    EXPECT_EQ(next, g.qkv().numel());
    // From a token to the next: one [3, H, Dh] block of memory.
    EXPECT_EQ(rows.qkv.token_stride, g.qkv().numel() / (g.batch * g.seq_len));
  }
}

}  // namespace
}  // namespace tessera::testing
