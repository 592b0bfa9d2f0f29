// Blockwise causal attention with global positions (ops::attention_block_*,
// context parallelism's ring): forward and backward of one block against the
// double reference of tests/support/reference_block_attention.h for random
// position sets (queries that see no key included) and zigzag chunk pairs;
// the reference's backward against central differences of its forward; the
// log-sum-exp merge of blocks equal to the softmax over their union; a
// "serial ring" that plays C = 2, 3, 4 ranks in one process (zigzag chunks,
// blocks merged, gradient accumulators summed over the ranks) equal to
// whole-sequence causal attention in forward and backward; argument checks.
// Outputs and accumulators are f32 whatever the inputs' dtype, computed from
// the stored (rounded) inputs the reference also reads, so every dtype gets
// the f32 tolerances of the attention tests (attention_support.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/functors/block_attention.h"
#include "kernels/ops.h"
#include "tests/kernels/attention_support.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/reference_block_attention.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Heads {
  int64_t batch, heads, groups, head_dim;  // B, H, G, Dh
};

BlockProblem problem_of(const Heads& h, std::vector<int64_t> q_pos, std::vector<int64_t> k_pos) {
  return BlockProblem{h.batch,          h.heads,         h.groups, h.head_dim, 1.0 / std::sqrt(double(h.head_dim)),
                      std::move(q_pos), std::move(k_pos)};
}
Shape q_shape(const BlockProblem& p) {
  return Shape{p.batch, p.queries(), p.heads, p.head_dim};
}
Shape kv_shape(const BlockProblem& p) {
  return Shape{p.batch, p.keys(), p.groups, 2, p.head_dim};
}
Shape lse_shape(const BlockProblem& p) {
  return Shape{p.batch, p.heads, p.queries()};
}
Tensor positions_tensor(Context& ctx, const std::vector<int64_t>& positions) {
  return ctx.from_vector(Shape{int64_t(positions.size())}, positions);
}

// The f32 tolerances: the outputs are f32 from the stored inputs (see the top).
Tolerance f32_output() {
  return output_tolerance(DType::f32);
}
Tolerance f32_gradient() {
  return gradient_tolerance(DType::f32);
}

// `count` distinct positions drawn from [0, range), in random order.
std::vector<int64_t> random_positions(std::mt19937_64& rng, int64_t count, int64_t range) {
  std::vector<int64_t> all = consecutive_positions(0, range);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(count));
  return all;
}

// Rank r of c's positions under the zigzag split, written here from the
// definition (chunks r and 2c − 1 − r of 2c), independently of parallel/.
std::vector<int64_t> zigzag(int64_t seq_len, int64_t rank, int64_t ranks) {
  const int64_t chunk = seq_len / (2 * ranks);
  std::vector<int64_t> held;
  for (const int64_t c : {rank, 2 * ranks - 1 - rank})
    for (int64_t i = 0; i < chunk; ++i) held.push_back(c * chunk + i);
  return held;
}

// One block's forward into poisoned outputs.
struct BlockForward {
  Tensor out, lse;
};
BlockForward block_forward(Context& ctx, const BlockProblem& p, const Tensor& q, const Tensor& kv) {
  BlockForward f{poisoned(ctx, q_shape(p), DType::f32), poisoned(ctx, lse_shape(p), DType::f32)};
  ops::attention_block_forward(q, kv, positions_tensor(ctx, p.q_pos), positions_tensor(ctx, p.k_pos), f.out, f.lse);
  return f;
}

void expect_forward_matches(const BlockForward& f, const BlockReference& ref) {
  EXPECT_TRUE(all_close(f.out, ref.out, f32_output())) << "out";
  EXPECT_TRUE(all_close(mark_empty_rows(f.lse.to_doubles()), mark_empty_rows(ref.lse), f32_output())) << "logsumexp";
}

