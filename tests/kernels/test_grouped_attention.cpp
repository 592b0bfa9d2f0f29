// Grouped-query attention over grouped projections qkv [B, T, G, R + 2, Dh]
// (ops::grouped_attention_*): forward against the double reference of
// tests/support/reference_attention.h, which repeats each group's key and
// value for its R query heads (Hugging Face's repeat_kv) and builds the full
// score matrix, backward against central differences of that reference and
// against its analytic backward (the repeated keys' and values' gradients
// summed back into their group), for G = 1 (multi-query),
// 1 < G < H and G = H; the GPU's row functors run on the CPU against the same
// reference, for both qkv layouts; the cached attention fed a prefill and then
// token by token equals the whole forward's rows, its cache holds the G
// groups' keys and values, and the GPU's blocked version agrees; GPU against
// CPU; argument checks; the layout's offsets against memory order. Dropout
// on the probabilities: forward and backward against the reference with the
// kernels' mask (the CPU's kernels and the GPU's row functors), p = 0 the
// plain attention bit for bit, and groups split in two calls with head_offset
// (as tensor-parallel ranks hold them) the whole call's results bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

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
  int64_t batch, seq_len, groups, per_group, head_dim;  // B, T, G, R, Dh
  float scale = 0.0f;                                   // ≤ 0: 1/√Dh

  int64_t heads() const { return groups * per_group; }
  Shape qkv() const { return Shape{batch, seq_len, groups, per_group + 2, head_dim}; }
  Shape out() const { return Shape{batch, seq_len, heads(), head_dim}; }
  Shape lse() const { return Shape{batch, heads(), seq_len}; }
  Shape cache(int64_t capacity) const { return Shape{batch, groups, capacity, head_dim}; }
  double effective_scale() const { return scale > 0 ? double(scale) : 1.0 / std::sqrt(double(head_dim)); }
  // Slot 0..R−1: the group's queries; R: its key; R + 1: its value.
  size_t qkv_index(int64_t b, int64_t t, int64_t g, int64_t slot, int64_t d) const {
    return size_t((((b * seq_len + t) * groups + g) * (per_group + 2) + slot) * head_dim + d);
  }
};

std::string describe(const Dims& g) {
  return "B=" + std::to_string(g.batch) + " T=" + std::to_string(g.seq_len) + " G=" + std::to_string(g.groups) +
         " R=" + std::to_string(g.per_group) + " Dh=" + std::to_string(g.head_dim);
}

