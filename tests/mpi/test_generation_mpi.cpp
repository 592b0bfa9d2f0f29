// Generation under tensor parallelism (mpiexec, 2 and 4 ranks): the GPT and
// the Llama split over K ranks, built from the same seed as the whole model every rank also
// holds, samples the same tokens with the same seed (temperature, top-k and
// top-p on, so every logit matters) and greedily the same text; every rank
// of the group gets the same tokens (each draws them from the gathered logits).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/context.h"
#include "models/generation.h"
#include "models/registry.h"
#include "parallel/layout.h"
#include "parallel/tensor_parallel.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

nn::ModelConfig small_gpt() {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::gpt;
  m.vocab_size = 64;
  m.seq_length = 32;
  m.num_layers = 2;
  m.num_heads = 4;
  m.hidden_size = 32;
  return m;
}

// The Llama with 4 key/value groups of 2 query heads: split over 2 or 4 ranks, each holds whole groups.
nn::ModelConfig small_llama() {
  nn::ModelConfig m = small_gpt();
  m.kind = nn::ModelKind::llama;
  m.num_heads = 8;
  m.num_query_groups = 4;
  return m;
}

std::unique_ptr<models::CausalLm> causal_lm(const nn::ModelConfig& m, const nn::ModelSpec& spec,
                                            parallel::TensorParallelism tp) {
  std::unique_ptr<nn::Module> built = models::model_row(m.kind).build(m, spec, tp, nn::StageLayers{});
  return std::unique_ptr<models::CausalLm>(dynamic_cast<models::CausalLm*>(built.release()));
}

// Every rank's tokens, gathered to compare.
std::vector<int32_t> all_ranks(parallel::Communicator& comm, Context& ctx, const std::vector<int32_t>& tokens) {
  Tensor mine = ctx.from_vector(Shape{int64_t(tokens.size())}, tokens);
  Tensor all = ctx.empty(Shape{int64_t(tokens.size()) * comm.size()}, DType::i32);
  comm.all_gather(mine, all)->wait();
  return all.to_vector<int32_t>();
}

void expect_tensor_parallel_samples_the_one_rank_tokens(const nn::ModelConfig& m) {
  auto comm = world();
  Context ctx(one_thread());
  const uint64_t seed = test_seed();
  for (const int k : {2, 4}) {
    if (comm->size() % k != 0) continue;
    SCOPED_TRACE("tp=" + std::to_string(k));
    parallel::LayoutSizes sizes;
    sizes.tp = k;
    parallel::Layout layout(*comm, sizes);
    const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, seed};
    const auto whole_model = causal_lm(m, spec, parallel::TensorParallelism{});
    const auto split_model = causal_lm(m, spec, parallel::TensorParallelism{&layout.group("tp"), false});
    models::CausalLm& whole = *whole_model;
    models::CausalLm& split = *split_model;
    std::mt19937_64 rng(seed);
    std::vector<int32_t> prompt(4);
    for (int32_t& id : prompt) id = int32_t(rng() % uint64_t(m.vocab_size));
    for (const nn::SamplingOptions& sampling :
         {nn::SamplingOptions{0.0f, 0, 1.0f, 0}, nn::SamplingOptions{1.0f, 0, 1.0f, rng()},
          nn::SamplingOptions{0.8f, 20, 0.9f, rng()}}) {
      models::GenerationOptions options;
      options.max_new_tokens = 24;
      options.sampling = sampling;
      const std::vector<int32_t> one_rank = models::generate(whole, prompt, options).tokens;
      const std::vector<int32_t> tensor_parallel = models::generate(split, prompt, options).tokens;
      EXPECT_EQ(tensor_parallel, one_rank) << "temperature " << sampling.temperature;
      const std::vector<int32_t> everyone = all_ranks(*comm, ctx, tensor_parallel);
      for (int r = 0; r < comm->size(); ++r)
        EXPECT_EQ(std::vector<int32_t>(everyone.begin() + r * 24, everyone.begin() + (r + 1) * 24), tensor_parallel)
            << "rank " << r << " drew other tokens";
    }
  }
}

TEST(GenerationMpi, TensorParallelSamplesTheOneRankTokensWithTheSameSeed) {
  TESSERA_SEED_TRACE();
  expect_tensor_parallel_samples_the_one_rank_tokens(small_gpt());
}

TEST(GenerationMpi, TensorParallelLlamaSamplesTheOneRankTokensWithTheSameSeed) {
  TESSERA_SEED_TRACE();
  expect_tensor_parallel_samples_the_one_rank_tokens(small_llama());
}

}  // namespace
}  // namespace tessera::testing
