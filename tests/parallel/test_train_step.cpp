// TrainStep (parallel/train_step.h) driven directly, on one process: its
// steps equal the recipe written out by hand (forward and backward of each
// micro-batch, the global norm, clipping, the optimizer) for a GPT with
// dropout and gradient accumulation, bit for bit without clipping and to
// rounding with it; its loss is the micro-batches' mean; an fp16 step with
// non-finite gradients is skipped, the parameters untouched and the scale
// backed off. The layouts (dp, tp, pp, ZeRO-1, fp16) run through the same
// driver in tests/mpi and tests/multiprocess, against one rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/context.h"
#include "nn/grad_scaler.h"
#include "nn/loss.h"
#include "nn/models.h"
#include "models/stage_model.h"
#include "nn/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/local_communicator.h"
#include "parallel/train_step.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

nn::ModelConfig small_gpt() {
  nn::ModelConfig config;
  config.kind = nn::ModelKind::gpt;
  config.vocab_size = 13;
  config.seq_length = 6;
  config.num_layers = 2;
  config.num_heads = 2;
  config.hidden_size = 8;
  config.dropout = 0.1f;
  return config;
}

nn::OptimizerConfig adamw() {
  nn::OptimizerConfig config;
  config.kind = nn::OptimizerKind::adamw;
  config.lr = 1e-2f;
  config.weight_decay = 0.1f;
  return config;
}

// Fresh token micro-batches [B, T] and their targets.
struct Data {
  std::vector<Tensor> inputs, targets;
};
Data random_batches(Context& ctx, const nn::ModelConfig& config, int micro_batches, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> token(0, int32_t(config.vocab_size - 1));
  Data data;
  for (int m = 0; m < micro_batches; ++m) {
    std::vector<int32_t> ids(size_t(3 * config.seq_length)), next(ids.size());
    for (auto& id : ids) id = token(rng);
    for (auto& id : next) id = token(rng);
    data.inputs.push_back(ctx.from_vector(Shape{3, config.seq_length}, ids, Device::cpu()));
    data.targets.push_back(ctx.from_vector(Shape{3, config.seq_length}, next, Device::cpu()));
  }
  return data;
}

std::vector<std::vector<uint8_t>> parameter_bytes(nn::Module& model) {
  std::vector<std::vector<uint8_t>> all;
  for (nn::Parameter* p : model.parameters()) {
    const Tensor host = p->value.to(Device::cpu());
    std::vector<uint8_t> bytes(size_t(host.nbytes()));
    std::memcpy(bytes.data(), host.data_ptr(), bytes.size());
    all.push_back(std::move(bytes));
  }
  return all;
}

// The step as nn/optimizer.h's recipe writes it, on the whole model.
struct ByHand {
  ByHand(const nn::ModelConfig& config, const nn::ModelSpec& spec, double max_norm)
      : model(models::build_model(config, spec)), optimizer(model->parameters(), adamw()), clip(max_norm) {}
  // Returns {the micro-batches' mean loss, the global norm}.
  std::pair<double, double> step(int64_t step, const Data& data, uint64_t seed, double lr) {
    for (nn::Parameter* p : model->parameters()) p->grad.fill_(0.0);
    const int m = int(data.inputs.size());
    double loss_sum = 0.0;
    for (int micro = 0; micro < m; ++micro) {
      nn::Saved saved, loss_saved;
      Tensor logits =
          model->forward(data.inputs[size_t(micro)], saved, nn::Pass{seed, uint64_t(step), uint64_t(micro)});
      loss_sum += loss.forward(logits, data.targets[size_t(micro)], loss_saved).loss;
      loss.backward(logits, data.targets[size_t(micro)], 1.0f / float(m), loss_saved);
      model->backward(logits, saved);
    }
    const nn::GradNorm norm = nn::global_grad_norm(model->parameters());
    optimizer.step(float(lr), nn::clip_coefficient(norm.norm, clip));
    return {double(float(loss_sum)) / double(m), norm.norm};
  }
  std::unique_ptr<nn::Module> model;
  nn::CrossEntropyLoss loss;
  nn::Optimizer optimizer;
  double clip;
};

