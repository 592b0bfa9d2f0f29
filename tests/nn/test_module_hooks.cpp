// Module::backward calls each parameter's on_grad_ready hook exactly once per
// backward, after the gradient is complete (the data-parallel reducer relies
// on it to start a bucket's all-reduce during the rest of backward).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "core/context.h"
#include "nn/loss.h"
#include "nn/models.h"
#include "models/stage_model.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

TEST(ModuleHooks, EveryParameterIsReportedOnceWithItsFinalGradient) {
  TESSERA_SEED_TRACE();
  Context ctx;
  nn::ModelConfig config;
  config.kind = nn::ModelKind::gpt;
  config.vocab_size = 13;
  config.seq_length = 6;
  config.num_layers = 2;
  config.num_heads = 2;
  config.hidden_size = 8;
  nn::ModelSpec spec;
  spec.context = &ctx;
  auto model = models::build_model(config, spec);
  const auto parameters = model->parameters();
  std::map<std::string, int> calls;
  std::map<std::string, std::vector<double>> at_hook;
  std::vector<std::string> order;
  for (nn::Parameter* p : parameters)
    p->on_grad_ready = [&](nn::Parameter& ready) {
      ++calls[ready.name];
      at_hook[ready.name] = ready.grad.to_doubles();
      order.push_back(ready.name);
    };
  auto rng = make_rng();
  auto ids = random_indices(ctx, Shape{2, 6}, DType::i32, rng, 0, 13);
  auto targets = random_indices(ctx, Shape{2, 6}, DType::i32, rng, 0, 13);
  nn::Saved saved, loss_saved;
  Tensor logits = model->forward(ids.tensor, saved, nn::Pass{});
  const nn::CrossEntropyLoss loss;
  loss.forward(logits, targets.tensor, loss_saved);
  loss.backward(logits, targets.tensor, 1.0f, loss_saved);
  model->backward(logits, saved);
  for (nn::Parameter* p : parameters) {
    EXPECT_EQ(calls[p->name], 1) << p->name;
    EXPECT_EQ(at_hook[p->name], p->grad.to_doubles()) << p->name << " changed after its hook";
  }
  // Backward runs back to front: the last block's parameters are ready before the first block's.
  const auto position = [&](const std::string& name) {
    return std::find(order.begin(), order.end(), name) - order.begin();
  };
  EXPECT_LT(position("blocks.1.mlp.proj.weight"), position("blocks.0.mlp.proj.weight"));
  EXPECT_EQ(order.back(), "wte.weight");  // tied: complete only after both of its uses
}

}  // namespace
}  // namespace tessera::testing
