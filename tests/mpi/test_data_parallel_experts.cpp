// DataParallel over parameters averaged over different groups (expert
// parallelism) under a real mpiexec (2 and 4 ranks with the other MPI
// tests): a small network (a linear layer, a MixtureOfExperts whose experts
// are split over the ep group of a Layout, a linear layer) trained on ep 2,
// ep 2 × dp 2 and ep 4 by one DataParallel built from
// parallel::gradient_groups (dense parameters over dp and ep, experts over
// dp only), with ZeRO 0 to 3, with and without accumulation, with AdamW and
// with SGD (AdamW's update hides a gradient's scale; SGD's does not), against
// one process running every rank's samples through all the experts: every
// parameter (each rank's by its global name) equals the process's, the
// gradient norm equals the process's at every step, and the optimizer state
// (and ZeRO-3's value pieces) that checkpoints write cover every element of
// every logical tensor, all experts included, exactly once over the ranks.
// A sparse case (one token per sample, top-1, more experts than tokens) has
// experts that no row reaches in every micro-batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/context.h"
#include "kernels/ops.h"
#include "nn/layers.h"
#include "nn/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/layout.h"
#include "parallel/moe.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

constexpr int64_t kHidden = 6;

struct ExpertRun {
  int ep = 2;
  int zero = 0;
  int accumulation = 1;
  nn::OptimizerConfig optimizer;
  int64_t samples = 2, tokens = 3;  // per rank and micro-batch
  parallel::MoeConfig moe;
};

// in [C → C], the mixture of experts (its experts split over `expert_group`), out [C → C].
std::unique_ptr<nn::Sequential> expert_network(const nn::ModelSpec& spec, const parallel::MoeConfig& moe,
                                               parallel::Communicator* expert_group) {
  auto net = std::make_unique<nn::Sequential>(spec, "net");
  net->add<nn::Linear>(spec, "net.in", kHidden, kHidden);
  parallel::TensorParallelism experts;
  experts.experts = expert_group;
  net->add<parallel::MixtureOfExperts>(spec, "net.moe", kHidden, moe, 0.0f, experts);
  net->add<nn::Linear>(spec, "net.out", kHidden, kHidden);
  return net;
}

// Micro-batch `micro` of step `step` for all `ranks`: inputs and the output
// gradient (the loss Σ out·g), the same on every rank.
struct GlobalMicroBatch {
  RandomTensor inputs, grad_output;
};
GlobalMicroBatch global_micro_batch(Context& ctx, const ExpertRun& run, uint64_t seed, int step, int micro, int ranks) {
  std::mt19937_64 rng(seed + 7919ull * uint64_t(step * run.accumulation + micro));
  const Shape shape{run.samples * ranks, run.tokens, kHidden};
  GlobalMicroBatch batch;
  batch.inputs = random_tensor(ctx, shape, DType::f32, rng, -2.0, 2.0);
  batch.grad_output = random_tensor(ctx, shape, DType::f32, rng);
  return batch;
}

struct Trained {
  std::map<std::string, std::vector<double>> values;  // by global name
  std::vector<double> norms;                          // per step
};

constexpr int kSteps = 3;

// One process: every rank's samples, every expert; the loss is the mean of
// the ranks' losses (each rank's Σ out·g over its samples).
Trained train_whole(Context& ctx, const ExpertRun& run, uint64_t seed, int ranks) {
  const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, seed};
  auto net = expert_network(spec, run.moe, nullptr);
  const std::vector<nn::Parameter*> parameters = net->parameters();
  nn::Optimizer optimizer(parameters, run.optimizer);
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    nn::zero_grads(parameters);
    for (int micro = 0; micro < run.accumulation; ++micro) {
      const GlobalMicroBatch batch = global_micro_batch(ctx, run, seed, step, micro, ranks);
      nn::Saved saved;
      net->forward(batch.inputs.tensor, saved, nn::Pass{});
      Tensor grad = batch.grad_output.tensor.clone();
      ops::scale_(grad, 1.0f / float(ranks * run.accumulation));
      net->backward(grad, saved);
    }
    const nn::GradNorm norm = nn::global_grad_norm(parameters);
    out.norms.push_back(norm.norm);
    optimizer.step(run.optimizer.lr, nn::clip_coefficient(norm.norm, 0.5 * norm.norm));  // clipping active
  }
  for (nn::Parameter* p : parameters) out.values[p->name] = p->value.to_doubles();
  return out;
}