// The reference sees the grouped layout through its index: query head
// h = g·R + j reads slot j of group g, and group g's key (slot R) and value
// (slot R + 1), which the reference repeats for each of the group's heads.
AttentionProblem problem_of(const Dims& g) {
  return AttentionProblem{g.batch,
                          g.seq_len,
                          g.heads(),
                          g.head_dim,
                          g.effective_scale(),
                          [g](int64_t b, int64_t t, int which, int64_t h, int64_t d) {
                            const int64_t group = h / g.per_group;
                            const int64_t slot = which == 0 ? h % g.per_group : g.per_group + which - 1;
                            return g.qkv_index(b, t, group, slot, d);
                          }};
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

class GroupedAttention : public DtypeTest {};

TEST_P(GroupedAttention, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  // One token; multi-query with odd T; 1 < G < H across 64-row tiles with a
  // partial last one (T = 130); G = H with a custom scale; multi-query at Dh
  // 64 over two tiles; an odd head dimension.
  for (const Dims& g : {Dims{2, 1, 2, 3, 8}, Dims{1, 7, 1, 4, 8}, Dims{2, 130, 2, 2, 64}, Dims{1, 67, 3, 1, 16, 0.37f},
                        Dims{1, 100, 1, 3, 64}, Dims{2, 9, 2, 2, 5}}) {
    SCOPED_TRACE(describe(g));
    auto qkv = random_qkv(ctx, g, dtype, rng);
    Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
    ops::grouped_attention_forward(qkv.tensor, out, lse, g.scale);
    const AttentionReference ref = reference_forward(g, qkv.values);
    EXPECT_TRUE(all_close(out, ref.out, output_tolerance(dtype))) << "out";
    // logsumexp is f32 computed in f32 from the stored inputs whatever their dtype.
    EXPECT_TRUE(all_close(lse, ref.lse, forward_tolerance(DType::f32))) << "logsumexp";
  }
}

TEST_P(GroupedAttention, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();

  // Against central differences of the reference forward, on small cases.
  for (const Dims& g : {Dims{1, 9, 2, 2, 4}, Dims{1, 6, 1, 3, 4}}) {
    SCOPED_TRACE(describe(g));
    auto qkv = random_qkv(ctx, g, dtype, rng);
    auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
    Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
    ops::grouped_attention_forward(qkv.tensor, out, lse);
    Tensor grad_qkv = poisoned(ctx, g.qkv(), dtype);
    ops::grouped_attention_backward(grad_out.tensor, qkv.tensor, out, lse, grad_qkv);
    const auto f = [&](const Inputs& in) { return reference_forward(g, in[0]).out; };
    const auto expected = numeric_gradient(f, Inputs{qkv.values}, 0, grad_out.values);
    EXPECT_TRUE(all_close(grad_qkv, expected, gradient_tolerance(dtype))) << "numeric";
  }

  // Against the analytic double backward across tile boundaries, with every
  // kind of grouping; and twice, bit for bit (deterministic).
  for (const Dims& g : {Dims{2, 70, 2, 2, 24, 0.3f}, Dims{1, 71, 1, 4, 8}, Dims{1, 67, 3, 1, 64}}) {
    SCOPED_TRACE(describe(g));
    auto qkv = random_qkv(ctx, g, dtype, rng);
    auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
    Tensor out = poisoned(ctx, g.out(), dtype), lse = poisoned(ctx, g.lse(), DType::f32);
    ops::grouped_attention_forward(qkv.tensor, out, lse, g.scale);
    Tensor grad_qkv = poisoned(ctx, g.qkv(), dtype);
    ops::grouped_attention_backward(grad_out.tensor, qkv.tensor, out, lse, grad_qkv, g.scale);
    EXPECT_TRUE(all_close(grad_qkv, reference_backward(g, qkv.values, grad_out.values, out.to_doubles()),
                          gradient_tolerance(dtype)))
        << "analytic";
    Tensor again = poisoned(ctx, g.qkv(), dtype);
    ops::grouped_attention_backward(grad_out.tensor, qkv.tensor, out, lse, again, g.scale);
    EXPECT_TRUE(all_close(again, grad_qkv, Tolerance{0, 0})) << "not deterministic";
  }
}

// Dropout on the probabilities, every kind of grouping, across 64-row tiles,
// sequences and heads numbered from an offset: forward against the
// reference with the kernels' mask (logsumexp undropped), backward against
// its analytic backward and, on small cases, central differences.
TEST_P(GroupedAttention, ForwardAndBackwardWithDropout) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Dims& g : {Dims{1, 9, 2, 2, 4}, Dims{2, 6, 1, 3, 4}, Dims{2, 9, 2, 3, 8}, Dims{1, 130, 1, 4, 64},
                        Dims{2, 67, 3, 1, 16, 0.37f}}) {
    SCOPED_TRACE(describe(g));
    expect_dropout_matches_the_reference(ctx, ops::grouped_attention_forward, ops::grouped_attention_backward,
                                         problem_of(g), random_qkv(ctx, g, dtype, rng),
                                         random_tensor(ctx, g.out(), dtype, rng), g.scale,
                                         ops::AttentionDropout{0.4f, rng(), 2, 6}, g.head_dim == 4);
  }
}

// p = 0 draws nothing: the plain attention's results bit for bit.
TEST_P(GroupedAttention, DropoutZeroIsThePlainAttention) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const Dims g{2, 70, 2, 2, 24};
  expect_dropout_zero_is_the_plain_attention(ctx, ops::grouped_attention_forward, ops::grouped_attention_backward,
                                             random_qkv(ctx, g, dtype, rng).tensor,
                                             random_tensor(ctx, g.out(), dtype, rng).tensor, rng());
}

