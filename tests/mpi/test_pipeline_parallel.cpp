// Pipeline parallelism under mpiexec (2 and 4 ranks): a step of P stages
// (every P the world allows, both schedules) against the whole model that
// every rank also builds from the same seed, for the GPT (with dropout, the
// tied embedding summed between the first and last stage) and the MLP: the
// loss and every gradient; 1F1B holds fewer micro-batches' activations than
// GPipe when M > P (allocator counters); the last stage's loss and counts
// shared over every dp × pp layout; partitioning; `tessera train` with
// dp × pp against one rank; and the messages for layouts that cannot work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "apps/trainer.h"
#include "core/context.h"
#include "nn/loss.h"
#include "nn/models.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/pipeline.h"
#include "parallel/layout.h"
#include "models/decoder.h"
#include "models/stage_model.h"
#include "parallel/tensor_parallel.h"
#include "parallel/train_step.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

nn::ModelConfig model_config(const std::string& kind) {
  nn::ModelConfig m;
  m.kind = nn::parse_model_kind(kind);
  if (kind == "gpt") {
    m.vocab_size = 24;
    m.seq_length = 6;
    m.num_layers = 4;
    m.num_heads = 2;
    m.hidden_size = 8;
    m.dropout = 0.1f;
  } else {
    m.hidden = {13, 11, 9};  // four layers
    m.channels = 1;
    m.height = 3;
    m.width = 4;
    m.num_classes = 5;
  }
  return m;
}

struct MicroBatches {
  std::vector<Tensor> inputs, targets;
};

MicroBatches micro_batches(Context& ctx, const nn::ModelConfig& m, int count, int64_t batch, uint64_t seed) {
  std::mt19937_64 rng(seed);
  MicroBatches out;
  for (int i = 0; i < count; ++i) {
    if (m.kind == nn::ModelKind::gpt) {
      out.inputs.push_back(random_indices(ctx, Shape{batch, m.seq_length}, DType::i32, rng, 0, m.vocab_size).tensor);
      out.targets.push_back(random_indices(ctx, Shape{batch, m.seq_length}, DType::i32, rng, 0, m.vocab_size).tensor);
    } else {
      out.inputs.push_back(random_tensor(ctx, Shape{batch, m.channels, m.height, m.width}, DType::f32, rng).tensor);
      out.targets.push_back(random_indices(ctx, Shape{batch}, DType::i32, rng, 0, m.num_classes).tensor);
    }
  }
  return out;
}

nn::Pass pass_of(uint64_t seed, int micro) {
  return nn::Pass{seed, 2, uint64_t(micro)};
}

// One rank's stage of a P-stage model, and what the engine needs for it.
struct Stage {
  std::unique_ptr<nn::Module> model;
  std::unique_ptr<nn::Loss> loss;
  nn::Parameter* tied = nullptr;
  Shape input_shape;
};

Stage build_stage(const nn::ModelConfig& m, const nn::ModelSpec& spec, parallel::Layout& layout, int64_t batch,
                  const std::vector<int64_t>& bounds) {
  nn::StageLayers layers;
  layers.stage = layout.rank("pp");
  layers.stages = layout.size("pp");
  layers.begin = bounds[size_t(layers.stage)];
  layers.end = bounds[size_t(layers.stage) + 1];
  Stage stage;
  if (m.kind == nn::ModelKind::gpt) {
    auto gpt =
        std::make_unique<models::Decoder>(m, spec, parallel::TensorParallelism{&layout.group("tp"), false}, layers);
    stage.tied = gpt->embedding_table();
    stage.input_shape = gpt->hidden_shape(batch, m.seq_length);
    stage.loss = std::make_unique<parallel::VocabParallelCrossEntropy>(layout.group("tp"), 0, m.vocab_size);
    stage.model = std::move(gpt);
  } else {
    stage.model = models::model_row(m.kind).build(m, spec, parallel::TensorParallelism{}, layers);
    stage.loss = std::make_unique<nn::CrossEntropyLoss>();
    const int64_t width = layers.begin == 0 ? m.channels * m.height * m.width : m.hidden[size_t(layers.begin) - 1];
    stage.input_shape = Shape{batch, width};
  }
  return stage;
}

