// parallel::MixtureOfExperts with its experts split over the ranks (expert
// parallelism) under a real mpiexec (2 and 4 ranks with the other MPI
// tests, 3 by itself): each rank routes its own tokens, and the layer equals
// one process running every rank's tokens through all 12 experts (the same
// initial values: a parameter's are a function of its name): each rank's
// output and input gradient are that process's rows, each expert's gradients
// (held by one rank, from every rank's tokens) that process's, and the
// router's summed over the ranks that process's; an expert's gradient is
// averaged over the data axes only, the router's over ep too. Dropless, top-2, no
// auxiliary losses (theirs are each rank's own tokens'); f32.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/context.h"
#include "parallel/moe.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

TEST(MoeExpertParallel, EqualsOneProcessRunningEveryRanksTokens) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  const int ranks = comm->size(), me = comm->rank();
  constexpr int64_t kHidden = 6, kBatch = 2, kTokens = 7;
  parallel::MoeConfig config;
  config.num_experts = 12;
  config.top_k = 2;
  config.ffn_hidden = 5;
  auto rng = make_rng();  // the same stream on every rank
  const uint64_t seed = rng();
  Context ctx;
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.seed = seed;
  const Shape all_tokens{kBatch * ranks, kTokens, kHidden};
  const RandomTensor x = random_tensor(ctx, all_tokens, DType::f32, rng, -2.0, 2.0);
  const RandomTensor g = random_tensor(ctx, all_tokens, DType::f32, rng);

  // One process, every rank's tokens, every expert.
  parallel::MixtureOfExperts whole(spec, "moe", kHidden, config, 0.0f);
  nn::Saved whole_saved;
  const Tensor whole_out = whole.forward(x.tensor, whole_saved, nn::Pass{});
  nn::zero_grads(whole.parameters());
  const Tensor whole_dx = whole.backward(g.tensor, whole_saved);
  std::map<std::string, nn::Parameter*> reference;
  for (nn::Parameter* p : whole.parameters()) reference[p->name] = p;

  // This rank: its samples [me·B, (me + 1)·B), its 12/P experts.
  parallel::TensorParallelism layout;
  layout.experts = comm.get();
  parallel::MixtureOfExperts split(spec, "moe", kHidden, config, 0.0f, layout);
  ASSERT_EQ(int64_t(split.experts().size()), config.num_experts / ranks);
  const Tensor mine = x.tensor.slice(me * kBatch, (me + 1) * kBatch).clone();
  nn::Saved saved;
  const Tensor out = split.forward(mine, saved, nn::Pass{});
  EXPECT_TRUE(all_close(out, whole_out.slice(me * kBatch, (me + 1) * kBatch).to_doubles(), Tolerance{1e-5, 1e-6}))
      << "output";
  nn::zero_grads(split.parameters());
  const Tensor dx = split.backward(g.tensor.slice(me * kBatch, (me + 1) * kBatch).clone(), saved);
  EXPECT_TRUE(all_close(dx, whole_dx.slice(me * kBatch, (me + 1) * kBatch).to_doubles(), Tolerance{1e-5, 1e-6}))
      << "input gradient";
  for (nn::Parameter* p : split.parameters()) {
    ASSERT_TRUE(reference.count(p->name)) << p->name;
    EXPECT_EQ(p->value.to_doubles(), reference[p->name]->value.to_doubles()) << p->name << ": the same initial values";
    Tensor grad = p->grad.clone();
    const bool expert = p->name.find(".experts.") != std::string::npos;
    if (!expert) comm->all_reduce(grad, parallel::ReduceOp::sum)->wait();  // the router's: each rank its tokens'
    EXPECT_TRUE(all_close(grad, reference[p->name]->grad.to_doubles(), Tolerance{1e-4, 1e-6})) << p->name;
    EXPECT_EQ(p->gradient_axes, (expert ? std::vector<std::string>{"dp", "cp"} : std::vector<std::string>{"dp", "cp", "ep"}))
        << p->name;
  }
  const int64_t first = me * (config.num_experts / ranks);
  EXPECT_EQ(split.experts().front()->name(), "moe.experts." + std::to_string(first));
}

}  // namespace
}  // namespace tessera::testing