// Position sets a block may hold: random ones (the first query placed before
// every key, so it sees nothing), and a zigzag pair meeting another rank's.
struct PositionSets {
  std::vector<int64_t> q_pos, k_pos;
};
std::vector<PositionSets> position_sets(std::mt19937_64& rng) {
  std::vector<PositionSets> sets;
  std::vector<int64_t> keys = random_positions(rng, 9, 30);
  for (int64_t& k : keys) k += 3;  // every key at 3 or later
  std::vector<int64_t> queries = random_positions(rng, 7, 40);
  queries[0] = 1;  // sees no key
  sets.push_back({queries, keys});
  for (const auto& [q_rank, k_rank] : {std::pair{0, 2}, std::pair{2, 0}, std::pair{1, 1}})
    sets.push_back({zigzag(30, q_rank, 3), zigzag(30, k_rank, 3)});
  return sets;
}

class BlockAttention : public DtypeTest {};

TEST_P(BlockAttention, ForwardMatchesTheReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const Heads& heads : {Heads{2, 4, 2, 24}, Heads{1, 3, 3, 17}, Heads{2, 4, 1, 8}})
    for (const PositionSets& set : position_sets(rng)) {
      const BlockProblem p = problem_of(heads, set.q_pos, set.k_pos);
      const RandomTensor q = random_tensor(ctx, q_shape(p), GetParam(), rng, -2.0, 2.0);
      const RandomTensor kv = random_tensor(ctx, kv_shape(p), GetParam(), rng, -2.0, 2.0);
      SCOPED_TRACE("H=" + std::to_string(heads.heads) + " G=" + std::to_string(heads.groups));
      expect_forward_matches(block_forward(ctx, p, q.tensor, kv.tensor),
                             reference_block_attention(p, q.values, kv.values));
    }
}

// A query that sees no key of the block: out exactly 0, logsumexp −∞.
TEST_P(BlockAttention, ARowThatSeesNothingIsZeroWithMinusInfinity) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const BlockProblem p = problem_of(Heads{1, 2, 1, 8}, {0, 1}, {5, 6, 7});
  const RandomTensor q = random_tensor(ctx, q_shape(p), GetParam(), rng);
  const RandomTensor kv = random_tensor(ctx, kv_shape(p), GetParam(), rng);
  const BlockForward f = block_forward(ctx, p, q.tensor, kv.tensor);
  for (const double v : f.out.to_doubles()) EXPECT_EQ(v, 0.0);
  for (const double v : f.lse.to_doubles()) EXPECT_TRUE(std::isinf(v) && v < 0) << v;
}

// The block's gradient terms, given the final out and logsumexp of a larger
// key set (the union with another block), added to random accumulators.
TEST_P(BlockAttention, BackwardAddsTheBlockTermsOfTheFinalSoftmax) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const DType dtype = GetParam();
  for (const Heads& heads : {Heads{2, 4, 2, 24}, Heads{1, 3, 3, 17}})
    for (const PositionSets& set : position_sets(rng)) {
      // The whole key set: this block's keys (tokens 0 .. n − 1 of kv_all) and as many others.
      std::vector<int64_t> all_keys = set.k_pos, others = random_positions(rng, int64_t(set.k_pos.size()), 60);
      all_keys.insert(all_keys.end(), others.begin(), others.end());
      const BlockProblem whole = problem_of(heads, set.q_pos, all_keys),
                         block = problem_of(heads, set.q_pos, set.k_pos);
      const RandomTensor q = random_tensor(ctx, q_shape(whole), dtype, rng, -2.0, 2.0);
      const RandomTensor kv_all = random_tensor(ctx, kv_shape(whole), dtype, rng, -2.0, 2.0);
      const RandomTensor grad_out = random_tensor(ctx, q_shape(whole), dtype, rng);
      const std::vector<double> block_kv =
          tokens_at(kv_all.values, whole.batch, whole.keys(), consecutive_positions(0, int64_t(set.k_pos.size())));
      const BlockReference final_ref = reference_block_attention(whole, q.values, kv_all.values);
      const Tensor out = ctx.from_doubles(q_shape(whole), dtype, final_ref.out);  // stored as the model keeps it
      const Tensor lse = ctx.from_doubles(lse_shape(whole), DType::f32, final_ref.lse);
      const RandomTensor grad_q = random_tensor(ctx, q_shape(block), DType::f32, rng);
      const RandomTensor grad_kv = random_tensor(ctx, kv_shape(block), DType::f32, rng);
      Tensor dq = grad_q.tensor.clone(), dkv = grad_kv.tensor.clone();
      ops::attention_block_backward(grad_out.tensor, q.tensor, ctx.from_doubles(kv_shape(block), dtype, block_kv), out,
                                    lse, positions_tensor(ctx, block.q_pos), positions_tensor(ctx, block.k_pos), dq,
                                    dkv);
      const BlockGradients terms =
          reference_block_backward(block, q.values, block_kv, grad_out.values, out.to_doubles(), lse.to_doubles());
      std::vector<double> expected_q = grad_q.values, expected_kv = grad_kv.values;
      for (size_t i = 0; i < expected_q.size(); ++i) expected_q[i] += terms.q[i];
      for (size_t i = 0; i < expected_kv.size(); ++i) expected_kv[i] += terms.kv[i];
      EXPECT_TRUE(all_close(dq, expected_q, f32_gradient())) << "grad_q";
      EXPECT_TRUE(all_close(dkv, expected_kv, f32_gradient())) << "grad_kv";
    }
}