// The whole model on one process: every micro-batch forward and backward,
// gradients accumulated (loss gradient 1/M); returns the summed loss.
double run_whole_model(nn::Module& whole, const MicroBatches& data, int micro, uint64_t seed) {
  const nn::CrossEntropyLoss plain;
  double loss = 0.0;
  for (int i = 0; i < micro; ++i) {
    nn::Saved saved, loss_saved;
    Tensor out = whole.forward(data.inputs[size_t(i)], saved, pass_of(seed, i));
    loss += plain.forward(out, data.targets[size_t(i)], loss_saved).loss;
    plain.backward(out, data.targets[size_t(i)], 1.0f / float(micro), loss_saved);
    whole.backward(out, saved);
  }
  return loss;
}

// After a pipelined step: the tied table's two copies summed between the
// first and last stage, the last stage's loss shared; then the loss equals
// `expected_loss` and each of this stage's parameters the whole model's in
// value (exactly) and gradient (to f32 rounding).
void expect_stage_equals_whole(parallel::Communicator& comm, parallel::Layout& layout, nn::Parameter* tied,
                               const std::vector<nn::Parameter*>& stage, nn::Module& whole, double loss_sum,
                               double expected_loss) {
  const int p = layout.size("pp");
  const std::unique_ptr<parallel::Communicator> ends = comm.split(
      layout.rank("pp") == 0 || layout.rank("pp") == p - 1 ? layout.rank("dp") : 1000 + comm.rank(), comm.rank(), "embedding");
  if (tied) ends->all_reduce(tied->grad, parallel::ReduceOp::sum)->wait();
  Tensor loss = whole.context().from_vector(Shape{1}, std::vector<float>{float(loss_sum)});
  layout.group("pp").broadcast(loss, p - 1)->wait();
  EXPECT_NEAR(loss.to_doubles()[0], expected_loss, 1e-6 * std::abs(expected_loss));
  std::map<std::string, nn::Parameter*> reference;
  for (nn::Parameter* q : whole.parameters()) reference[q->name] = q;
  for (nn::Parameter* q : stage) {
    ASSERT_TRUE(reference.count(q->name)) << q->name;
    EXPECT_TRUE(all_close(q->value, reference[q->name]->value.to_doubles(), Tolerance{0, 0})) << q->name;
    EXPECT_TRUE(all_close(q->grad, reference[q->name]->grad.to_doubles(), Tolerance{1e-5, 1e-7})) << q->name;
  }
}

TEST(PipelineParallel, StagesGiveTheWholeModelsLossAndGradientsForBothSchedules) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  const uint64_t seed = test_seed();
  const int micro = 5;
  const int64_t batch = 3;
  for (const std::string kind : {"gpt", "mlp"})
    for (const int p : {2, 4})
      for (const auto schedule : {parallel::PipelineScheduleKind::gpipe, parallel::PipelineScheduleKind::one_f_one_b}) {
        if (comm->size() % p != 0) continue;
        SCOPED_TRACE(kind + " pp=" + std::to_string(p) + " " + std::string(parallel::pipeline_schedule_name(schedule)));
        parallel::LayoutSizes sizes;
        sizes.pp = p;
        parallel::Layout layout(*comm, sizes);
        const nn::ModelConfig m = model_config(kind);
        const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, seed};
        const MicroBatches data = micro_batches(ctx, m, micro, batch, seed ^ 77);

        // The whole model, one process: every micro-batch, gradients accumulated.
        auto whole = models::build_model(m, spec);
        const double expected_loss = run_whole_model(*whole, data, micro, seed);

        // Four (or two) stages, layers balanced by the partitioner.
        const std::vector<int64_t> bounds =
            parallel::partition_layers(std::vector<int64_t>(size_t(models::pipeline_layers(m)), 1), 0, 0, p);
        Stage stage = build_stage(m, spec, layout, batch, bounds);
        parallel::PipelineOptions options;
        options.schedule = schedule;
        parallel::PipelineEngine engine(*stage.model, layout.group("pp"), *stage.loss, options);
        parallel::PipelineStep step;
        step.micro_batches = micro;
        step.inputs = data.inputs;
        step.targets = data.targets;
        step.input_shape = stage.input_shape;
        step.pass = [&](int i) { return pass_of(seed, i); };
        const parallel::PipelineStepStats stats = engine.run(step);
        EXPECT_EQ(stats.max_in_flight,
                  schedule == parallel::PipelineScheduleKind::gpipe ? micro : std::min(p - layout.rank("pp"), micro));
        // The tied embedding's copies summed, the loss shared: the whole model's loss and gradients.
        expect_stage_equals_whole(*comm, layout, stage.tied, stage.model->parameters(), *whole, stats.loss_sum,
                                  expected_loss);
      }
}