// Tensor parallelism's split: each half of the key/value groups (with their
// query heads) in a call of its own, heads numbered from its first query
// head (head_offset), gives the whole call's outputs and gradients of those
// heads bit for bit: the same masks.
TEST_P(GroupedAttention, GroupsSplitWithHeadOffsetDrawTheWholeCallsMasks) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const Dims g{2, 70, 4, 2, 16};
  const ops::AttentionDropout dropout{0.25f, rng(), 0, 0};
  auto qkv = random_qkv(ctx, g, dtype, rng);
  auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
  const AttentionRun whole = run_attention(ctx, ops::grouped_attention_forward, ops::grouped_attention_backward,
                                           qkv.tensor, grad_out.tensor, 0.0f, dropout);
  const Dims part{g.batch, g.seq_len, g.groups / 2, g.per_group, g.head_dim};
  const int64_t group = (g.per_group + 2) * g.head_dim;  // a group's elements of a token's qkv
  const int64_t qkv_row = g.groups * group, out_row = g.heads() * g.head_dim;
  for (const int64_t first_group : {int64_t(0), part.groups}) {
    SCOPED_TRACE("groups from " + std::to_string(first_group));
    ops::AttentionDropout rank = dropout;
    rank.head_offset = first_group * g.per_group;
    const int64_t qkv_begin = first_group * group, out_begin = rank.head_offset * g.head_dim;
    const AttentionRun split = run_attention(
        ctx, ops::grouped_attention_forward, ops::grouped_attention_backward,
        ctx.from_doubles(part.qkv(), dtype, row_range(qkv.values, qkv_row, qkv_begin, qkv_row / 2)),
        ctx.from_doubles(part.out(), dtype, row_range(grad_out.values, out_row, out_begin, out_row / 2)), 0.0f, rank);
    EXPECT_TRUE(
        all_close(split.out, row_range(whole.out.to_doubles(), out_row, out_begin, out_row / 2), Tolerance{0, 0}))
        << "out";
    EXPECT_TRUE(all_close(split.grad_qkv, row_range(whole.grad_qkv.to_doubles(), qkv_row, qkv_begin, qkv_row / 2),
                          Tolerance{0, 0}))
        << "grad_qkv";
  }
}

// qkv [B, T, G, 3, Dh] with R = 1 moved into the GPT's packed [B, T, 3, H, Dh].
Tensor packed_from_grouped(Context& ctx, const Dims& g, const std::vector<double>& grouped, DType dtype) {
  const Shape packed{g.batch, g.seq_len, 3, g.groups, g.head_dim};
  std::vector<double> values(grouped.size());
  for (int64_t b = 0; b < g.batch; ++b)
    for (int64_t t = 0; t < g.seq_len; ++t)
      for (int64_t which = 0; which < 3; ++which)
        for (int64_t h = 0; h < g.groups; ++h)
          for (int64_t d = 0; d < g.head_dim; ++d)
            values[size_t((((b * g.seq_len + t) * 3 + which) * g.groups + h) * g.head_dim + d)] =
                grouped[g.qkv_index(b, t, h, which, d)];
  return ctx.from_doubles(packed, dtype, values);
}

