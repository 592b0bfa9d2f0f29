// The zigzag split of context parallelism (parallel/ring_attention.h): rank r
// of C holds chunks r and 2C − 1 − r of 2C; the shares cover the sequence
// exactly once; every rank has the same causal work (query-key pairs with the
// key not after the query, counted here from the positions); a sequence that
// does not split into 2C chunks is refused naming --seq-length and
// --context-parallel-size. Also RingAttention on a group of one rank (no
// exchange) against ops::grouped_attention_forward's numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/local_communicator.h"
#include "parallel/ring_attention.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

TEST(ZigzagSplit, RankHoldsChunksRAndTheirMirror) {
  for (const int ranks : {1, 2, 3, 4, 8})
    for (const int64_t chunk : {1, 3, 16}) {
      const int64_t seq_len = 2 * ranks * chunk;
      std::vector<int> holder(size_t(seq_len), -1);
      std::vector<int64_t> causal_pairs;
      for (int r = 0; r < ranks; ++r) {
        const parallel::ZigzagShard shard = parallel::zigzag_shard(seq_len, r, ranks);
        EXPECT_EQ(shard.chunk_length, chunk);
        EXPECT_EQ(shard.first_begin, r * chunk);
        EXPECT_EQ(shard.second_begin, (2 * ranks - 1 - r) * chunk);
        const std::vector<int64_t> held = shard.positions();
        ASSERT_EQ(int64_t(held.size()), 2 * chunk);
        EXPECT_TRUE(std::is_sorted(held.begin(), held.end()));
        int64_t pairs = 0;
        for (const int64_t t : held) {
          EXPECT_EQ(holder[size_t(t)], -1) << "position " << t << " held twice";
          holder[size_t(t)] = r;
          pairs += t + 1;  // keys 0 ..= t of the whole sequence
        }
        causal_pairs.push_back(pairs);
        EXPECT_EQ(parallel::zigzag_positions(seq_len, ranks)[size_t(r)], held);
      }
      EXPECT_EQ(std::count(holder.begin(), holder.end(), -1), 0) << "a position nobody holds";
      EXPECT_EQ(std::count(causal_pairs.begin(), causal_pairs.end(), causal_pairs[0]), ranks)
          << "causal work differs between ranks";
    }
}

TEST(ZigzagSplit, RefusesASequenceThatDoesNotSplitIntoTwoChunksPerRank) {
  for (const auto& [seq_len, ranks] : {std::pair<int64_t, int>{10, 4}, {6, 4}, {0, 1}}) {
    try {
      parallel::zigzag_shard(seq_len, 0, ranks);
      ADD_FAILURE() << "T=" << seq_len << " over " << ranks << " ranks was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("--seq-length " + std::to_string(seq_len)), std::string::npos) << what;
      EXPECT_NE(what.find("--context-parallel-size"), std::string::npos) << what;
      EXPECT_NE(what.find("multiple of " + std::to_string(2 * ranks)), std::string::npos) << what;
    }
  }
}

// One rank: the ring is the block kernels on the own block, no exchange;
// out equals the existing grouped attention's (another kernel, another
// layout: q and kv copied out of a grouped qkv [B, T, G, R + 2, Dh]).
TEST(RingAttentionOnOneRank, EqualsGroupedAttention) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const int64_t batch = 2, seq_len = 10, groups = 2, per_group = 2, head_dim = 8, heads = groups * per_group;
  const RandomTensor qkv = random_tensor(ctx, Shape{batch, seq_len, groups, per_group + 2, head_dim}, DType::f32, rng);
  std::vector<double> q, kv;
  for (int64_t token = 0; token < batch * seq_len; ++token)
    for (int64_t g = 0; g < groups; ++g) {
      const auto group = qkv.values.begin() + (token * groups + g) * (per_group + 2) * head_dim;
      q.insert(q.end(), group, group + per_group * head_dim);
      kv.insert(kv.end(), group + per_group * head_dim, group + (per_group + 2) * head_dim);
    }
  Tensor out = poisoned(ctx, Shape{batch, seq_len, heads, head_dim}, DType::f32);
  Tensor lse = poisoned(ctx, Shape{batch, heads, seq_len}, DType::f32);
  ops::grouped_attention_forward(qkv.tensor, out, lse);
  auto group = parallel::make_local_communicator("cp");
  parallel::RingAttention ring(*group, parallel::zigzag_positions(seq_len, 1));
  Tensor ring_out = poisoned(ctx, out.shape(), DType::f32), ring_lse = poisoned(ctx, lse.shape(), DType::f32);
  ring.forward(ctx.from_doubles(out.shape(), DType::f32, q),
               ctx.from_doubles(Shape{batch, seq_len, groups, 2, head_dim}, DType::f32, kv), ring_out, ring_lse);
  EXPECT_TRUE(all_close(ring_out, out, Tolerance{1e-5, 2e-5})) << "out";
  EXPECT_TRUE(all_close(ring_lse, lse, Tolerance{1e-5, 2e-5})) << "logsumexp";
}

}  // namespace
}  // namespace tessera::testing