// Interleaved 1F1B (V = 2 chunks per stage, built by models::build_stage_model
// with the model cut into P·V chunks) on P = 2 and 4 stages: the loss and every
// gradient equal the whole model's on one process, and each chunk holds the
// layers of the model's chunk v·P + stage.
TEST(PipelineParallel, InterleavedChunksGiveTheWholeModelsLossAndGradients) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx(one_thread());
  const uint64_t seed = test_seed();
  const int64_t batch = 3;
  const int v = 2;
  for (const int p : {2, 4}) {
    if (comm->size() % p != 0) continue;
    for (const int micro : {p, 2 * p}) {
      SCOPED_TRACE("pp=" + std::to_string(p) + " V=2 M=" + std::to_string(micro));
      parallel::LayoutSizes sizes;
      sizes.pp = p;
      parallel::Layout layout(*comm, sizes);
      nn::ModelConfig m = model_config("gpt");
      m.num_layers = p * v;
      const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, seed};
      const MicroBatches data = micro_batches(ctx, m, micro, batch, seed ^ 91);

      auto whole = models::build_model(m, spec);
      const double expected_loss = run_whole_model(*whole, data, micro, seed);

      models::StageModel stage = models::build_stage_model(m, spec, layout, false, "", v);
      ASSERT_EQ(stage.chunks.size(), size_t(v));
      ASSERT_EQ(stage.bounds.size(), size_t(p * v + 1));
      for (int c = 0; c < v; ++c) {
        // Chunk c holds the blocks of the model's chunk c·P + stage (one block each here).
        const std::string block = "blocks." + std::to_string(c * p + layout.rank("pp")) + ".";
        bool found = false;
        for (nn::Parameter* q : stage.chunks[size_t(c)]->parameters()) found |= q->name.rfind(block, 0) == 0;
        EXPECT_TRUE(found) << "chunk " << c << " should hold " << block;
      }
      parallel::PipelineEngine engine(stage.chunks, layout.group("pp"), *stage.loss);
      parallel::PipelineStep step;
      step.micro_batches = micro;
      step.inputs = data.inputs;
      step.targets = data.targets;
      step.input_shape = stage.input_shape(data.inputs.front());
      step.pass = [&](int i) { return pass_of(seed, i); };
      int last_backwards = 0;
      step.before_backward = [&](int, bool last) { last_backwards += last; };
      const parallel::PipelineStepStats stats = engine.run(step);
      EXPECT_EQ(last_backwards, 1) << "one backward is the stage's last";
      expect_stage_equals_whole(*comm, layout, stage.tied_table, stage.module->parameters(), *whole, stats.loss_sum,
                                expected_loss);

      // Evaluation's forward only, chunk by chunk round the ring: the whole model's logits on the last stage.
      nn::Saved saved;
      const Tensor expected_logits = whole->forward(data.inputs[0], saved, nn::Pass{});
      const Tensor logits = engine.forward_only(data.inputs[0], step.input_shape, DType::f32, nn::Pass{});
      if (layout.rank("pp") == p - 1)
        EXPECT_TRUE(all_close(logits, expected_logits.to_doubles(), Tolerance{1e-5, 1e-6}));
      else
        EXPECT_FALSE(logits.defined());
    }
  }
}