// Position sets of more than one 64-token tile of the CPU kernel (queries
// and keys meet tile by tile; a pair no query sees is skipped, one with some
// hidden keys tested position by position): zigzag chunks of 75 tokens whose
// boundaries fall inside tiles (rank 0's queries against rank 1's keys: the
// first chunk's tiles see nothing, a middle tile straddles both chunks; and
// against its own keys: hidden keys inside tiles off the diagonal), counts
// that are not multiples of 64, shuffled positions (every tile partial), and
// queries whose first tile precedes every key of a far key tile.
std::vector<PositionSets> tiled_position_sets(std::mt19937_64& rng) {
  std::vector<PositionSets> sets;
  sets.push_back({zigzag(300, 0, 2), zigzag(300, 1, 2)});
  sets.push_back({zigzag(300, 0, 2), zigzag(300, 0, 2)});
  sets.push_back({random_positions(rng, 130, 300), random_positions(rng, 100, 300)});
  std::vector<int64_t> keys = consecutive_positions(0, 10);
  const std::vector<int64_t> late = consecutive_positions(100, 120);
  keys.insert(keys.end(), late.begin(), late.end());
  sets.push_back({consecutive_positions(0, 150), keys});
  return sets;
}

// The forward and backward over those sets equal the reference, the
// backward given the block's own out and logsumexp and added to random
// accumulators.
TEST_P(BlockAttention, TilesSplitAtAnyPositionMatchTheReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const DType dtype = GetParam();
  for (const PositionSets& set : tiled_position_sets(rng)) {
    const BlockProblem p = problem_of(Heads{1, 4, 2, 24}, set.q_pos, set.k_pos);
    SCOPED_TRACE("Tq=" + std::to_string(p.queries()) + " Tk=" + std::to_string(p.keys()));
    const RandomTensor q = random_tensor(ctx, q_shape(p), dtype, rng, -2.0, 2.0);
    const RandomTensor kv = random_tensor(ctx, kv_shape(p), dtype, rng, -2.0, 2.0);
    const RandomTensor grad_out = random_tensor(ctx, q_shape(p), dtype, rng);
    const BlockReference ref = reference_block_attention(p, q.values, kv.values);
    expect_forward_matches(block_forward(ctx, p, q.tensor, kv.tensor), ref);

    const Tensor out = ctx.from_doubles(q_shape(p), dtype, ref.out);
    const Tensor lse = ctx.from_doubles(lse_shape(p), DType::f32, ref.lse);
    const RandomTensor grad_q = random_tensor(ctx, q_shape(p), DType::f32, rng);
    const RandomTensor grad_kv = random_tensor(ctx, kv_shape(p), DType::f32, rng);
    Tensor dq = grad_q.tensor.clone(), dkv = grad_kv.tensor.clone();
    ops::attention_block_backward(grad_out.tensor, q.tensor, kv.tensor, out, lse, positions_tensor(ctx, p.q_pos),
                                  positions_tensor(ctx, p.k_pos), dq, dkv);
    const BlockGradients terms =
        reference_block_backward(p, q.values, kv.values, grad_out.values, out.to_doubles(), lse.to_doubles());
    std::vector<double> expected_q = grad_q.values, expected_kv = grad_kv.values;
    for (size_t i = 0; i < expected_q.size(); ++i) expected_q[i] += terms.q[i];
    for (size_t i = 0; i < expected_kv.size(); ++i) expected_kv[i] += terms.kv[i];
    EXPECT_TRUE(all_close(dq, expected_q, f32_gradient())) << "grad_q";
    EXPECT_TRUE(all_close(dkv, expected_kv, f32_gradient())) << "grad_kv";
  }
}

