// Tensor parallelism under mpiexec (2 and 4 ranks): the tensor-parallel GPT
// against the whole GPT (no group) that every rank also builds from the same seed
// (initial values, logits, loss and every gradient gathered whole), with and
// without sequence parallelism, dropout, attention dropout and recomputation; the
// vocabulary-parallel cross-entropy against a double-precision reference;
// the communication each layout does per step against its formula (counted
// by the communicator); gradient-norm counting; dp × tp training against one
// rank; and the messages for layouts that cannot work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "apps/trainer.h"
#include "core/context.h"
#include "models/decoder.h"
#include "nn/loss.h"
#include "nn/models.h"
#include "nn/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/layout.h"
#include "parallel/tensor_parallel.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

constexpr int64_t kIgnore = -100;

nn::ModelConfig small_gpt(float dropout = 0.0f, bool recompute = false, float attention_dropout = 0.0f) {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::gpt;
  m.vocab_size = 32;
  m.seq_length = 8;
  m.num_layers = 2;
  m.num_heads = 4;
  m.hidden_size = 16;
  m.ffn_hidden_size = 24;
  m.dropout = dropout;
  m.recompute = recompute;
  m.attention_dropout = attention_dropout;
  return m;
}

// The tensor-parallel sizes this world can make.
std::vector<int> tp_sizes(int world_size) {
  std::vector<int> sizes;
  for (const int k : {2, 4})
    if (world_size % k == 0) sizes.push_back(k);
  return sizes;
}

// The whole tensor from every rank's shard of it: the shards (equal sizes
// on every rank) are all-gathered and each rank's elements put in place
// through its shard description (rank r holds indices [r·length, (r+1)·length)).
std::vector<double> gather_whole(parallel::Communicator& tp, const nn::ParameterShard& shard, const Tensor& local) {
  if (!shard.split) return local.to_doubles();
  Tensor all = local.context().empty(Shape{local.numel() * tp.size()}, local.dtype(), Device::cpu());
  tp.all_gather(local.flatten(), all)->wait();
  const std::vector<double> pieces = all.to_doubles();
  std::vector<double> whole(size_t(shard.global_shape.numel()), std::numeric_limits<double>::quiet_NaN());
  for (int r = 0; r < tp.size(); ++r) {
    nn::ParameterShard of_rank = shard;
    of_rank.begin = int64_t(r) * shard.length;
    for (const nn::ShardRun& run : nn::shard_runs(of_rank))
      for (int64_t i = 0; i < run.count; ++i)
        whole[size_t(run.global_offset + i)] = pieces[size_t(int64_t(r) * local.numel() + run.local_offset + i)];
  }
  return whole;
}

struct Batch {
  Tensor ids, targets;
};

// Random ids and targets (a few targets ignored), the same on every rank.
Batch random_batch(Context& ctx, const nn::ModelConfig& m, int64_t batch, std::mt19937_64& rng) {
  Batch out;
  out.ids = random_indices(ctx, Shape{batch, m.seq_length}, DType::i32, rng, 0, m.vocab_size).tensor;
  std::vector<int32_t> targets =
      random_indices(ctx, Shape{batch, m.seq_length}, DType::i32, rng, 0, m.vocab_size).tensor.to_vector<int32_t>();
  for (size_t i = 0; i < targets.size(); i += 5) targets[i] = int32_t(kIgnore);
  out.targets = ctx.from_vector(Shape{batch, m.seq_length}, targets);
  return out;
}

// The logits of a tp = 1 run restricted to this rank's columns.
std::vector<double> columns(const Tensor& logits, int64_t begin, int64_t count) {
  const int64_t v = logits.shape()[-1], rows = logits.numel() / v;
  const std::vector<double> all = logits.to_doubles();
  std::vector<double> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < count; ++c) out.push_back(all[size_t(r * v + begin + c)]);
  return out;
}

constexpr Tolerance kValues{0.0, 0.0};  // initialisation: the same numbers exactly
constexpr Tolerance kForward{1e-5, 1e-6};
constexpr Tolerance kGradients{1e-4, 2e-6};

struct Variant {
  bool sequence_parallel;
  float dropout;
  bool recompute;
  float attention_dropout = 0.0f;  // each rank's heads draw the whole model's masks (head_offset)
};