// The driver on a group of one: the whole model, a one-stage pipeline.
struct Driven {
  Driven(Context& ctx, const nn::ModelConfig& config, const nn::ModelSpec& spec, double max_norm, DType dtype)
      : model(models::build_model(config, spec)),
        dp(parallel::make_local_communicator("dp")),
        pp(parallel::make_local_communicator("pp")),
        replica(model->parameters(), *dp, adamw()),
        scaler(nn::GradScaler::for_dtype(dtype)) {
    parallel::TrainStepParts parts;
    parts.context = &ctx;
    parts.device = Device::cpu();
    parts.model = model.get();
    parts.loss = &loss;
    parts.replica = &replica;
    parts.scaler = &scaler;
    parts.pipeline = pp.get();
    parts.data_parallel = dp.get();
    parts.seed = spec.seed;
    parts.clip_grad = max_norm;
    driver = std::make_unique<parallel::TrainStep>(parts);
  }
  std::unique_ptr<nn::Module> model;
  nn::CrossEntropyLoss loss;
  std::unique_ptr<parallel::Communicator> dp, pp;
  parallel::DataParallel replica;
  nn::GradScaler scaler;
  std::unique_ptr<parallel::TrainStep> driver;
};

TEST(TrainStep, EqualsTheRecipeWrittenOutByHand) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  const nn::ModelConfig config = small_gpt();
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.seed = rng();
  for (const double clip : {0.0, 0.05}) {
    SCOPED_TRACE("clip " + std::to_string(clip));
    ByHand reference(config, spec, clip);
    Driven driven(ctx, config, spec, clip, DType::f32);
    ASSERT_EQ(parameter_bytes(*driven.model), parameter_bytes(*reference.model)) << "the same initial values";
    for (int64_t step = 0; step < 3; ++step) {
      const Data data = random_batches(ctx, config, 3, rng);
      parallel::StepBatches batches;
      batches.inputs = data.inputs;
      batches.targets = data.targets;
      const double lr = 1e-2 * double(step + 1);
      const auto [loss, norm] = reference.step(step, data, spec.seed, lr);
      const parallel::StepResult result = driven.driver->run(step, batches, lr);
      EXPECT_FALSE(result.skipped);
      EXPECT_EQ(result.loss, loss) << "step " << step;
      EXPECT_NEAR(result.grad_norm, norm, 1e-6 * norm) << "step " << step;
      if (clip == 0.0) {
        EXPECT_EQ(parameter_bytes(*driven.model), parameter_bytes(*reference.model)) << "step " << step;
      } else {
        EXPECT_GT(norm, clip) << "the test should clip";
        const auto got = driven.model->parameters();
        const auto want = reference.model->parameters();
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_TRUE(all_close(got[i]->value, want[i]->value, {1e-6, 1e-6})) << got[i]->name << " step " << step;
      }
    }
  }
}

TEST(TrainStep, AnFp16StepWithNonFiniteGradientsIsSkippedAndTheScaleBacksOff) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  nn::ModelConfig config = small_gpt();
  config.dropout = 0.0f;
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.dtype = DType::f16;
  spec.seed = rng();
  Driven driven(ctx, config, spec, 1.0, DType::f16);
  const Data data = random_batches(ctx, config, 2, rng);
  parallel::StepBatches batches;
  batches.inputs = data.inputs;
  batches.targets = data.targets;
  batches.activation_dtype = DType::f16;
  const auto before = parameter_bytes(*driven.model);
  const float scale = driven.scaler.scale();
  const parallel::StepResult poisoned = driven.driver->run(0, batches, 1e-2, /*poison_gradients=*/true);
  EXPECT_TRUE(poisoned.skipped);
  EXPECT_FALSE(poisoned.finite);
  EXPECT_EQ(parameter_bytes(*driven.model), before) << "a skipped step changes nothing";
  EXPECT_LT(driven.scaler.scale(), scale) << "the loss scale backs off";
  const parallel::StepResult next = driven.driver->run(1, batches, 1e-2);
  EXPECT_FALSE(next.skipped);
  EXPECT_TRUE(std::isfinite(next.loss));
  EXPECT_NE(parameter_bytes(*driven.model), before) << "the next step updates";
}

}  // namespace
}  // namespace tessera::testing