// What a GPU runs (BlockAttentionForwardRow, BlockAttentionGradQueryRow,
// BlockAttentionGradKeyValueRow: a warp per row there; the CPU runs the
// tiles of kernels/cpu/attention_tiles.h instead) run here with one lane per
// row, forward and backward, against the reference.
TEST_P(BlockAttention, RowFunctorsMatchTheReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const DType dtype = GetParam();
  std::vector<PositionSets> sets = position_sets(rng);
  sets.push_back(tiled_position_sets(rng)[2]);
  for (const PositionSets& set : sets) {
    const BlockProblem p = problem_of(Heads{2, 4, 2, 24}, set.q_pos, set.k_pos);
    const RandomTensor q = random_tensor(ctx, q_shape(p), dtype, rng, -2.0, 2.0);
    const RandomTensor kv = random_tensor(ctx, kv_shape(p), dtype, rng, -2.0, 2.0);
    const RandomTensor grad_out = random_tensor(ctx, q_shape(p), dtype, rng);
    const Tensor q_pos = positions_tensor(ctx, p.q_pos), k_pos = positions_tensor(ctx, p.k_pos);
    const BlockReference ref = reference_block_attention(p, q.values, kv.values);
    const Tensor out = ctx.from_doubles(q_shape(p), dtype, ref.out);
    const Tensor lse = ctx.from_doubles(lse_shape(p), DType::f32, ref.lse);
    BlockForward f{poisoned(ctx, q_shape(p), DType::f32), poisoned(ctx, lse_shape(p), DType::f32)};
    Tensor delta = poisoned(ctx, lse_shape(p), DType::f32);
    Tensor dq = ctx.zeros(q_shape(p), DType::f32), dkv = ctx.zeros(kv_shape(p), DType::f32);
    const BlockRows rows = block_rows_of(q.tensor.shape(), kv.tensor.shape());
    dispatch_float(dtype, "row functors", [&](auto tag) {
      using T = decltype(tag);
      const auto forward = block_forward_row<T, 256>(q.tensor, kv.tensor, q_pos, k_pos, f.out, f.lse, 0.0f);
      for (int64_t row = 0; row < rows.query_rows(); ++row) forward(SerialGroup{}, row);
      const AttentionDelta<T> delta_op{
          grad_out.tensor.data<T>(), out.data<T>(), delta.data<float>(), rows.queries, rows.heads, rows.head_dim};
      for (int64_t row = 0; row < rows.query_rows(); ++row) delta_op(row);
      const auto args =
          block_backward_args<T>(grad_out.tensor, q.tensor, kv.tensor, lse, delta, q_pos, k_pos, dq, dkv, 0.0f);
      for (int64_t row = 0; row < rows.query_rows(); ++row)
        BlockAttentionGradQueryRow<T, 256>{args}(SerialGroup{}, row);
      for (int64_t row = 0; row < rows.key_rows(); ++row)
        BlockAttentionGradKeyValueRow<T, 256>{args}(SerialGroup{}, row);
    });
    expect_forward_matches(f, ref);
    const BlockGradients grads =
        reference_block_backward(p, q.values, kv.values, grad_out.values, out.to_doubles(), lse.to_doubles());
    EXPECT_TRUE(all_close(dq, grads.q, f32_gradient())) << "grad_q";
    EXPECT_TRUE(all_close(dkv, grads.kv, f32_gradient())) << "grad_kv";
  }
}