// tp = K (every K the world allows) against tp = 1 from the same seed.
TEST(TensorParallelGpt, MatchesOneRankExactlyAtInitAndWithinF32InForwardAndBackward) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  const uint64_t seed = test_seed();
  for (const int k : tp_sizes(comm->size()))
    for (const Variant variant :
         {Variant{false, 0.0f, false}, Variant{true, 0.0f, false}, Variant{false, 0.1f, true},
          Variant{true, 0.1f, true}, Variant{false, 0.0f, false, 0.2f}, Variant{true, 0.1f, true, 0.2f}}) {
      SCOPED_TRACE("tp=" + std::to_string(k) + " sequence_parallel=" + std::to_string(variant.sequence_parallel) +
                   " dropout=" + std::to_string(variant.dropout) + " recompute=" + std::to_string(variant.recompute) +
                   " attention_dropout=" + std::to_string(variant.attention_dropout));
      parallel::LayoutSizes sizes;
      sizes.tp = k;
      parallel::Layout layout(*comm, sizes);
      const nn::ModelConfig m = small_gpt(variant.dropout, variant.recompute, variant.attention_dropout);
      const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, seed};
      models::Decoder reference(m, spec, parallel::TensorParallelism{});  // the whole GPT
      models::Decoder split(m, spec, parallel::TensorParallelism{&layout.group("tp"), variant.sequence_parallel});

      std::mt19937_64 rng(seed ^ 0x5eedull);
      const Batch batch = random_batch(ctx, m, 3, rng);
      const nn::Pass pass{seed, 4, 1};

      // Initial values: exactly the slices of the tp = 1 tensors.
      std::map<std::string, nn::Parameter*> whole;
      for (nn::Parameter* p : reference.parameters()) whole[p->name] = p;
      const std::vector<nn::Parameter*> parts = split.parameters();
      ASSERT_EQ(parts.size(), whole.size());
      for (nn::Parameter* p : parts) {
        ASSERT_TRUE(whole.count(p->name)) << p->name;
        EXPECT_TRUE(all_close(gather_whole(layout.group("tp"), p->shard, p->value), whole[p->name]->value.to_doubles(), kValues))
            << p->name;
        // A split parameter names the axis it is split over; all are averaged over dp, cp and ep.
        EXPECT_EQ(p->shard.axes, p->shard.split ? std::vector<std::string>{"tp"} : std::vector<std::string>{}) << p->name;
        EXPECT_TRUE(whole[p->name]->shard.axes.empty()) << p->name;
        EXPECT_EQ(p->gradient_axes, (std::vector<std::string>{"dp", "cp", "ep"})) << p->name;
      }

      nn::Saved saved, loss_saved, split_saved, split_loss_saved;
      Tensor logits = reference.forward(batch.ids, saved, pass);
      const nn::CrossEntropyLoss loss(kIgnore);
      const nn::LossValue expected = loss.forward(logits, batch.targets, loss_saved);
      Tensor local_logits = split.forward(batch.ids, split_saved, pass);
      const int64_t local_vocab = m.vocab_size / k;
      EXPECT_TRUE(all_close(local_logits, columns(logits, split.vocab_begin(), local_vocab), kForward));
      const parallel::VocabParallelCrossEntropy split_loss(layout.group("tp"), split.vocab_begin(), m.vocab_size, kIgnore);
      const nn::LossValue actual = split_loss.forward(local_logits, batch.targets, split_loss_saved);
      EXPECT_EQ(actual.count, expected.count);
      EXPECT_NEAR(actual.loss, expected.loss, 1e-5 * std::abs(expected.loss));

      loss.backward(logits, batch.targets, 0.5f, loss_saved);
      reference.backward(logits, saved);
      split_loss.backward(local_logits, batch.targets, 0.5f, split_loss_saved);
      split.backward(local_logits, split_saved);
      for (nn::Parameter* p : parts)
        EXPECT_TRUE(
            all_close(gather_whole(layout.group("tp"), p->shard, p->grad), whole[p->name]->grad.to_doubles(), kGradients))
            << p->name;

      // The global gradient norm counts each element once.
      nn::OptimizerConfig opt;
      parallel::DataParallelOptions dp_options;
      dp_options.model_parallel = &layout.group("tp");
      parallel::DataParallel replica(parts, layout.group("dp"), opt, dp_options);
      replica.begin_micro_batch(true);
      replica.finish_backward();
      const double expected_norm = nn::global_grad_norm(reference.parameters()).norm;
      // The replica averaged identical dp replicas: the same gradients.
      EXPECT_NEAR(replica.grad_norm().norm, expected_norm, 1e-5 * expected_norm);
    }
}

