// parallel::RingAttention under a real mpiexec (2 and 4 ranks with the rest of
// the MPI tests, 3 ranks by itself: tessera_mpi_tests_ring_np3): every rank
// draws the whole sequence (all ranks share the test seed), runs the ring on
// its zigzag share over MPI, and compares its out, logsumexp, grad_q and
// grad_kv with the rows of the whole-sequence double reference
// (tests/support/reference_block_attention.h) at its positions; the
// reference's backward reads the outputs every rank stored (all-gathered).
// f32 and bf16, grouped (G < H) and multi-head (G = H) attention. A
// contiguous split (not zigzag) exercises the causal shortcut: the blocks
// after every local query are skipped, yet still travel, and the results
// are the same; the bytes sent are the compact blocks and f32 accumulators.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "parallel/ring_attention.h"
#include "tests/kernels/attention_support.h"
#include "tests/kernels/dtype_params.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/reference_block_attention.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using parallel::CommCounters;
using parallel::Communicator;
using parallel::RingAttention;

struct RingHeads {
  int64_t batch, heads, groups, head_dim;  // B, H, G, Dh
};

struct RingCase {
  DType dtype;       // q, kv, grad_out, out
  DType grad_dtype;  // grad_q, grad_kv: f32 or the dtype
  RingHeads heads;
};

// Rank r of c holds tokens [r·T/c, (r + 1)·T/c): every later rank's block is
// in its future.
std::vector<std::vector<int64_t>> contiguous_positions(int64_t seq_len, int ranks) {
  std::vector<std::vector<int64_t>> positions;
  for (int r = 0; r < ranks; ++r) positions.push_back(consecutive_positions(r * seq_len / ranks, seq_len / ranks));
  return positions;
}

// The whole-sequence output, in [B, T, H, Dh], from every rank's stored out
// [B, Tl, H, Dh] (all-gathered) placed at its positions.
std::vector<double> gathered_output(Communicator& cp, const Tensor& out,
                                    const std::vector<std::vector<int64_t>>& positions, int64_t seq_len) {
  const int64_t per_rank = out.numel(), batch = out.size(0), held = out.size(1), per_token = out.size(2) * out.size(3);
  Tensor all = out.context().empty(Shape{cp.size() * per_rank}, out.dtype());
  cp.all_gather(out.reshape({per_rank}), all)->wait();
  const std::vector<double> values = all.to_doubles();
  std::vector<double> whole(size_t(batch * seq_len * per_token));
  for (int r = 0; r < cp.size(); ++r)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < held; ++i)
        std::copy_n(values.begin() + r * per_rank + (b * held + i) * per_token, per_token,
                    whole.begin() + (b * seq_len + positions[size_t(r)][size_t(i)]) * per_token);
  return whole;
}

// The tolerance of a result stored in `dtype` (computed in f32 from the stored
// inputs, then rounded to `dtype` once).
Tolerance stored_tolerance(DType dtype, bool gradient) {
  return gradient ? gradient_tolerance(dtype) : output_tolerance(dtype);
}