// What a GPU runs for training (AttentionForwardRow, AttentionGradQueryRow,
// AttentionGradKeyValueRow: a warp per row there) run on the CPU with one
// lane per row, for the grouped layout and, with R = 1, for the GPT's packed
// one (its results moved back to the grouped order to compare).
struct RowFunctorResults {
  Tensor out, lse, grad_qkv;
};
RowFunctorResults run_row_functors(Context& ctx, const Dims& g, const Tensor& qkv, const QkvLayout& layout,
                                   const Tensor& grad_out, const ops::AttentionDropout& dropout) {
  const DType dtype = qkv.dtype();
  RowFunctorResults r{poisoned(ctx, g.out(), dtype), poisoned(ctx, g.lse(), DType::f32),
                      poisoned(ctx, qkv.shape(), dtype)};
  Tensor delta = poisoned(ctx, g.lse(), DType::f32);
  const AttentionRows rows{g.batch, g.seq_len, layout};
  const float scale = attention_scale(g.scale, g.head_dim);
  dispatch_float(dtype, "row functors", [&](auto tag) {
    using T = decltype(tag);
    const AttentionForwardRow<T, 256> forward{qkv.data<T>(), r.out.data<T>(), r.lse.data<float>(),
                                              rows,          scale,           dropout};
    for (int64_t row = 0; row < g.batch * g.heads() * g.seq_len; ++row) forward(SerialGroup{}, row);
    const AttentionDelta<T> delta_op{grad_out.data<T>(), r.out.data<T>(), delta.data<float>(),
                                     g.seq_len,          g.heads(),       g.head_dim};
    for (int64_t row = 0; row < g.batch * g.heads() * g.seq_len; ++row) delta_op(row);
    const AttentionBackwardArgs<T> args{grad_out.data<T>(),
                                        qkv.data<T>(),
                                        r.lse.data<float>(),
                                        delta.data<float>(),
                                        r.grad_qkv.data<T>(),
                                        rows,
                                        scale,
                                        dropout};
    const AttentionGradQueryRow<T, 256> grad_q{args};
    for (int64_t row = 0; row < g.batch * g.heads() * g.seq_len; ++row) grad_q(SerialGroup{}, row);
    const AttentionGradKeyValueRow<T, 256> grad_kv{args};
    for (int64_t row = 0; row < g.batch * g.groups * g.seq_len; ++row) grad_kv(SerialGroup{}, row);
  });
  return r;
}

TEST_P(GroupedAttention, RowFunctorsMatchTheReference) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  // Without dropout, and with it (heads numbered from 3).
  for (const Dims& g : {Dims{2, 11, 2, 2, 8, 0.4f}, Dims{1, 13, 1, 3, 5}, Dims{1, 9, 3, 1, 64}})
    for (const ops::AttentionDropout& dropout : {ops::AttentionDropout{}, ops::AttentionDropout{0.3f, rng(), 1, 3}}) {
      SCOPED_TRACE(describe(g) + " dropout=" + std::to_string(dropout.p));
      const AttentionMask mask = dropout_mask(dropout);
      auto qkv = random_qkv(ctx, g, dtype, rng);
      auto grad_out = random_tensor(ctx, g.out(), dtype, rng);
      const AttentionReference ref = reference_forward(g, qkv.values, mask);
      const RowFunctorResults grouped =
          run_row_functors(ctx, g, qkv.tensor, grouped_qkv_layout(qkv.tensor.shape()), grad_out.tensor, dropout);
      EXPECT_TRUE(all_close(grouped.out, ref.out, output_tolerance(dtype))) << "out";
      EXPECT_TRUE(all_close(grouped.lse, ref.lse, forward_tolerance(DType::f32))) << "logsumexp";
      EXPECT_TRUE(all_close(grouped.grad_qkv,
                            reference_backward(g, qkv.values, grad_out.values, grouped.out.to_doubles(), mask),
                            gradient_tolerance(dtype)))
          << "grad_qkv";
      if (g.per_group != 1) continue;
      const Tensor packed = packed_from_grouped(ctx, g, qkv.values, dtype);
      const RowFunctorResults from_packed =
          run_row_functors(ctx, g, packed, packed_qkv_layout(packed.shape()), grad_out.tensor, dropout);
      EXPECT_TRUE(all_close(from_packed.out, ref.out, output_tolerance(dtype))) << "packed out";
      // The packed gradient in the grouped order: the same permutation as the inputs'.
      std::vector<double> grad_grouped(qkv.values.size());
      const auto grad_packed = from_packed.grad_qkv.to_doubles();
      for (int64_t b = 0; b < g.batch; ++b)
        for (int64_t t = 0; t < g.seq_len; ++t)
          for (int64_t which = 0; which < 3; ++which)
            for (int64_t h = 0; h < g.groups; ++h)
              for (int64_t d = 0; d < g.head_dim; ++d)
                grad_grouped[g.qkv_index(b, t, h, which, d)] =
                    grad_packed[size_t((((b * g.seq_len + t) * 3 + which) * g.groups + h) * g.head_dim + d)];
      EXPECT_TRUE(all_close(grad_grouped,
                            reference_backward(g, qkv.values, grad_out.values, from_packed.out.to_doubles(), mask),
                            gradient_tolerance(dtype)))
          << "packed grad_qkv";
    }
}

