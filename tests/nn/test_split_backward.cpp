// Backward in two halves (nn/module.h): for every layer kind, the input
// gradient of the B step and the parameter gradients after the W step equal a
// one-call backward's bit for bit; the B step adds nothing into a parameter's
// gradient and fires no gradient-ready hook (all of that waits for W, where
// each hook fires once), and a layer's W work really is left for W (the list
// is not empty). Parameters, inputs and output gradients are fresh random
// values; the gradients start from random values too, so the W step's adds
// land on something, as they do from the second micro-batch on.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "core/context.h"
#include "kernels/ops.h"
#include "models/registry.h"
#include "nn/layers.h"
#include "nn/models.h"
#include "parallel/llama_layers.h"
#include "parallel/moe.h"
#include "parallel/tensor_parallel.h"
#include "parallel/transformer_block.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using nn::Module;
using nn::Parameter;

struct Outcome {
  std::vector<float> dx;
  std::vector<std::vector<float>> grads;
};

std::vector<float> values_of(const Tensor& t) {
  if (!t.defined()) return {};
  Tensor wide = t;
  if (t.dtype() != DType::f32) {
    wide = t.context().empty(t.shape(), DType::f32, t.device());
    ops::cast(t, wide);
  }
  return wide.to_vector<float>();
}

class SplitBackward {
 public:
  SplitBackward(Context& ctx, Module& module, std::mt19937_64& rng) : ctx_(ctx), module_(module) {
    for (Parameter* p : module_.parameters()) {
      p->value.copy_(random_tensor(ctx_, p->value.shape(), p->value.dtype(), rng, -0.5, 0.5).tensor);
      start_grads_.push_back(random_tensor(ctx_, p->grad.shape(), DType::f32, rng, -1.0, 1.0).tensor);
      p->on_grad_ready = [this](Parameter& ready) { ++ready_[ready.name]; };
    }
  }

  // One forward, then backward in one call or in two halves.
  Outcome run(const Tensor& input, const Tensor& grad_output, bool halves) {
    reset_grads();
    nn::Saved saved;
    const nn::Pass pass{7, 3, 1};
    module_.forward(input, saved, pass);
    if (!halves) return outcome(module_.backward(grad_output, saved));
    nn::WeightGradients later;
    module_.defer_weight_gradients(&later);
    const Tensor dx = module_.backward(grad_output, saved);
    module_.defer_weight_gradients(nullptr);
    EXPECT_FALSE(later.empty()) << module_.name() << ": the B step left no W work";
    EXPECT_TRUE(ready_.empty()) << module_.name() << ": a gradient-ready hook fired in the B step";
    const std::vector<Parameter*> params = module_.parameters();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_EQ(values_of(params[i]->grad), values_of(start_grads_[i]))
          << params[i]->name << ": the B step changed the gradient";
    later.run();
    EXPECT_TRUE(later.empty());
    return outcome(dx);
  }

  void expect_each_hook_once() const {
    for (Parameter* p : module_.parameters()) {
      const auto found = ready_.find(p->name);
      EXPECT_TRUE(found != ready_.end() && found->second == 1)
          << p->name << ": gradient-ready " << (found == ready_.end() ? 0 : found->second) << " times";
    }
  }

 private:
  void reset_grads() {
    ready_.clear();
    const std::vector<Parameter*> params = module_.parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i]->grad.copy_(start_grads_[i]);
  }
  Outcome outcome(const Tensor& dx) {
    Outcome out;
    out.dx = values_of(dx);
    for (Parameter* p : module_.parameters()) out.grads.push_back(values_of(p->grad));
    return out;
  }

  Context& ctx_;
  Module& module_;
  std::vector<Tensor> start_grads_;
  std::map<std::string, int> ready_;
};

// The two backwards of `module` on `input` agree bit for bit.
void expect_halves_equal_one_call(Context& ctx, Module& module, const Tensor& input, const Shape& output_shape,
                                  std::mt19937_64& rng) {
  SCOPED_TRACE(module.name());
  SplitBackward check(ctx, module, rng);
  const Tensor dy = random_tensor(ctx, output_shape, module.spec().dtype, rng, -1.0, 1.0).tensor;
  const Outcome whole = check.run(input, dy, false);
  check.expect_each_hook_once();
  const Outcome halves = check.run(input, dy, true);
  check.expect_each_hook_once();
  EXPECT_EQ(halves.dx, whole.dx) << "the input gradient differs";
  ASSERT_EQ(halves.grads.size(), whole.grads.size());
  const std::vector<Parameter*> params = module.parameters();
  for (size_t i = 0; i < whole.grads.size(); ++i)
    EXPECT_EQ(halves.grads[i], whole.grads[i]) << params[i]->name << ": the weight gradient differs";
}

nn::ModelSpec spec_of(Context& ctx, DType dtype) {
  return nn::ModelSpec{&ctx, Device::cpu(), dtype, 99};
}

Tensor activations(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng) {
  return random_tensor(ctx, shape, dtype, rng, -1.0, 1.0).tensor;
}

Tensor token_ids(Context& ctx, const Shape& shape, int64_t vocab, std::mt19937_64& rng) {
  std::vector<int32_t> ids(size_t(shape.numel()));
  for (int32_t& id : ids) id = int32_t(rng() % uint64_t(vocab));
  return ctx.from_vector(shape, ids, Device::cpu());
}

class SplitBackwardLayers : public ::testing::TestWithParam<DType> {};