// The GPU's row functors against the CPU's tiles, on the sets above and the
// tiled ones: a block's forward, the merge of a second block into it, and
// the backward from the merged result added to the same random accumulators.
TEST_P(BlockAttention, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  std::vector<PositionSets> sets = position_sets(rng);
  for (const PositionSets& set : tiled_position_sets(rng)) sets.push_back(set);
  for (const Heads& heads : {Heads{2, 4, 2, 64}, Heads{1, 3, 3, 17}, Heads{1, 8, 1, 128}})
    for (const PositionSets& set : sets) {
      SCOPED_TRACE("H " + std::to_string(heads.heads) + " G " + std::to_string(heads.groups) + " Dh " +
                   std::to_string(heads.head_dim) + ", " + std::to_string(set.q_pos.size()) + " queries, " +
                   std::to_string(set.k_pos.size()) + " keys");
      const BlockProblem p = problem_of(heads, set.q_pos, set.k_pos);
      const Tolerance tolerance = attention_device_tolerance(DType::f32);
      const Tensor q = random_tensor(ctx, q_shape(p), dtype, rng, -2.0, 2.0).tensor;
      const Tensor kv = random_tensor(ctx, kv_shape(p), dtype, rng, -2.0, 2.0).tensor;
      const Tensor other_kv = random_tensor(ctx, kv_shape(p), dtype, rng, -2.0, 2.0).tensor;
      std::vector<int64_t> other_positions = set.k_pos;
      for (int64_t& position : other_positions) position = std::max<int64_t>(0, position - 1);
      const Tensor q_pos = positions_tensor(ctx, p.q_pos), k_pos = positions_tensor(ctx, p.k_pos);
      const Tensor other_pos = positions_tensor(ctx, other_positions);
      // Forward of the own block, then the other block merged in.
      Tensor out_cpu = poisoned(ctx, q_shape(p), DType::f32), lse_cpu = poisoned(ctx, lse_shape(p), DType::f32);
      Tensor out_gpu = poisoned(ctx, q_shape(p), DType::f32, gpu);
      Tensor lse_gpu = poisoned(ctx, lse_shape(p), DType::f32, gpu);
      ops::attention_block_forward(q, kv, q_pos, k_pos, out_cpu, lse_cpu);
      ops::attention_block_forward(q.to(gpu), kv.to(gpu), q_pos.to(gpu), k_pos.to(gpu), out_gpu, lse_gpu);
      EXPECT_TRUE(all_close(out_gpu, out_cpu, tolerance)) << "block out";
      EXPECT_TRUE(all_close(mark_empty_rows(lse_gpu.to_doubles()), mark_empty_rows(lse_cpu.to_doubles()), tolerance))
          << "block logsumexp";
      Tensor block_out = poisoned(ctx, q_shape(p), DType::f32), block_lse = poisoned(ctx, lse_shape(p), DType::f32);
      ops::attention_block_forward(q, other_kv, q_pos, other_pos, block_out, block_lse);
      Tensor merged_gpu = out_cpu.to(gpu), merged_lse_gpu = lse_cpu.to(gpu);
      ops::attention_block_merge(block_out.to(gpu), block_lse.to(gpu), merged_gpu, merged_lse_gpu);
      ops::attention_block_merge(block_out, block_lse, out_cpu, lse_cpu);
      EXPECT_TRUE(all_close(merged_gpu, out_cpu, tolerance)) << "merged out";
      EXPECT_TRUE(all_close(mark_empty_rows(merged_lse_gpu.to_doubles()), mark_empty_rows(lse_cpu.to_doubles()),
                            tolerance))
          << "merged logsumexp";
      // Backward of the own block from the merged result, into the same accumulators.
      Tensor out = ctx.empty(q_shape(p), dtype);
      ops::cast(out_cpu, out);
      const Tensor grad_out = random_tensor(ctx, q_shape(p), dtype, rng).tensor;
      const Tensor grad_q = random_tensor(ctx, q_shape(p), DType::f32, rng).tensor;
      const Tensor grad_kv = random_tensor(ctx, kv_shape(p), DType::f32, rng).tensor;
      Tensor dq_cpu = grad_q.clone(), dkv_cpu = grad_kv.clone(), dq_gpu = grad_q.to(gpu), dkv_gpu = grad_kv.to(gpu);
      ops::attention_block_backward(grad_out, q, kv, out, lse_cpu, q_pos, k_pos, dq_cpu, dkv_cpu);
      ops::attention_block_backward(grad_out.to(gpu), q.to(gpu), kv.to(gpu), out.to(gpu), lse_cpu.to(gpu),
                                    q_pos.to(gpu), k_pos.to(gpu), dq_gpu, dkv_gpu);
      EXPECT_TRUE(all_close(dq_gpu, dq_cpu, attention_device_tolerance(dtype))) << "grad_q";
      EXPECT_TRUE(all_close(dkv_gpu, dkv_cpu, attention_device_tolerance(dtype))) << "grad_kv";
    }
}