// One forward and backward of the ring over `positions` against the reference.
void expect_ring_matches_the_reference(Communicator& cp, RingAttention& ring, const RingCase& c,
                                       const std::vector<std::vector<int64_t>>& positions, int64_t seq_len) {
  Context ctx(one_thread());
  auto rng = make_rng();  // the same stream on every rank
  const RingHeads& h = c.heads;
  const BlockProblem whole{h.batch,
                           h.heads,
                           h.groups,
                           h.head_dim,
                           1.0 / std::sqrt(double(h.head_dim)),
                           consecutive_positions(0, seq_len),
                           consecutive_positions(0, seq_len)};
  const Shape q_whole{h.batch, seq_len, h.heads, h.head_dim}, kv_whole{h.batch, seq_len, h.groups, 2, h.head_dim};
  const RandomTensor q = random_tensor(ctx, q_whole, c.dtype, rng, -2.0, 2.0);
  const RandomTensor kv = random_tensor(ctx, kv_whole, c.dtype, rng, -2.0, 2.0);
  const RandomTensor grad_out = random_tensor(ctx, q_whole, c.dtype, rng);
  const BlockReference ref = reference_block_attention(whole, q.values, kv.values);

  const std::vector<int64_t>& held = positions[size_t(cp.rank())];
  const int64_t local = int64_t(held.size());
  const Shape q_local = q_whole.with_dim(1, local), kv_local = kv_whole.with_dim(1, local);
  const Tensor q_r = ctx.from_doubles(q_local, c.dtype, tokens_at(q.values, h.batch, seq_len, held));
  const Tensor kv_r = ctx.from_doubles(kv_local, c.dtype, tokens_at(kv.values, h.batch, seq_len, held));
  const Tensor grad_out_r = ctx.from_doubles(q_local, c.dtype, tokens_at(grad_out.values, h.batch, seq_len, held));
  Tensor out = poisoned(ctx, q_local, c.dtype), lse = poisoned(ctx, Shape{h.batch, h.heads, local}, DType::f32);
  ring.forward(q_r, kv_r, out, lse);
  EXPECT_TRUE(all_close(out, tokens_at(ref.out, h.batch, seq_len, held), stored_tolerance(c.dtype, false))) << "out";
  EXPECT_TRUE(all_close(lse, tokens_at(ref.lse, h.batch * h.heads, seq_len, held), output_tolerance(DType::f32)))
      << "logsumexp";

  Tensor grad_q = poisoned(ctx, q_local, c.grad_dtype), grad_kv = poisoned(ctx, kv_local, c.grad_dtype);
  ring.backward(grad_out_r, q_r, kv_r, out, lse, grad_q, grad_kv);
  const BlockGradients grads = reference_block_backward(whole, q.values, kv.values, grad_out.values,
                                                        gathered_output(cp, out, positions, seq_len), ref.lse);
  EXPECT_TRUE(all_close(grad_q, tokens_at(grads.q, h.batch, seq_len, held), stored_tolerance(c.grad_dtype, true)))
      << "grad_q";
  EXPECT_TRUE(all_close(grad_kv, tokens_at(grads.kv, h.batch, seq_len, held), stored_tolerance(c.grad_dtype, true)))
      << "grad_kv";
}

std::string describe(const RingCase& c, int ranks) {
  return std::string(dtype_name(c.dtype)) + " grads " + std::string(dtype_name(c.grad_dtype)) +
         " H=" + std::to_string(c.heads.heads) + " G=" + std::to_string(c.heads.groups) + " on " +
         std::to_string(ranks) + " ranks";
}

const RingCase kCases[] = {
    {DType::f32, DType::f32, {2, 4, 2, 12}},    // grouped-query
    {DType::f32, DType::f32, {1, 3, 3, 9}},     // multi-head
    {DType::bf16, DType::f32, {2, 4, 2, 12}},   // bf16 inputs, f32 gradients
    {DType::bf16, DType::bf16, {1, 4, 1, 16}},  // multi-query, gradients cast to bf16
};

TEST(RingAttention, ZigzagEqualsWholeSequenceAttention) {
  TESSERA_SEED_TRACE();
  auto cp = world();
  const int64_t seq_len = 2 * cp->size() * 3;  // chunks of 3 tokens
  const auto positions = parallel::zigzag_positions(seq_len, cp->size());
  for (const RingCase& c : kCases) {
    SCOPED_TRACE(describe(c, cp->size()));
    RingAttention ring(*cp, positions);
    expect_ring_matches_the_reference(*cp, ring, c, positions, seq_len);
    EXPECT_EQ(ring.counts().skipped, 0) << "no zigzag block is wholly in the future";
    EXPECT_EQ(ring.counts().computed, 2 * cp->size());
  }
}