// Counts, per element of every logical tensor a checkpoint of `whole`'s
// parameters holds (values under ZeRO-3, optimizer state), the ranks that
// write it; summed over the world, each must be 1.
void expect_every_element_written_once(Context& ctx, parallel::Communicator& world,
                                       const std::vector<nn::Parameter*>& whole, parallel::DataParallel& replica) {
  std::map<std::string, std::vector<int32_t>> counts;
  std::vector<parallel::OptimizerStateSlice> slices = replica.value_slices();
  for (parallel::OptimizerStateSlice& slice : replica.optimizer_state_slices()) slices.push_back(std::move(slice));
  for (const nn::Parameter* p : whole) {
    for (const char* state : {".exp_avg", ".exp_avg_sq", ".momentum_buffer"})
      counts[p->name + state].assign(size_t(p->value.numel()), 0);
    if (replica.zero_stage() == 3) counts[p->name].assign(size_t(p->value.numel()), 0);
  }
  for (const parallel::OptimizerStateSlice& slice : slices) {
    const auto found = counts.find(slice.name);
    EXPECT_NE(found, counts.end()) << "unexpected slice " << slice.name;
    if (found == counts.end() || !slice.owner) continue;
    const int64_t begin = slice.flat_range ? slice.begin : 0;
    EXPECT_LE(begin + slice.local->numel(), int64_t(found->second.size())) << slice.name;
    for (int64_t i = begin; i < std::min<int64_t>(begin + slice.local->numel(), found->second.size()); ++i)
      ++found->second[size_t(i)];
  }
  const bool adamw = replica.optimizer().config().kind == nn::OptimizerKind::adamw;
  for (auto& [name, count] : counts) {
    Tensor total = ctx.from_vector(Shape{int64_t(count.size())}, count);
    world.all_reduce(total, parallel::ReduceOp::sum)->wait();
    const bool kept = name.find(adamw ? ".momentum_buffer" : ".exp_avg") == std::string::npos;
    int64_t wrong = 0;
    for (int32_t value : total.to_vector<int32_t>()) wrong += value != (kept ? 1 : 0);
    EXPECT_EQ(wrong, 0) << name << ": elements written by no rank or by several";
  }
}

// This rank's samples [r·b, (r+1)·b) of every micro-batch through its
// DataParallel replica (ZeRO-2/3 over the network's sharding units).
Trained train_split(Context& ctx, const ExpertRun& run, uint64_t seed, parallel::Communicator& world) {
  parallel::LayoutSizes sizes;
  sizes.ep = run.ep;
  parallel::Layout layout(world, sizes);
  const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, seed};
  auto net = expert_network(spec, run.moe, &layout.group("ep"));
  const parallel::GradientGroups groups = parallel::gradient_groups(layout, net->parameters());
  EXPECT_EQ(groups.groups.size(), 2u) << "dense parameters and experts";
  EXPECT_EQ(groups.replicas->size(), world.size()) << "dp × ep is the world";
  parallel::DataParallelOptions options;
  options.zero_stage = run.zero;
  options.bucket_size_mb = 40 * 4 / (1024.0 * 1024.0);  // ~40 elements: several buckets per group
  if (run.zero >= 2) options.units = nn::sharding_units(*net);
  parallel::DataParallel replica(groups, run.optimizer, options);
  const int ranks = world.size(), me = world.rank();
  const int64_t b = run.samples;
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    replica.begin_step();
    for (int micro = 0; micro < run.accumulation; ++micro) {
      replica.begin_micro_batch(micro + 1 == run.accumulation);
      const GlobalMicroBatch batch = global_micro_batch(ctx, run, seed, step, micro, ranks);
      nn::Saved saved;
      net->forward(batch.inputs.tensor.slice(me * b, (me + 1) * b).clone(), saved, nn::Pass{});
      Tensor grad = batch.grad_output.tensor.slice(me * b, (me + 1) * b).clone();
      ops::scale_(grad, 1.0f / float(run.accumulation));
      net->backward(grad, saved);
      replica.finish_backward();
    }
    const nn::GradNorm norm = replica.grad_norm();
    EXPECT_TRUE(norm.finite);
    out.norms.push_back(norm.norm);
    replica.step(run.optimizer.lr, nn::clip_coefficient(norm.norm, 0.5 * norm.norm));
  }
  const nn::ModelSpec whole_spec{&ctx, Device::cpu(), DType::f32, seed};
  const auto whole = expert_network(whole_spec, run.moe, nullptr);
  expect_every_element_written_once(ctx, world, whole->parameters(), replica);
  replica.unshard_values();
  for (nn::Parameter* p : net->parameters()) out.values[p->name] = p->value.to_doubles();
  return out;
}