// Peak bytes allocated while a stage runs one step of M = 8 micro-batches.
size_t peak_step_bytes(parallel::Communicator& comm, parallel::PipelineScheduleKind schedule, uint64_t seed) {
  Context ctx(one_thread());
  parallel::LayoutSizes sizes;
  sizes.pp = comm.size();
  parallel::Layout layout(comm, sizes);
  nn::ModelConfig m = model_config("gpt");
  m.dropout = 0.0f;
  m.seq_length = 32;
  m.hidden_size = 32;
  const int micro = 8;
  const int64_t batch = 4;
  const MicroBatches data = micro_batches(ctx, m, micro, batch, seed);
  const std::vector<int64_t> bounds = parallel::partition_layers(std::vector<int64_t>(4, 1), 0, 0, comm.size());
  Stage stage = build_stage(m, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, seed}, layout, batch, bounds);
  parallel::PipelineOptions options;
  options.schedule = schedule;
  parallel::PipelineEngine engine(*stage.model, layout.group("pp"), *stage.loss, options);
  parallel::PipelineStep step;
  step.micro_batches = micro;
  step.inputs = data.inputs;
  step.targets = data.targets;
  step.input_shape = stage.input_shape;
  Allocator& allocator = ctx.allocator(Device::cpu());
  const size_t before = allocator.stats().allocated_bytes;
  allocator.reset_peak_stats();
  engine.run(step);
  return allocator.stats().peak_allocated_bytes - before;
}

TEST(PipelineParallel, OneFOneBPeaksBelowGPipeWhenMicroBatchesOutnumberStages) {
  auto comm = world();
  const size_t gpipe = peak_step_bytes(*comm, parallel::PipelineScheduleKind::gpipe, test_seed());
  const size_t one_f_one_b = peak_step_bytes(*comm, parallel::PipelineScheduleKind::one_f_one_b, test_seed());
  // Every stage: 1F1B keeps at most P - s of the 8 micro-batches, GPipe all 8.
  EXPECT_LT(one_f_one_b, gpipe) << "stage " << comm->rank();
  if (comm->rank() == 0)
    std::printf("pp=%d M=8, stage 0 peak activation bytes: gpipe %zu, 1f1b %zu (%.0f%%)\n", comm->size(), gpipe,
                one_f_one_b, 100.0 * double(one_f_one_b) / double(gpipe));
}

// What the step's loss and evaluation's sums and counts go through
// (parallel::share_last_stage_values): on every grid of dp × pp the world
// makes, only the last stage's values count (the others hold NaN and
// sentinels), and every rank ends with their sum, or mean, over the replicas.
TEST(PipelineParallel, LastStageValuesSharedOverTheGrid) {
  auto comm = world();
  Context ctx(one_thread());
  for (int p = 1; p <= comm->size(); ++p) {
    if (comm->size() % p != 0) continue;
    parallel::LayoutSizes sizes;
    sizes.pp = p;
    parallel::Layout layout(*comm, sizes);
    const bool last = layout.rank("pp") == p - 1;
    const auto loss_of = [](int replica) { return 0.25f + 3.0f * float(replica); };
    const auto count_of = [](int replica) { return int64_t(7 + 1000 * replica); };
    for (const auto op : {parallel::ReduceOp::sum, parallel::ReduceOp::avg}) {
      SCOPED_TRACE(layout.describe() + (op == parallel::ReduceOp::sum ? " sum" : " avg"));
      const float nan = std::numeric_limits<float>::quiet_NaN();
      Tensor loss = ctx.from_vector(Shape{1}, std::vector<float>{last ? loss_of(layout.rank("dp")) : nan});
      Tensor counts = ctx.from_vector(
          Shape{2}, std::vector<int64_t>{last ? count_of(layout.rank("dp")) : -1, last ? int64_t(layout.rank("dp")) : -1});
      const std::vector<Tensor> values =
          op == parallel::ReduceOp::sum ? std::vector<Tensor>{loss, counts} : std::vector<Tensor>{loss};
      parallel::share_last_stage_values(values, layout.group("pp"), layout.group("dp"), op);
      double loss_total = 0.0;
      int64_t count_total = 0, replica_total = 0;
      for (int replica = 0; replica < layout.size("dp"); ++replica) {
        loss_total += loss_of(replica);
        count_total += count_of(replica);
        replica_total += replica;
      }
      const double expected = op == parallel::ReduceOp::sum ? loss_total : loss_total / layout.size("dp");
      EXPECT_NEAR(loss.to_doubles()[0], expected, 1e-6 * expected) << "rank " << comm->rank();
      if (op == parallel::ReduceOp::sum) {
        EXPECT_EQ(counts.to_vector<int64_t>(), (std::vector<int64_t>{count_total, replica_total}))
            << "rank " << comm->rank();
      }
    }
  }
}