// Megatron's dropout rule. Replicated region: every rank draws the tp = 1
// mask (nn::Dropout of the same name), and under sequence parallelism each
// rank its positions of it. Split region: the ranks' masks differ, and a
// second forward of the same pass draws the same one again (reproducible);
// backward applies the forward's mask.
TEST(TensorParallelDropout, ReplicatedRegionsDrawTheOneRankMaskSplitRegionsDiffer) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  std::mt19937_64 rng(test_seed());
  const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, 1};
  const nn::Pass pass{test_seed(), 3, 2};
  for (const int k : tp_sizes(comm->size())) {
    parallel::LayoutSizes sizes;
    sizes.tp = k;
    parallel::Layout layout(*comm, sizes);
    const int64_t batch = 3, tokens = 4 * k, features = 5;
    const RandomTensor x = random_tensor(ctx, Shape{batch, tokens, features}, DType::f32, rng, 0.5, 1.5);
    nn::Dropout plain(spec, "blocks.1.mlp.dropout", 0.3f);
    nn::Saved plain_saved;
    const std::vector<double> expected = plain.forward(x.tensor, plain_saved, pass).to_doubles();

    parallel::TensorParallelDropout replicated(spec, "blocks.1.mlp.dropout", {&layout.group("tp"), false}, 0.3f);
    nn::Saved saved;
    EXPECT_TRUE(all_close(replicated.forward(x.tensor, saved, pass), expected, kValues)) << "replicated, tp=" << k;

    // Sequence parallelism: this rank's positions [r·T/K, (r+1)·T/K) of every sequence.
    parallel::TensorParallelDropout sequence(spec, "blocks.1.mlp.dropout", {&layout.group("tp"), true}, 0.3f);
    const int64_t local = tokens / k, first = layout.rank("tp") * local;
    std::vector<float> mine;
    std::vector<double> expected_mine;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = first; t < first + local; ++t)
        for (int64_t f = 0; f < features; ++f) {
          const size_t i = size_t((b * tokens + t) * features + f);
          mine.push_back(float(x.values[i]));
          expected_mine.push_back(expected[i]);
        }
    const Tensor shard = ctx.from_vector(Shape{batch, local, features}, mine);
    nn::Saved sequence_saved;
    EXPECT_TRUE(all_close(sequence.forward(shard, sequence_saved, pass), expected_mine, kValues))
        << "sequence-parallel, tp=" << k;
    // Backward multiplies by the same mask (the input was x, so dx = y / x · dy with dy = x).
    EXPECT_TRUE(all_close(sequence.backward(shard, sequence_saved), expected_mine, kValues));

    // Split region: different masks on different ranks, the same on a second draw.
    parallel::TensorParallelDropout split(spec, "blocks.1.attn.dropout", {&layout.group("tp"), false}, 0.3f,
                                          parallel::TensorParallelDropout::Region::split);
    nn::Saved first_saved, second_saved;
    const Tensor once = split.forward(x.tensor, first_saved, pass);
    const Tensor again = split.forward(x.tensor, second_saved, pass);
    EXPECT_TRUE(all_close(again, once.to_doubles(), kValues)) << "reproducible";
    Tensor all = ctx.empty(Shape{once.numel() * k}, DType::f32);
    layout.group("tp").all_gather(once.flatten(), all)->wait();
    const std::vector<double> masks = all.to_doubles();
    for (int r = 1; r < k; ++r) {
      int64_t different = 0;
      for (int64_t i = 0; i < once.numel(); ++i)
        different += (masks[size_t(i)] == 0.0) != (masks[size_t(r * once.numel() + i)] == 0.0);
      EXPECT_GT(different, 0) << "ranks 0 and " << r << " drew the same split-region mask";
    }
  }
}