TEST_P(GroupedAttention, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  // Without dropout, and with it (the GPU must draw the CPU's mask).
  for (const Dims& g : {Dims{2, 130, 2, 3, 64}, Dims{1, 37, 1, 4, 8, 0.4f}, Dims{1, 70, 2, 1, 256},
                        Dims{2, 1, 2, 2, 100}, Dims{1, 45, 4, 2, 128}})
    for (const ops::AttentionDropout& dropout : {ops::AttentionDropout{}, ops::AttentionDropout{0.3f, rng(), 2, 4}}) {
      SCOPED_TRACE(describe(g) + " dropout=" + std::to_string(dropout.p));
      expect_gpu_matches_cpu(ctx, ops::grouped_attention_forward, ops::grouped_attention_backward,
                             random_qkv(ctx, g, dtype, rng).tensor, random_tensor(ctx, g.out(), dtype, rng).tensor,
                             g.scale, dropout, gpu);
    }
}

// The sequence `qkv` of `g` fed to ops::grouped_attention_with_cache in
// chunks (a prompt of `prompt` tokens, then chunk_lengths' 1, 1, 3, ...) over
// a poisoned cache [B, G, T + 5, Dh]; after each chunk,
// check(chunk, keys, values, position, out, expected rows of the reference).
// Returns the cache (keys, values).
template <typename Check>
std::pair<Tensor, Tensor> run_in_chunks(Context& ctx, const Dims& g, const RandomTensor& qkv, int64_t prompt,
                                        Check&& check) {
  const DType dtype = qkv.tensor.dtype();
  const AttentionReference ref = reference_forward(g, qkv.values);
  Tensor keys = poisoned(ctx, g.cache(g.seq_len + 5), dtype);  // room the sequence does not use
  Tensor values = poisoned(ctx, keys.shape(), dtype);
  int64_t position = 0;
  for (const int64_t n : chunk_lengths(g.seq_len, prompt)) {
    SCOPED_TRACE("tokens [" + std::to_string(position) + ", " + std::to_string(position + n) + ")");
    const Tensor chunk = token_rows(ctx, g.qkv(), qkv.values, position, position + n, dtype);
    Tensor out = poisoned(ctx, Shape{g.batch, n, g.heads(), g.head_dim}, dtype);
    ops::grouped_attention_with_cache(chunk, keys, values, position, out, g.scale);
    check(chunk, keys, values, position, out, token_slice(ref.out, g.batch, g.seq_len, position, position + n));
    position += n;
  }
  return {keys, values};
}