nn::OptimizerConfig optimizer_named(nn::OptimizerKind kind) {
  nn::OptimizerConfig config;
  config.kind = kind;
  config.lr = kind == nn::OptimizerKind::adamw ? 1e-2 : 0.05;
  config.momentum = 0.9f;
  config.weight_decay = 0.1;
  // A router row whose expert no token's top-k comes near has a gradient of
  // rounding noise (~1e-10, summed in another order per layout); AdamW with
  // eps 1e-8 turns that noise into a step of up to lr. eps 1e-6 keeps such
  // steps below lr/100 and still normalises every gradient that carries signal
  // (1e-5 and up here).
  config.eps = 1e-6;
  return config;
}

void expect_equal_runs(const ExpertRun& run, Tolerance tolerance) {
  Context ctx(one_thread());
  auto comm = world();
  const uint64_t seed = make_rng()();  // the same on every rank
  const Trained expected = train_whole(ctx, run, seed, comm->size());
  const Trained actual = train_split(ctx, run, seed, *comm);
  for (const auto& [name, values] : actual.values) {
    const auto found = expected.values.find(name);
    EXPECT_NE(found, expected.values.end()) << name;
    if (found != expected.values.end()) {
      EXPECT_TRUE(all_close(values, found->second, tolerance)) << name;
    }
  }
  EXPECT_EQ(actual.norms.size(), expected.norms.size());
  for (size_t s = 0; s < std::min(actual.norms.size(), expected.norms.size()); ++s)
    EXPECT_NEAR(actual.norms[s], expected.norms[s], 1e-5 * expected.norms[s]) << "step " << s + 1;
}

// The expert-parallel sizes this world has room for: ep 2 (with dp the rest) and ep 4.
std::vector<int> expert_parallel_sizes(int world_size) {
  std::vector<int> sizes;
  for (int ep : {2, 4})
    if (world_size % ep == 0) sizes.push_back(ep);
  return sizes;
}

TEST(DataParallelExperts, EveryZeroStageEqualsOneProcessWithAllExperts) {
  TESSERA_SEED_TRACE();
  const int ranks = world()->size();
  if (ranks < 2) GTEST_SKIP() << "needs expert parallelism over several ranks";
  for (const int ep : expert_parallel_sizes(ranks))
    for (const nn::OptimizerKind kind : {nn::OptimizerKind::adamw, nn::OptimizerKind::sgd})
      for (const int zero : {0, 1, 2, 3})
        for (const int accumulation : {1, 2}) {
          SCOPED_TRACE("ep " + std::to_string(ep) + " dp " + std::to_string(ranks / ep) + " " +
                       nn::optimizer_kind_name(kind) + " zero " + std::to_string(zero) + " accumulation " +
                       std::to_string(accumulation));
          ExpertRun run;
          run.ep = ep;
          run.zero = zero;
          run.accumulation = accumulation;
          run.optimizer = optimizer_named(kind);
          run.moe.num_experts = 8;
          run.moe.top_k = 2;
          run.moe.ffn_hidden = 5;
          // AdamW normalises each element's step: a near-zero gradient summed
          // in another order can move by a small part of lr.
          expect_equal_runs(
              run, kind == nn::OptimizerKind::adamw ? Tolerance{1e-4, run.optimizer.lr / 50} : Tolerance{1e-5, 1e-6});
        }
}

// One token per sample, top-1 of 12 experts: at most one expert per rank is
// chosen in a micro-batch, so experts that receive no row at all (no
// backward runs for them) are on some ranks in every micro-batch; their
// gradients must still count as complete so that every rank's buckets and
// units fill, and reduce, alike.
TEST(DataParallelExperts, ExpertsNoTokenReachesStillReduceAlike) {
  TESSERA_SEED_TRACE();
  const int ranks = world()->size();
  if (ranks < 2) GTEST_SKIP() << "needs expert parallelism over several ranks";
  for (const int ep : expert_parallel_sizes(ranks))
    for (const int zero : {0, 1, 2, 3}) {
      SCOPED_TRACE("ep " + std::to_string(ep) + " zero " + std::to_string(zero));
      ExpertRun run;
      run.ep = ep;
      run.zero = zero;
      run.accumulation = 2;
      run.samples = 1;
      run.tokens = 1;
      run.optimizer = optimizer_named(nn::OptimizerKind::sgd);
      run.moe.num_experts = 12;
      run.moe.top_k = 1;
      run.moe.ffn_hidden = 4;
      expect_equal_runs(run, Tolerance{1e-5, 1e-6});
    }
}

}  // namespace
}  // namespace tessera::testing