// A column-parallel layer that gathers its output is nn::Linear: the same
// output, input gradient and (gathered) weight and bias gradients.
TEST(ColumnParallelLinear, WithGatheredOutputEqualsLinear) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  std::mt19937_64 rng(test_seed());
  const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, test_seed()};
  for (const int k : tp_sizes(comm->size())) {
    parallel::LayoutSizes sizes;
    sizes.tp = k;
    parallel::Layout layout(*comm, sizes);
    const int64_t in = 11, out = 6 * k;
    nn::Linear whole(spec, "head", in, out, true, ops::Activation::gelu);
    parallel::ColumnParallelLinear split(spec, "head", {&layout.group("tp"), false}, in, out, true, ops::Activation::gelu,
                                         parallel::OutputSplit{}, /*gather_output=*/true);
    const RandomTensor x = random_tensor(ctx, Shape{2, 7, in}, DType::f32, rng);
    const RandomTensor dy = random_tensor(ctx, Shape{2, 7, out}, DType::f32, rng);
    nn::Saved saved, split_saved;
    const Tensor expected = whole.forward(x.tensor, saved, {});
    EXPECT_TRUE(all_close(split.forward(x.tensor, split_saved, {}), expected.to_doubles(), kForward));
    const Tensor expected_dx = whole.backward(dy.tensor, saved);
    EXPECT_TRUE(all_close(split.backward(dy.tensor, split_saved), expected_dx.to_doubles(), kGradients));
    EXPECT_TRUE(all_close(gather_whole(layout.group("tp"), split.weight().shard, split.weight().grad),
                          whole.weight().grad.to_doubles(), kGradients));
    EXPECT_TRUE(all_close(gather_whole(layout.group("tp"), split.bias()->shard, split.bias()->grad),
                          whole.bias()->grad.to_doubles(), kGradients));
  }
}

// The bytes a tp = K step moves, counted by the tensor-parallel communicator,
// against the formula: per Transformer block one all-reduce of the
// activations [B, T, C] in forward and one in backward for attention and for
// the MLP, plus the embedding's (forward) and the LM head's (backward), plus
// the loss's row statistics (max: N floats, sums: 2N floats, N = B·T).
// Sequence parallelism replaces every all-reduce by a reduce-scatter and an
// all-gather of the same size and adds the sums of the sequence-shard
// gradients (LayerNorms and row-parallel biases: 6C per block; the position
// table and ln_f: T·C + 2C).
TEST(TensorParallelGpt, CommunicationPerStepMatchesTheFormula) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  const uint64_t seed = test_seed();
  for (const int k : tp_sizes(comm->size()))
    for (const bool sequence_parallel : {false, true}) {
      SCOPED_TRACE("tp=" + std::to_string(k) + " sequence_parallel=" + std::to_string(sequence_parallel));
      parallel::LayoutSizes sizes;
      sizes.tp = k;
      parallel::Layout layout(*comm, sizes);
      const nn::ModelConfig m = small_gpt();
      models::Decoder split(m, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, seed},
                                        parallel::TensorParallelism{&layout.group("tp"), sequence_parallel});
      const parallel::VocabParallelCrossEntropy loss(layout.group("tp"), split.vocab_begin(), m.vocab_size, kIgnore);
      std::mt19937_64 rng(seed);
      const int64_t b = 3;
      const Batch batch = random_batch(ctx, m, b, rng);
      layout.group("tp").reset_counters();
      nn::Saved saved, loss_saved;
      Tensor logits = split.forward(batch.ids, saved, nn::Pass{seed, 0, 0});
      loss.forward(logits, batch.targets, loss_saved);
      loss.backward(logits, batch.targets, 1.0f, loss_saved);
      split.backward(logits, saved);
      const parallel::CommCounters& counted = layout.group("tp").counters();

      const int64_t f32 = 4, n = b * m.seq_length, activation = n * m.hidden_size * f32, layers = m.num_layers;
      const int64_t regions = 2 * (2 * layers + 1);  // forward and backward, each 2 per block + 1
      const int64_t loss_bytes = 3 * n * f32;
      using Kind = parallel::CommCounters;
      if (!sequence_parallel) {
        EXPECT_EQ(counted.calls[Kind::all_reduce], regions + 2);
        EXPECT_EQ(counted.bytes[Kind::all_reduce], regions * activation + loss_bytes);
        EXPECT_EQ(counted.calls[Kind::reduce_scatter] + counted.calls[Kind::all_gather], 0);
      } else {
        const int64_t partial = (layers * 6 * m.hidden_size + m.seq_length * m.hidden_size + 2 * m.hidden_size) * f32;
        EXPECT_EQ(counted.calls[Kind::reduce_scatter], regions);
        EXPECT_EQ(counted.bytes[Kind::reduce_scatter], regions * activation);
        EXPECT_EQ(counted.calls[Kind::all_gather], regions);
        EXPECT_EQ(counted.bytes[Kind::all_gather], regions * activation);
        EXPECT_EQ(counted.calls[Kind::all_reduce], 2 + layers + 1);
        EXPECT_EQ(counted.bytes[Kind::all_reduce], loss_bytes + partial);
      }
      if (comm->rank() == 0 && k == 2)
        std::printf(
            "tp=%d sequence_parallel=%d: per micro-batch of %lld tokens, C=%lld, L=%lld: %lld bytes "
            "(all-reduce %lld in %lld calls, reduce-scatter %lld, all-gather %lld)\n",
            k, int(sequence_parallel), static_cast<long long>(n), static_cast<long long>(m.hidden_size),
            static_cast<long long>(layers), static_cast<long long>(counted.total_bytes()),
            static_cast<long long>(counted.bytes[Kind::all_reduce]),
            static_cast<long long>(counted.calls[Kind::all_reduce]),
            static_cast<long long>(counted.bytes[Kind::reduce_scatter]),
            static_cast<long long>(counted.bytes[Kind::all_gather]));
    }
}