// A prefill of a third of the sequence then tokens one to three at a time, and
// decoding from the first token on: every chunk's rows equal the whole
// sequence's forward (the operator's and the reference's), and the cache holds
// exactly the G groups' keys and values.
TEST_P(GroupedAttention, WithCacheEqualsTheWholeForward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Dims& g : {Dims{1, 9, 1, 4, 8}, Dims{2, 40, 2, 3, 16}, Dims{1, 70, 2, 2, 64, 0.3f}, Dims{2, 12, 3, 1, 8},
                        Dims{1, 11, 2, 2, 256}}) {
    for (const int64_t prompt : {g.seq_len / 3 + 1, int64_t(1)}) {
      SCOPED_TRACE(describe(g) + " prompt=" + std::to_string(prompt));
      const RandomTensor qkv = random_qkv(ctx, g, dtype, rng);
      Tensor whole_out = poisoned(ctx, g.out(), dtype), whole_lse = poisoned(ctx, g.lse(), DType::f32);
      ops::grouped_attention_forward(qkv.tensor, whole_out, whole_lse, g.scale);
      const std::vector<double> whole = whole_out.to_doubles();
      const auto expect_forward_rows = [&](const Tensor&, const Tensor&, const Tensor&, int64_t position,
                                           const Tensor& out, const std::vector<double>& expected) {
        EXPECT_TRUE(all_close(out, expected, output_tolerance(dtype))) << "reference";
        EXPECT_TRUE(all_close(out, token_slice(whole, g.batch, g.seq_len, position, position + out.size(1)),
                              output_tolerance(dtype)))
            << "grouped_attention_forward";
      };
      const auto [cache_keys, cache_values] = run_in_chunks(ctx, g, qkv, prompt, expect_forward_rows);
      const auto keys = cache_keys.to_doubles(), values = cache_values.to_doubles();
      const int64_t capacity = cache_keys.size(2);
      for (int64_t b = 0; b < g.batch; ++b)
        for (int64_t group = 0; group < g.groups; ++group)
          for (int64_t t = 0; t < g.seq_len; ++t)
            for (int64_t d = 0; d < g.head_dim; ++d) {
              const size_t at = size_t(((b * g.groups + group) * capacity + t) * g.head_dim + d);
              ASSERT_EQ(keys[at], qkv.values[g.qkv_index(b, t, group, g.per_group, d)]);
              ASSERT_EQ(values[at], qkv.values[g.qkv_index(b, t, group, g.per_group + 1, d)]);
            }
    }
  }
}

// Each chunk again the GPU's way (the cache after the op appended the chunk):
// the GPU's plan for its rows, then one position a block, odd blocks, a single block.
TEST_P(GroupedAttention, WithCacheInBlocksMergedByLogSumExpMatchesTheReference) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Dims& g :
       {Dims{1, 9, 1, 4, 8}, Dims{2, 40, 2, 3, 16}, Dims{1, 100, 2, 2, 64, 0.3f}, Dims{1, 50, 3, 1, 5}}) {
    SCOPED_TRACE(describe(g));
    const auto expect_blocked = [&](const Tensor& chunk, const Tensor& keys, const Tensor& values, int64_t position,
                                    const Tensor&, const std::vector<double>& expected) {
      const int64_t longest = position + chunk.size(1), rows = g.batch * chunk.size(1) * g.heads();
      for (const CacheBlocks& blocks :
           {cache_blocks(rows, longest), blocks_of(longest, 1), blocks_of(longest, 7), blocks_of(longest, longest)}) {
        const Tensor out = blocked_cached_attention(ctx, chunk, grouped_qkv_layout(chunk.shape()), keys, values,
                                                    position, g.scale, blocks);
        EXPECT_TRUE(all_close(out, expected, output_tolerance(dtype)))
            << blocks.per_row << " blocks of " << blocks.positions << " positions";
      }
    };
    run_in_chunks(ctx, g, random_qkv(ctx, g, dtype, rng), g.seq_len / 3 + 1, expect_blocked);
  }
}