INSTANTIATE_FLOAT_DTYPES(BlockAttention);

// The reference's backward (what the kernels are held to) is the gradient of
// its forward: over a whole key set, against central differences, with q and
// kv both perturbed.
TEST(BlockAttentionReference, BackwardIsTheGradientOfTheForward) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const BlockProblem p = problem_of(Heads{1, 4, 2, 5}, random_positions(rng, 5, 9), random_positions(rng, 6, 9));
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  const auto draw = [&](size_t n) {
    std::vector<double> v(n);
    for (double& x : v) x = unit(rng);
    return v;
  };
  const std::vector<double> q = draw(size_t(q_shape(p).numel())), kv = draw(size_t(kv_shape(p).numel()));
  const std::vector<double> grad_out = draw(q.size());
  const BlockReference ref = reference_block_attention(p, q, kv);
  const BlockGradients grads = reference_block_backward(p, q, kv, grad_out, ref.out, ref.lse);
  const auto f = [&](const Inputs& in) { return reference_block_attention(p, in[0], in[1]).out; };
  EXPECT_TRUE(all_close(grads.q, numeric_gradient(f, Inputs{q, kv}, 0, grad_out), Tolerance{1e-6, 1e-8})) << "q";
  EXPECT_TRUE(all_close(grads.kv, numeric_gradient(f, Inputs{q, kv}, 1, grad_out), Tolerance{1e-6, 1e-8})) << "kv";
}

// Keys split at random into three blocks (a query may see nothing in one,
// or in all): the blocks' results merged one by one equal the softmax over
// the union.
TEST(BlockAttentionMerge, EqualsTheSoftmaxOverTheUnion) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const Heads heads{2, 4, 2, 16};
  std::vector<int64_t> q_pos = random_positions(rng, 8, 40);
  q_pos[0] = 0, q_pos[1] = 2;  // keys start at 1: query 0 sees nothing anywhere, query 1 at most one key
  std::vector<int64_t> keys = random_positions(rng, 15, 39);
  for (int64_t& k : keys) k += 1;
  const BlockProblem whole = problem_of(heads, q_pos, keys);
  const RandomTensor q = random_tensor(ctx, q_shape(whole), DType::f32, rng, -2.0, 2.0);
  const RandomTensor kv = random_tensor(ctx, kv_shape(whole), DType::f32, rng, -2.0, 2.0);
  BlockForward merged;
  for (const auto& [first, last] : {std::pair{0, 4}, std::pair{4, 11}, std::pair{11, 15}}) {
    const std::vector<int64_t> indices = consecutive_positions(first, last - first);
    const BlockProblem part = problem_of(heads, q_pos, std::vector<int64_t>(keys.begin() + first, keys.begin() + last));
    const Tensor part_kv =
        ctx.from_doubles(kv_shape(part), DType::f32, tokens_at(kv.values, whole.batch, whole.keys(), indices));
    BlockForward f = block_forward(ctx, part, q.tensor, part_kv);
    if (first == 0)
      merged = f;
    else
      ops::attention_block_merge(f.out, f.lse, merged.out, merged.lse);
  }
  expect_forward_matches(merged, reference_block_attention(whole, q.values, kv.values));
}

// ---------------------------------------------------------------------------
// The serial ring: C ranks played in one process
// ---------------------------------------------------------------------------

struct RingCase {
  DType dtype;
  int64_t ranks;
};

void PrintTo(const RingCase& c, std::ostream* os) {
  *os << dtype_name(c.dtype) << " over " << c.ranks << " ranks";
}