TEST_P(SplitBackwardLayers, EveryLayerKindEqualsTheOneCallBackward) {
  Context ctx;
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const DType dtype = GetParam();
  const nn::ModelSpec spec = spec_of(ctx, dtype);
  const Shape rows{2, 5, 12};
  for (const ops::Activation act : {ops::Activation::none, ops::Activation::relu, ops::Activation::gelu}) {
    nn::Linear linear(spec, "linear", 12, 8, true, act);
    expect_halves_equal_one_call(ctx, linear, activations(ctx, rows, dtype, rng), Shape{2, 5, 8}, rng);
  }
  nn::Linear first(spec, "first_linear", 12, 8, false);
  first.set_input_grad(false);
  expect_halves_equal_one_call(ctx, first, activations(ctx, rows, dtype, rng), Shape{2, 5, 8}, rng);
  nn::LayerNorm layer_norm(spec, "layer_norm", 12);
  expect_halves_equal_one_call(ctx, layer_norm, activations(ctx, rows, dtype, rng), rows, rng);
  nn::RMSNorm rms_norm(spec, "rms_norm", 12);
  expect_halves_equal_one_call(ctx, rms_norm, activations(ctx, rows, dtype, rng), rows, rng);
  nn::Embedding embedding(spec, "embedding", 17, 12);
  expect_halves_equal_one_call(ctx, embedding, token_ids(ctx, Shape{2, 5}, 17, rng), rows, rng);
  nn::PositionEmbedding positions(spec, "positions", 9, 12);
  expect_halves_equal_one_call(ctx, positions, activations(ctx, rows, dtype, rng), rows, rng);
  nn::Conv2d conv(spec, "conv", 2, 3, 3, 1, 1);  // not split: its gradients go to buffers of their own in B
  expect_halves_equal_one_call(ctx, conv, activations(ctx, Shape{2, 2, 5, 5}, dtype, rng), Shape{2, 3, 5, 5}, rng);
  parallel::ColumnParallelLinear column(spec, "column", parallel::TensorParallelism{}, 12, 8, true);
  expect_halves_equal_one_call(ctx, column, activations(ctx, rows, dtype, rng), Shape{2, 5, 8}, rng);
  parallel::RowParallelLinear row(spec, "row", parallel::TensorParallelism{}, 12, 8, true);
  expect_halves_equal_one_call(ctx, row, activations(ctx, rows, dtype, rng), Shape{2, 5, 8}, rng);
  parallel::VocabParallelEmbedding vocab(spec, "vocab", parallel::TensorParallelism{}, 17, 12);
  expect_halves_equal_one_call(ctx, vocab, token_ids(ctx, Shape{2, 5}, 17, rng), rows, rng);
}

TEST_P(SplitBackwardLayers, BlocksAttentionMlpAndExpertsEqualTheOneCallBackward) {
  Context ctx;
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const DType dtype = GetParam();
  const nn::ModelSpec spec = spec_of(ctx, dtype);
  const Shape rows{2, 6, 16};
  for (const bool recompute : {false, true}) {
    parallel::ParallelTransformerBlock gpt_block(spec, recompute ? "gpt_block_recomputed" : "gpt_block",
                                                 parallel::TensorParallelism{}, 16, 2, 32, 0.0f, 0.0f, recompute);
    expect_halves_equal_one_call(ctx, gpt_block, activations(ctx, rows, dtype, rng), rows, rng);
  }
  nn::ModelConfig llama;
  llama.kind = nn::ModelKind::llama;
  llama.hidden_size = 16;
  llama.num_heads = 4;
  llama.num_query_groups = 2;
  llama.ffn_hidden_size = 24;
  llama.seq_length = 6;
  parallel::ParallelTransformerBlock llama_block(spec, "llama_block", parallel::TensorParallelism{}, llama, 0);
  expect_halves_equal_one_call(ctx, llama_block, activations(ctx, rows, dtype, rng), rows, rng);
  parallel::MoeConfig moe;
  moe.num_experts = 4;
  moe.top_k = 2;
  moe.ffn_hidden = 12;
  moe.aux_loss_coeff = 0.01;
  moe.z_loss_coeff = 0.001;
  parallel::MixtureOfExperts experts(spec, "experts", 16, moe, 0.0f);
  expect_halves_equal_one_call(ctx, experts, activations(ctx, rows, dtype, rng), rows, rng);
}

TEST_P(SplitBackwardLayers, WholeModelsEqualTheOneCallBackward) {
  Context ctx;
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const DType dtype = GetParam();
  for (const char* kind : {"gpt", "llama", "llama-moe", "mlp"}) {
    nn::ModelConfig m;
    const std::string name = kind;
    m.kind = nn::parse_model_kind(name == "llama-moe" ? "llama" : name);
    if (name == "mlp") {
      m.hidden = {9, 7};
      m.channels = 1;
      m.height = 4;
      m.width = 4;
      m.num_classes = 5;
    } else {
      m.vocab_size = 19;
      m.seq_length = 6;
      m.num_layers = 2;
      m.num_heads = 2;
      m.hidden_size = 8;
      m.recompute = name == "gpt";
    }
    if (name == "llama-moe") {
      m.num_experts = 4;
      m.moe_ffn_hidden_size = 6;
      m.moe_aux_loss_coeff = 0.01;
    }
    std::unique_ptr<nn::Module> model = models::build_model(m, spec_of(ctx, dtype));
    const Tensor input = name == "mlp" ? activations(ctx, Shape{3, 1, 4, 4}, dtype, rng)
                                       : token_ids(ctx, Shape{2, 6}, m.vocab_size, rng);
    const Shape output = name == "mlp" ? Shape{3, 5} : Shape{2, 6, m.vocab_size};
    expect_halves_equal_one_call(ctx, *model, input, output, rng);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SplitBackwardLayers, ::testing::Values(DType::f32, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& p) { return std::string(dtype_name(p.param)); });

}  // namespace
}  // namespace tessera::testing