TEST_P(GroupedAttention, GpuWithCacheMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  // A short cache, a long one decoded a token at a time (many blocks, a
  // partial last one), multi-query, odd and widest head dimensions.
  for (const Dims& g :
       {Dims{2, 33, 2, 3, 64}, Dims{1, 300, 1, 4, 80, 0.3f}, Dims{1, 70, 2, 1, 256}, Dims{2, 45, 2, 2, 5}}) {
    SCOPED_TRACE(describe(g));
    auto qkv = random_qkv(ctx, g, dtype, rng);
    Tensor keys_cpu = poisoned(ctx, g.cache(g.seq_len), dtype), values_cpu = poisoned(ctx, g.cache(g.seq_len), dtype);
    Tensor keys_gpu = poisoned(ctx, g.cache(g.seq_len), dtype, gpu);
    Tensor values_gpu = poisoned(ctx, g.cache(g.seq_len), dtype, gpu);
    int64_t position = 0;
    for (const int64_t n : chunk_lengths(g.seq_len, 10)) {
      const Shape out_shape{g.batch, n, g.heads(), g.head_dim};
      Tensor out_cpu = poisoned(ctx, out_shape, dtype), out_gpu = poisoned(ctx, out_shape, dtype, gpu);
      ops::grouped_attention_with_cache(token_rows(ctx, g.qkv(), qkv.values, position, position + n, dtype), keys_cpu,
                                        values_cpu, position, out_cpu, g.scale);
      ops::grouped_attention_with_cache(token_rows(ctx, g.qkv(), qkv.values, position, position + n, dtype, gpu),
                                        keys_gpu, values_gpu, position, out_gpu, g.scale);
      EXPECT_TRUE(all_close(out_gpu, out_cpu, attention_device_tolerance(dtype))) << "tokens from " << position;
      position += n;
    }
    EXPECT_TRUE(all_close(keys_gpu, keys_cpu, Tolerance{0, 0})) << "keys";
  }
}

TEST_P(GroupedAttention, RejectsBadArguments) {
  const DType dtype = GetParam();
  Context ctx;
  const Dims g{2, 5, 2, 3, 4};
  Tensor qkv = ctx.zeros(g.qkv(), dtype), out = ctx.zeros(g.out(), dtype), lse = ctx.zeros(g.lse(), DType::f32);
  Tensor grad_qkv = ctx.zeros(g.qkv(), dtype);
  EXPECT_NO_THROW(ops::grouped_attention_forward(qkv, out, lse));
  EXPECT_NO_THROW(ops::grouped_attention_backward(out, qkv, out, lse, grad_qkv));
  const Dims empty{2, 0, 2, 3, 4};  // no tokens: nothing to do, but valid
  Tensor qkv0 = ctx.zeros(empty.qkv(), dtype), out0 = ctx.zeros(empty.out(), dtype);
  Tensor lse0 = ctx.zeros(empty.lse(), DType::f32), grad0 = ctx.zeros(empty.qkv(), dtype);
  EXPECT_NO_THROW(ops::grouped_attention_forward(qkv0, out0, lse0));
  EXPECT_NO_THROW(ops::grouped_attention_backward(out0, qkv0, out0, lse0, grad0));

  Tensor no_queries = ctx.zeros(Shape{2, 5, 2, 2, 4}, dtype);  // only a key and a value per group
  EXPECT_THROW(ops::grouped_attention_forward(no_queries, out, lse), Error);
  Tensor four_dims = ctx.zeros(Shape{2, 5, 10, 4}, dtype);
  EXPECT_THROW(ops::grouped_attention_forward(four_dims, out, lse), Error);
  Tensor per_group_out = ctx.zeros(Shape{2, 5, 2, 4}, dtype);  // G heads instead of H = G·R
  EXPECT_THROW(ops::grouped_attention_forward(qkv, per_group_out, lse), Error);
  Tensor lse_groups = ctx.zeros(Shape{2, 2, 5}, DType::f32);
  EXPECT_THROW(ops::grouped_attention_forward(qkv, out, lse_groups), Error);
  Tensor other_dtype = ctx.zeros(g.out(), dtype == DType::f32 ? DType::bf16 : DType::f32);
  EXPECT_THROW(ops::grouped_attention_forward(qkv, other_dtype, lse), Error);
  Tensor ints = ctx.zeros(g.qkv(), DType::i32);
  EXPECT_THROW(ops::grouped_attention_forward(ints, out, lse), Error);

  Tensor wrong_grad = ctx.zeros(Shape{2, 5, 2, 4, 4}, dtype);
  EXPECT_THROW(ops::grouped_attention_backward(out, qkv, out, lse, wrong_grad), Error);
  EXPECT_THROW(ops::grouped_attention_backward(per_group_out, qkv, out, lse, grad_qkv), Error);
  EXPECT_THROW(ops::grouped_attention_backward(out, qkv, out, lse, qkv), Error);  // grad_qkv overwrites qkv

  // The cache holds G heads, not H.
  const Dims c{1, 4, 2, 3, 8};
  Tensor cqkv = ctx.zeros(c.qkv(), dtype), cout = ctx.zeros(c.out(), dtype);
  Tensor keys = ctx.zeros(c.cache(6), dtype), values = ctx.zeros(c.cache(6), dtype);
  EXPECT_NO_THROW(ops::grouped_attention_with_cache(cqkv, keys, values, 2, cout));
  EXPECT_THROW(ops::grouped_attention_with_cache(cqkv, keys, values, 3, cout), Error);  // 3 + 4 > 6 positions
  EXPECT_THROW(ops::grouped_attention_with_cache(cqkv, keys, values, -1, cout), Error);
  Tensor head_keys = ctx.zeros(Shape{1, 6, 6, 8}, dtype), head_values = ctx.zeros(Shape{1, 6, 6, 8}, dtype);
  EXPECT_THROW(ops::grouped_attention_with_cache(cqkv, head_keys, head_values, 0, cout), Error);
  EXPECT_THROW(ops::grouped_attention_with_cache(cqkv, keys, keys, 0, cout), Error);  // one memory for both
  Tensor group_out = ctx.zeros(Shape{1, 4, 2, 8}, dtype);
  EXPECT_THROW(ops::grouped_attention_with_cache(cqkv, keys, values, 0, group_out), Error);
  const Dims wide{1, 1, 1, 2, 264};
  Tensor wide_qkv = ctx.zeros(wide.qkv(), dtype), wide_out = ctx.zeros(wide.out(), dtype);
  Tensor wide_keys = ctx.zeros(wide.cache(2), dtype), wide_values = ctx.zeros(wide.cache(2), dtype);
  EXPECT_THROW(ops::grouped_attention_with_cache(wide_qkv, wide_keys, wide_values, 0, wide_out), Error);
}