std::string ring_case_name(const ::testing::TestParamInfo<RingCase>& info) {
  return std::string(dtype_name(info.param.dtype)) + "_C" + std::to_string(info.param.ranks);
}

class BlockAttentionSerialRing : public ::testing::TestWithParam<RingCase> {};

// Each rank r holds the zigzag chunks r and 2C − 1 − r of a sequence of
// T = 2C·3 tokens; its queries meet every rank's block in ring order (its
// own first), merged; the backward adds each rank's terms into the block
// owner's accumulator. Out, logsumexp, dq and dkv of every rank equal the
// rows of whole-sequence causal attention at its positions.
TEST_P(BlockAttentionSerialRing, EqualsWholeSequenceAttention) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const auto [dtype, ranks] = GetParam();
  const int64_t seq_len = 2 * ranks * 3;
  for (const Heads& heads : {Heads{2, 4, 2, 12}, Heads{1, 3, 3, 9}}) {
    const BlockProblem whole = problem_of(heads, consecutive_positions(0, seq_len), consecutive_positions(0, seq_len));
    const RandomTensor q = random_tensor(ctx, q_shape(whole), dtype, rng, -2.0, 2.0);
    const RandomTensor kv = random_tensor(ctx, kv_shape(whole), dtype, rng, -2.0, 2.0);
    const RandomTensor grad_out = random_tensor(ctx, q_shape(whole), dtype, rng);
    const BlockReference ref = reference_block_attention(whole, q.values, kv.values);

    std::vector<BlockProblem> shard;
    std::vector<Tensor> q_r, kv_r, grad_out_r;
    for (int64_t r = 0; r < ranks; ++r) {
      const std::vector<int64_t> held = zigzag(seq_len, r, ranks);
      shard.push_back(problem_of(heads, held, held));
      q_r.push_back(ctx.from_doubles(q_shape(shard[r]), dtype, tokens_at(q.values, whole.batch, seq_len, held)));
      kv_r.push_back(ctx.from_doubles(kv_shape(shard[r]), dtype, tokens_at(kv.values, whole.batch, seq_len, held)));
      grad_out_r.push_back(
          ctx.from_doubles(q_shape(shard[r]), dtype, tokens_at(grad_out.values, whole.batch, seq_len, held)));
    }
    // Forward: rank r meets the blocks of ranks r, r − 1, ..., as the ring passes them.
    std::vector<Tensor> out_r, lse_r;
    for (int64_t r = 0; r < ranks; ++r) {
      BlockForward running;
      for (int64_t step = 0; step < ranks; ++step) {
        const int64_t j = (r - step + ranks) % ranks;
        const BlockProblem meet = problem_of(heads, shard[r].q_pos, shard[j].k_pos);
        BlockForward f = block_forward(ctx, meet, q_r[r], kv_r[j]);
        if (step == 0)
          running = f;
        else
          ops::attention_block_merge(f.out, f.lse, running.out, running.lse);
      }
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(ranks));
      const std::vector<int64_t>& held = shard[r].q_pos;
      EXPECT_TRUE(all_close(running.out, tokens_at(ref.out, whole.batch, seq_len, held), f32_output())) << "out";
      EXPECT_TRUE(all_close(running.lse, tokens_at(ref.lse, whole.batch * whole.heads, seq_len, held), f32_output()))
          << "logsumexp";
      out_r.push_back(ctx.empty(q_shape(shard[r]), dtype));
      ops::cast(running.out, out_r.back());  // the output as the model keeps it
      lse_r.push_back(running.lse);
    }
    // Backward: dq stays with rank r; dkv of block j collects every rank's terms.
    std::vector<Tensor> dq, dkv;
    for (int64_t r = 0; r < ranks; ++r) {
      dq.push_back(ctx.zeros(q_shape(shard[r]), DType::f32));
      dkv.push_back(ctx.zeros(kv_shape(shard[r]), DType::f32));
    }
    for (int64_t r = 0; r < ranks; ++r)
      for (int64_t j = 0; j < ranks; ++j)
        ops::attention_block_backward(grad_out_r[r], q_r[r], kv_r[j], out_r[r], lse_r[r],
                                      positions_tensor(ctx, shard[r].q_pos), positions_tensor(ctx, shard[j].k_pos),
                                      dq[r], dkv[j]);
    // The whole sequence's reference backward from the outputs the ranks stored.
    std::vector<double> whole_out(ref.out.size());
    const int64_t per_token = whole.heads * whole.head_dim;
    for (int64_t r = 0; r < ranks; ++r) {
      const std::vector<double> held_out = out_r[r].to_doubles();
      for (int64_t b = 0; b < whole.batch; ++b)
        for (size_t i = 0; i < shard[r].q_pos.size(); ++i)
          std::copy_n(held_out.begin() + (b * shard[r].queries() + int64_t(i)) * per_token, per_token,
                      whole_out.begin() + (b * seq_len + shard[r].q_pos[i]) * per_token);
    }
    const BlockGradients grads =
        reference_block_backward(whole, q.values, kv.values, grad_out.values, whole_out, ref.lse);
    for (int64_t r = 0; r < ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(ranks));
      const std::vector<int64_t>& held = shard[r].q_pos;
      EXPECT_TRUE(all_close(dq[r], tokens_at(grads.q, whole.batch, seq_len, held), f32_gradient())) << "dq";
      EXPECT_TRUE(all_close(dkv[r], tokens_at(grads.kv, whole.batch, seq_len, held), f32_gradient())) << "dkv";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, BlockAttentionSerialRing,
                         ::testing::Values(RingCase{DType::f32, 2}, RingCase{DType::f32, 3}, RingCase{DType::f32, 4},
                                           RingCase{DType::bf16, 2}, RingCase{DType::bf16, 3},
                                           RingCase{DType::bf16, 4}),
                         ring_case_name);