TEST(PipelinePartition, BalancesCostsAndReadsExplicitSplits) {
  // Equal blocks, heavy ends: the first and last stage get fewer blocks.
  EXPECT_EQ(parallel::partition_layers(std::vector<int64_t>(12, 10), 25, 25, 4),
            (std::vector<int64_t>{0, 2, 6, 10, 12}));
  EXPECT_EQ(parallel::partition_layers(std::vector<int64_t>(4, 1), 0, 0, 4), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(parallel::partition_layers({5, 1, 1, 1, 1, 1}, 0, 0, 2), (std::vector<int64_t>{0, 1, 6}));
  EXPECT_EQ(parallel::parse_pipeline_split("0,5,9,12", 12, 3), (std::vector<int64_t>{0, 5, 9, 12}));
  const auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& error) {
      return error.what();
    }
    return "(no error)";
  };
  EXPECT_THAT(message([] { parallel::partition_layers(std::vector<int64_t>(3, 1), 0, 0, 4); }),
              ::testing::HasSubstr("--pipeline-parallel 4 needs at least one layer per stage, the model has 3"));
  EXPECT_THAT(message([] { parallel::parse_pipeline_split("0,5,12", 12, 3); }),
              ::testing::HasSubstr("3 stages need 4"));
  EXPECT_THAT(message([] { parallel::parse_pipeline_split("0,5,5,12", 12, 3); }),
              ::testing::HasSubstr("every stage needs at least one layer"));
  EXPECT_THAT(message([] { parallel::parse_pipeline_split("0,5,9,11", 12, 3); }),
              ::testing::HasSubstr("end at the model's 12 layers"));
  EXPECT_THAT(message([] { parallel::parse_pipeline_split("0,x,9,12", 12, 3); }), ::testing::HasSubstr("'x'"));
}

app::TrainConfig synthetic(const std::string& kind, int64_t micro, int64_t global, int pp) {
  app::TrainConfig c;
  c.model = nn::parse_model_kind(kind);
  if (kind == "gpt") {
    c.vocab_size = 24;
    c.seq_length = 6;
    c.num_layers = 4;
    c.num_heads = 2;
    c.hidden_size = 8;
  } else {
    c.hidden = {16, 12, 8};
  }
  c.synthetic = true;
  c.micro_batch_size = micro;
  c.global_batch_size = global;
  c.train_steps = 8;
  c.optimizer = "adamw";
  c.lr = 3e-3f;
  c.warmup_steps = 2;
  c.clip_grad = 0.5f;  // active: the norm sums the stages (the tied copy once)
  c.threads = 1;
  c.log_interval = 1000;
  c.pipeline_parallel = pp;
  return c;
}

// `tessera train` with pp = 2 (dp = world / 2), both schedules, against one
// rank with the whole global batch: the same loss at every step.
TEST(PipelineTrainer, DataTimesPipelineParallelEqualsOneRank) {
  auto comm = world();
  const int dp = comm->size() / 2;
  for (const std::string kind : {"gpt", "mlp"})
    for (const std::string schedule : {"gpipe", "1f1b"}) {
      SCOPED_TRACE(kind + " dp=" + std::to_string(dp) + " pp=2 " + schedule);
      app::TrainConfig parallel_run = synthetic(kind, 2, 2 * dp * 3, 2);  // 3 micro-batches per step
      parallel_run.pipeline_schedule = schedule;
      const app::TrainResult actual = app::train(parallel_run);
      const auto local = parallel::make_local_communicator();
      const app::TrainResult expected = app::train(synthetic(kind, 2 * dp, 2 * dp * 3, 1), *local);
      ASSERT_EQ(actual.losses.size(), expected.losses.size());
      for (size_t s = 0; s < expected.losses.size(); ++s)
        EXPECT_NEAR(actual.losses[s], expected.losses[s], 1e-4 * std::abs(expected.losses[s])) << "step " << s + 1;
      EXPECT_LT(expected.losses.back(), expected.losses.front());
    }
}

