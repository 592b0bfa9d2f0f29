// ParameterShard geometry and shard initialisation: a shard's runs cover
// exactly its elements of the global tensor, and a shard initialised on its
// own holds exactly the values the whole tensor gets at those elements.
#include <gtest/gtest.h>

#include "core/context.h"
#include "nn/parameter.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

// The global flat indices a shard holds, in local order, computed by a
// direct multi-index walk (not by shard_runs).
std::vector<int64_t> shard_indices(const nn::ParameterShard& s) {
  const Shape& cut = s.cut_shape();
  std::vector<int64_t> out;
  for (int64_t g = 0; g < cut.numel(); ++g) {
    int64_t rest = g, index_along_dim = 0;
    for (int d = cut.ndim() - 1; d >= 0; --d) {
      if (d == s.dim) index_along_dim = rest % cut[d];
      rest /= cut[d];
    }
    if (index_along_dim >= s.begin && index_along_dim < s.begin + s.length) out.push_back(g);
  }
  return out;
}

nn::ParameterShard make_shard(Shape global, Shape view, int dim, int64_t begin, int64_t length) {
  nn::ParameterShard s;
  s.global_shape = global;
  s.split = true;
  s.view = view;
  s.dim = dim;
  s.begin = begin;
  s.length = length;
  return s;
}

TEST(ParameterShard, RunsCoverExactlyTheShardsElements) {
  const std::vector<nn::ParameterShard> shards = {
      make_shard(Shape{6, 10}, Shape{}, 0, 2, 3),             // column-parallel rows
      make_shard(Shape{6, 10}, Shape{}, 1, 4, 5),             // row-parallel columns
      make_shard(Shape{24, 8}, Shape{3, 4, 2 * 8}, 1, 1, 2),  // fused QKV: heads 1..2 of 4, Dh = 2, C = 8
      make_shard(Shape{12}, Shape{3, 4, 1}, 1, 2, 2),         // its bias
      make_shard(Shape{5, 7}, Shape{}, 0, 0, 5),              // the whole first dimension
  };
  for (const nn::ParameterShard& s : shards) {
    std::vector<int64_t> from_runs;
    int64_t local = 0;
    for (const nn::ShardRun& r : nn::shard_runs(s)) {
      EXPECT_EQ(r.local_offset, local);
      for (int64_t i = 0; i < r.count; ++i) from_runs.push_back(r.global_offset + i);
      local += r.count;
    }
    EXPECT_EQ(from_runs, shard_indices(s)) << s.cut_shape().to_string() << " dim " << s.dim;
    EXPECT_EQ(s.local_numel(), int64_t(from_runs.size()));
  }
  EXPECT_THROW(nn::shard_runs(make_shard(Shape{6, 10}, Shape{}, 1, 8, 5)), Error);
  EXPECT_THROW(nn::shard_runs(make_shard(Shape{6, 10}, Shape{7, 9}, 0, 0, 1)), Error);
}

TEST(ParameterShard, ShardInitialisationEqualsTheWholeTensorsElements) {
  TESSERA_SEED_TRACE();
  Context ctx;
  const uint64_t seed = test_seed();
  nn::Parameter whole;
  whole.name = "blocks.0.attn.qkv.weight";
  whole.value = ctx.empty(Shape{24, 8}, DType::f32);
  whole.shard.global_shape = Shape{24, 8};
  nn::init_shard_normal(whole, seed, 0.0f, 0.02f);
  const std::vector<float> all = whole.value.to_vector<float>();
  for (int64_t rank = 0; rank < 2; ++rank) {
    nn::Parameter part;
    part.name = whole.name;
    part.shard = make_shard(Shape{24, 8}, Shape{3, 4, 16}, 1, 2 * rank, 2);
    part.value = ctx.empty(Shape{12, 8}, DType::f32);
    nn::init_shard_normal(part, seed, 0.0f, 0.02f);
    const std::vector<float> mine = part.value.to_vector<float>();
    const std::vector<int64_t> indices = shard_indices(part.shard);
    ASSERT_EQ(mine.size(), indices.size());
    for (size_t i = 0; i < indices.size(); ++i) EXPECT_EQ(mine[i], all[size_t(indices[i])]) << "rank " << rank;
  }
}

}  // namespace
}  // namespace tessera::testing