// logits [N, V] split by columns over the world (every K it allows) against a
// double-precision log-softmax: losses, count, and each rank's columns of the
// gradient, with ignored targets.
TEST(VocabParallelCrossEntropy, EqualsThePlainLossIncludingIgnoredTargets) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  std::mt19937_64 rng(test_seed());
  for (const int k : tp_sizes(comm->size())) {
    parallel::LayoutSizes sizes;
    sizes.tp = k;
    parallel::Layout layout(*comm, sizes);
    const int64_t n = 23, v = 12 * k, local = v / k, begin = layout.rank("tp") * local;
    const RandomTensor full = random_tensor(ctx, Shape{n, v}, DType::f32, rng, -4.0, 4.0);
    std::vector<int32_t> targets = random_indices(ctx, Shape{n}, DType::i32, rng, 0, v).tensor.to_vector<int32_t>();
    for (size_t i = 1; i < targets.size(); i += 4) targets[i] = int32_t(kIgnore);
    const Tensor target_tensor = ctx.from_vector(Shape{n}, targets);
    std::vector<float> mine;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < local; ++c) mine.push_back(float(full.values[size_t(r * v + begin + c)]));
    Tensor logits = ctx.from_vector(Shape{n, local}, mine);

    // Reference: mean over counted rows of logsumexp − logit[target], and its gradient.
    double total = 0.0;
    int64_t count = 0;
    std::vector<double> grad(size_t(n * local), 0.0);
    const float scale = 0.75f;
    int64_t counted_rows = 0;
    for (const int32_t t : targets) counted_rows += t != kIgnore;
    for (int64_t r = 0; r < n; ++r) {
      if (targets[size_t(r)] == kIgnore) continue;
      double m = -INFINITY, s = 0.0;
      for (int64_t c = 0; c < v; ++c) m = std::max(m, full.values[size_t(r * v + c)]);
      for (int64_t c = 0; c < v; ++c) s += std::exp(full.values[size_t(r * v + c)] - m);
      const double lse = m + std::log(s);
      total += lse - full.values[size_t(r * v + targets[size_t(r)])];
      ++count;
      for (int64_t c = 0; c < local; ++c) {
        const double p = std::exp(full.values[size_t(r * v + begin + c)] - lse);
        grad[size_t(r * local + c)] =
            scale / double(counted_rows) * (p - (begin + c == targets[size_t(r)] ? 1.0 : 0.0));
      }
    }
    const parallel::VocabParallelCrossEntropy loss(layout.group("tp"), begin, v, kIgnore);
    nn::Saved saved;
    const nn::LossValue value = loss.forward(logits, target_tensor, saved);
    EXPECT_EQ(value.count, count);
    EXPECT_NEAR(value.loss, total / double(count), 1e-5 * total / double(count));
    loss.backward(logits, target_tensor, scale, saved);
    EXPECT_TRUE(all_close(logits, grad, Tolerance{1e-5, 1e-7}));
  }
}