// Refusals name the operator, the argument and what was expected.
TEST(BlockAttentionChecks, RefuseMismatchedArguments) {
  Context ctx;
  const Tensor q = ctx.zeros(Shape{1, 4, 4, 8}, DType::f32), kv = ctx.zeros(Shape{1, 5, 2, 2, 8}, DType::f32);
  const Tensor q_pos = ctx.zeros(Shape{4}, DType::i64), k_pos = ctx.zeros(Shape{5}, DType::i64);
  Tensor out = ctx.empty(Shape{1, 4, 4, 8}, DType::f32), lse = ctx.empty(Shape{1, 4, 4}, DType::f32);
  const auto refused = [](auto&& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected a refusal mentioning '" << words << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused(
      [&] {
        ops::attention_block_forward(q, ctx.zeros(Shape{1, 5, 2, 3, 8}, DType::f32), q_pos, k_pos, out, lse);
      },
      "'kv' must be [B, Tk, G, 2, Dh]");
  refused(
      [&] {
        ops::attention_block_forward(q, ctx.zeros(Shape{1, 5, 3, 2, 8}, DType::f32), q_pos, k_pos, out, lse);
      },
      "--num-query-groups");
  refused([&] { ops::attention_block_forward(q, kv, ctx.zeros(Shape{4}, DType::i32), k_pos, out, lse); },
          "q_positions");
  refused([&] { ops::attention_block_forward(q, kv, q_pos, ctx.zeros(Shape{4}, DType::i64), out, lse); },
          "k_positions");
  Tensor out_bf16 = ctx.empty(Shape{1, 4, 4, 8}, DType::bf16);
  refused([&] { ops::attention_block_forward(q, kv, q_pos, k_pos, out_bf16, lse); }, "out");
  const Tensor block_out = ctx.zeros(Shape{1, 4, 4, 8}, DType::f32), lse_bad = ctx.zeros(Shape{1, 4, 5}, DType::f32);
  refused([&] { ops::attention_block_merge(block_out, lse_bad, out, lse); }, "block_logsumexp");
  Tensor grad_q = ctx.empty(Shape{1, 4, 4, 8}, DType::f32), grad_kv = ctx.empty(Shape{1, 4, 2, 2, 8}, DType::f32);
  refused([&] { ops::attention_block_backward(q, q, kv, q, lse, q_pos, k_pos, grad_q, grad_kv); }, "grad_kv");
}

}  // namespace
}  // namespace tessera::testing