// Evaluation streams through the stages too: the MLP with pp = 2 on real
// image files (train and held-out) against one rank: the same losses, and
// the same held-out loss, accuracy and count, which every stage reports.
TEST(PipelineTrainer, EvaluationThroughTheStagesMatchesOneRank) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  int64_t pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("tessera_pp_eval_" + std::to_string(pid));
  std::mt19937_64 rng = make_rng();  // the same on every rank
  if (comm->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir / "train");
    std::filesystem::create_directories(dir / "eval");
    write_image_dataset(dir / "train", 96, 4, 3, 5, rng);
    write_image_dataset(dir / "eval", 37, 4, 3, 5, rng);  // a partial last batch
  }
  comm->barrier();
  const int dp = comm->size() / 2;
  const auto config = [&](int64_t micro, int pp) {
    app::TrainConfig c = synthetic("mlp", micro, 2 * dp * 2, pp);
    c.synthetic = false;
    c.data = (dir / "train" / "images.h5").string();
    c.eval_data = (dir / "eval" / "images.h5").string();
    c.eval_interval = 4;
    return c;
  };
  const app::TrainResult actual = app::train(config(2, 2));
  const auto local = parallel::make_local_communicator();
  const app::TrainResult expected = app::train(config(2 * dp, 1), *local);
  ASSERT_EQ(actual.losses.size(), expected.losses.size());
  for (size_t s = 0; s < expected.losses.size(); ++s)
    EXPECT_NEAR(actual.losses[s], expected.losses[s], 1e-4 * std::abs(expected.losses[s])) << "step " << s + 1;
  ASSERT_TRUE(actual.final_eval && expected.final_eval);
  EXPECT_EQ(actual.final_eval->count, 37);
  EXPECT_EQ(actual.final_eval->count, expected.final_eval->count);
  EXPECT_NEAR(actual.final_eval->loss, expected.final_eval->loss, 1e-4 * expected.final_eval->loss);
  EXPECT_NEAR(*actual.final_eval->accuracy, *expected.final_eval->accuracy, 1e-9);
  comm->barrier();
  if (comm->rank() == 0) std::filesystem::remove_all(dir);
}

TEST(PipelineTrainer, BadLayoutsFailAtStartNamingTheNumbers) {
  auto comm = world();
  const auto message_of = [](const app::TrainConfig& c) -> std::string {
    try {
      app::train(c);
    } catch (const Error& error) {
      return error.what();
    }
    return "(no error)";
  };
  app::TrainConfig too_many = synthetic("gpt", 2, 0, comm->size());
  too_many.num_layers = comm->size() - 1;
  EXPECT_THAT(message_of(too_many), ::testing::HasSubstr("needs at least one layer per stage, the model has " +
                                                         std::to_string(comm->size() - 1)));
  app::TrainConfig split = synthetic("gpt", 2, 0, 2);
  split.pipeline_split = "0,3,2";
  EXPECT_THAT(message_of(split), ::testing::HasSubstr("--pipeline-split '0,3,2'"));
  app::TrainConfig cnn = synthetic("gpt", 2, 0, 2);
  cnn.model = nn::ModelKind::cnn;
  EXPECT_THAT(message_of(cnn), ::testing::HasSubstr("--model cnn trains with --pipeline-parallel 1"));
  app::TrainConfig odd = synthetic("gpt", 2, 0, comm->size() + 1);
  EXPECT_THAT(message_of(odd), ::testing::HasSubstr(std::to_string(comm->size()) + " ranks"));
}

}  // namespace
}  // namespace tessera::testing