app::TrainConfig synthetic_gpt(int64_t micro, int tp, bool sequence_parallel) {
  app::TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.vocab_size = 32;
  c.seq_length = 8;
  c.num_layers = 2;
  c.num_heads = 4;
  c.hidden_size = 16;
  c.synthetic = true;
  c.micro_batch_size = micro;
  c.train_steps = 20;
  c.optimizer = "adamw";
  c.lr = 3e-3f;
  c.warmup_steps = 2;
  c.clip_grad = 0.5f;  // active: the norm must count split and replicated parameters right
  c.threads = 1;
  c.log_interval = 1000;
  c.tensor_parallel = tp;
  c.sequence_parallel = sequence_parallel;
  return c;
}

// `tessera train` with dp × tp on the world against one rank with the whole
// global batch: the same loss at each of 20 steps within f32 tolerance.
TEST(TensorParallelTrainer, DataTimesTensorParallelEqualsOneRankOverTwentySteps) {
  auto comm = world();
  const int ranks = comm->size();
  const int tp = 2, dp = ranks / tp;
  for (const bool sequence_parallel : {false, true}) {
    SCOPED_TRACE("dp=" + std::to_string(dp) + " tp=2 sequence_parallel=" + std::to_string(sequence_parallel));
    const app::TrainResult actual = app::train(synthetic_gpt(2, tp, sequence_parallel));
    EXPECT_EQ(actual.data_parallel_size, dp);
    const auto local = parallel::make_local_communicator();
    const app::TrainResult expected = app::train(synthetic_gpt(2 * dp, 1, false), *local);
    ASSERT_EQ(actual.losses.size(), expected.losses.size());
    for (size_t s = 0; s < expected.losses.size(); ++s)
      EXPECT_NEAR(actual.losses[s], expected.losses[s], 2e-4 * std::abs(expected.losses[s])) << "step " << s + 1;
    EXPECT_LT(expected.losses.back(), expected.losses.front() - 0.1);
  }
}

// Layouts that cannot work fail at start with the numbers in the message.
TEST(TensorParallelTrainer, BadLayoutsFailAtStartNamingTheNumbers) {
  auto comm = world();
  const int ranks = comm->size();
  const auto message_of = [](const app::TrainConfig& c) -> std::string {
    try {
      app::train(c);
    } catch (const Error& error) {
      return error.what();
    }
    return "(no error)";
  };
  app::TrainConfig heads = synthetic_gpt(2, 2, false);
  heads.hidden_size = 18;
  heads.num_heads = 3;
  EXPECT_THAT(message_of(heads), ::testing::HasSubstr("--num-heads 3 is not divisible by --tensor-parallel 2"));
  app::TrainConfig vocab = synthetic_gpt(2, 2, false);
  vocab.vocab_size = 33;
  EXPECT_THAT(message_of(vocab), ::testing::HasSubstr("--vocab-size 33 is not divisible by --tensor-parallel 2"));
  EXPECT_THAT(message_of(vocab), ::testing::HasSubstr("--vocab-size 34"));
  app::TrainConfig world_size = synthetic_gpt(2, ranks + 1, false);
  const std::string text = message_of(world_size);
  EXPECT_THAT(text, ::testing::HasSubstr(std::to_string(ranks) + " ranks"));
  EXPECT_THAT(text, ::testing::HasSubstr(std::to_string(ranks + 1)));
  app::TrainConfig sequence = synthetic_gpt(2, 2, true);
  sequence.seq_length = 7;
  EXPECT_THAT(message_of(sequence), ::testing::HasSubstr("--seq-length 7 is not divisible by --tensor-parallel 2"));
  app::TrainConfig mlp = synthetic_gpt(2, 2, false);
  mlp.model = nn::ModelKind::mlp;
  EXPECT_THAT(message_of(mlp), ::testing::HasSubstr("--model mlp"));
}

}  // namespace
}  // namespace tessera::testing