// Contiguous shares: rank r's queries precede every key of ranks r + 1 ...,
// so those blocks are skipped (forward and backward) but still passed on.
TEST(RingAttention, SkipsBlocksInTheFutureAndStillPassesThem) {
  TESSERA_SEED_TRACE();
  auto cp = world();
  const int ranks = cp->size(), rank = cp->rank();
  const int64_t seq_len = int64_t(ranks) * 5;
  const auto positions = contiguous_positions(seq_len, ranks);
  for (const RingCase& c : {kCases[0], kCases[2]}) {
    SCOPED_TRACE(describe(c, ranks));
    RingAttention ring(*cp, positions);
    cp->reset_counters();
    expect_ring_matches_the_reference(*cp, ring, c, positions, seq_len);
    EXPECT_EQ(ring.counts().skipped, 2 * (ranks - 1 - rank));
    EXPECT_EQ(ring.counts().computed, 2 * (rank + 1));
    // Sent: C − 1 key/value blocks forward, C − 1 backward, and C f32
    // accumulators (the last one home), plus the test's all-gather (not a send).
    const int64_t kv_elements = c.heads.batch * (seq_len / ranks) * c.heads.groups * 2 * c.heads.head_dim;
    const int64_t block_bytes = kv_elements * int64_t(dtype_size(c.dtype));
    EXPECT_EQ(cp->counters().calls[CommCounters::send], 3 * ranks - 2);
    EXPECT_EQ(cp->counters().bytes[CommCounters::send], 2 * (ranks - 1) * block_bytes + ranks * kv_elements * 4);
  }
}

// With events on the group (a trace), every block's compute, every exchange
// and every blocking wait is recorded in order on the clock given, each wait
// inside the exchange it waited for; the results are the same. Without
// them nothing is recorded.
TEST(RingAttention, RecordsItsBlocksExchangesAndWaitsForATrace) {
  TESSERA_SEED_TRACE();
  auto cp = world();
  const int ranks = cp->size();
  const int64_t seq_len = 2 * ranks * 4;
  const auto positions = parallel::zigzag_positions(seq_len, ranks);
  struct Event {
    std::string name, category;
    int64_t start, end;
  };
  std::vector<Event> events;
  int64_t ticks = 0;  // a clock that always moves
  cp->set_events(parallel::GroupEvents{
      [&ticks] { return ++ticks; },
      [&events](const std::string& name, const std::string& category, int64_t start, int64_t end) {
        events.push_back({name, category, start, end});
      }});
  RingAttention ring(*cp, positions);
  expect_ring_matches_the_reference(*cp, ring, kCases[0], positions, seq_len);
  cp->set_events({});
  const auto count = [&events](const std::string& name) {
    return std::count_if(events.begin(), events.end(), [&name](const Event& e) { return e.name == name; });
  };
  EXPECT_EQ(count("ring forward block"), ranks);
  EXPECT_EQ(count("ring backward block"), ranks);
  EXPECT_EQ(count("ring forward exchange"), ranks - 1);
  EXPECT_EQ(count("ring backward exchange"), ranks - 1);
  EXPECT_EQ(count("ring backward gradient exchange"), ranks);
  int64_t waits = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    EXPECT_LT(e.start, e.end) << e.name;
    EXPECT_EQ(e.category, e.name.ends_with("block") ? "compute" : "comm") << e.name;
    if (!e.name.ends_with("wait")) continue;
    ++waits;
    ASSERT_LT(i + 1, events.size()) << "a wait is followed by its exchange";
    const Event& exchange = events[i + 1];
    EXPECT_TRUE(exchange.name.ends_with("exchange")) << exchange.name;
    EXPECT_LE(exchange.start, e.start);
    EXPECT_EQ(exchange.end, e.end);
  }
  EXPECT_EQ(int64_t(events.size()), 2 * ranks + 3 * ranks - 2 + waits);
  events.clear();
  RingAttention quiet(*cp, positions);
  expect_ring_matches_the_reference(*cp, quiet, kCases[0], positions, seq_len);
  EXPECT_TRUE(events.empty());
}

// Shares of different lengths, or positions for another group size, are refused before anything moves.
TEST(RingAttention, RefusesSharesThatDoNotFitTheGroup) {
  auto cp = world();
  auto shares = parallel::zigzag_positions(4 * cp->size(), cp->size());
  shares.back().push_back(4 * cp->size());
  EXPECT_THROW(RingAttention(*cp, shares), Error);
  shares.pop_back();
  EXPECT_THROW(RingAttention(*cp, shares), Error);
}

}  // namespace
}  // namespace tessera::testing