INSTANTIATE_FLOAT_DTYPES(GroupedAttention);

// Walking qkv [B, T, G, R + 2, Dh] in memory order, the n-th element must be
// query j of group g (head g·R + j), then the group's key, then its value.
TEST(GroupedQkv, OffsetsFollowTheElementsInMemoryOrder) {
  for (const Dims& g : {Dims{2, 3, 2, 3, 5}, Dims{1, 2, 1, 4, 2}, Dims{2, 2, 3, 1, 3}}) {
    SCOPED_TRACE(describe(g));
    const AttentionRows rows{g.batch, g.seq_len, grouped_qkv_layout(g.qkv())};
    ASSERT_EQ(rows.qkv.heads, g.heads());
    ASSERT_EQ(rows.qkv.groups, g.groups);
    int64_t next = 0;
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t t = 0; t < g.seq_len; ++t)
        for (int64_t group = 0; group < g.groups; ++group)
          for (int64_t slot = 0; slot < g.per_group + 2; ++slot)
            for (int64_t d = 0; d < g.head_dim; ++d, ++next) {
              const int64_t h = group * g.per_group + slot;
              const int64_t offset = slot < g.per_group    ? rows.query_offset(b, t, h)
                                     : slot == g.per_group ? rows.key_offset(b, t, group)
                                                           : rows.value_offset(b, t, group);
              ASSERT_EQ(offset + d, next) << "b " << b << " t " << t << " group " << group << " slot " << slot;
            }
    EXPECT_EQ(next, g.qkv().numel());
    EXPECT_EQ(rows.qkv.token_stride, g.qkv().numel() / (g.batch * g.seq_len));
    for (int64_t h = 0; h < g.heads(); ++h) EXPECT_EQ(rows.qkv.group_of(h), h / g.per_group);
  }
}

}  // namespace
}  // namespace tessera::testing
