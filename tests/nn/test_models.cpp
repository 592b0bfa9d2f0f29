// Models, loss and initialisation of nn: the GPT's loss and EVERY
// parameter gradient against a naive double GPT (tests/support/reference_nn),
// the MLP and CNN against composed double references; recomputation gives
// bit-identical gradients and lowers peak activation memory; initial values
// are a function of (seed, name, element) only; ModelConfig messages name the
// flag; a bf16 model trains a step without NaN; cross-entropy loss (and the
// backward it shares with the vocabulary-parallel loss, over shards) and
// accuracy counting.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <future>
#include <random>
#include <thread>
#include <map>

#include "core/context.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "nn/loss.h"
#include "nn/models.h"
#include "models/stage_model.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/error_text.h"
#include "tests/support/gradcheck.h"
#include "tests/support/reference_nn.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace ref = reference;
using nn::Module;
using nn::Parameter;
using nn::Saved;

// A whole model in f32 against a double reference: roundings along a deeper
// path than one layer (see test_layers.cpp); 1e-4 relative still fails any
// wrong term.
constexpr Tolerance kModelForward{1e-4, 1e-5};
constexpr Tolerance kModelBackward{1e-4, 1e-6};

// A loss is lse − logit[target] in f32: its absolute error is a few ulp of
// the logits (≲ 1e-6 for |logits| ≲ 10), which dominates when the loss is small.
void expect_loss_near(double actual, double expected) {
  EXPECT_NEAR(actual, expected, 1e-6 + 1e-5 * std::abs(expected));
}

nn::ModelSpec spec_for(Context& ctx, DType dtype, uint64_t seed) {
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.dtype = dtype;
  spec.seed = seed;
  return spec;
}

nn::ModelConfig tiny_gpt() {
  nn::ModelConfig config;
  config.kind = nn::ModelKind::gpt;
  config.vocab_size = 11;
  config.seq_length = 7;
  config.num_layers = 2;
  config.num_heads = 2;
  config.hidden_size = 8;
  return config;
}

// Fresh uniform values for every parameter; returns {names, values} in parameters() order.
std::pair<std::vector<std::string>, Inputs> randomize(Context& ctx, Module& m, std::mt19937_64& rng,
                                                      double bound = 0.5) {
  std::vector<std::string> names;
  Inputs values;
  for (Parameter* p : m.parameters()) {
    auto r = random_tensor(ctx, p->value.shape(), p->value.dtype(), rng, -bound, bound);
    p->value.copy_(r.tensor);
    names.push_back(p->name);
    values.push_back(r.values);
  }
  return {names, values};
}

ref::Params as_params(const std::vector<std::string>& names, const Inputs& values) {
  ref::Params p;
  for (size_t k = 0; k < names.size(); ++k) p[names[k]] = values[k];
  return p;
}

ref::Ids as_ids(const std::vector<double>& values) {
  return ref::Ids(values.begin(), values.end());
}

bool all_finite(const Tensor& t) {
  for (const double v : t.to_doubles())
    if (!std::isfinite(v)) return false;
  return true;
}

// Central difference of a scalar function of `inputs` at element i of
// inputs[wrt], or NaN when the one-sided differences disagree by more than
// `kink`: the step then straddles a kink (a ReLU input crossing zero, a
// max-pool winner changing) where the derivative is not defined, and the
// central difference can be off by up to half that disagreement. On smooth
// stretches they differ by h·f'' ≈ 1e-7·f''. (h = 1e-7: the loss is O(1), so
// double rounding adds only ~1e-9.)
double numeric_derivative(const std::function<double(const Inputs&)>& f, Inputs& inputs, size_t wrt, size_t i,
                          double kink) {
  double& x = inputs[wrt][i];
  const double saved = x, h = 1e-7 * std::max(1.0, std::abs(saved));
  const double center = f(inputs);
  x = saved + h;
  const double plus = f(inputs);
  x = saved - h;
  const double minus = f(inputs);
  x = saved;
  const double forward = (plus - center) / h, backward = (center - minus) / h;
  if (std::abs(forward - backward) > kink) return std::nan("");
  return (plus - minus) / (2 * h);
}

struct StepResult {
  nn::LossValue loss;
  Tensor logits;  // the forward's logits (before the in-place backward)
};

// Forward, loss, loss backward (in place) and model backward.
StepResult train_step(Module& model, const Tensor& input, const Tensor& targets, const nn::Pass& pass,
                      float scale = 1.0f) {
  Saved saved, loss_saved;
  Tensor logits = model.forward(input, saved, pass);
  StepResult result{{}, logits.clone()};
  const nn::CrossEntropyLoss loss;
  result.loss = loss.forward(logits, targets, loss_saved);
  loss.backward(logits, targets, scale, loss_saved);
  model.backward(logits, saved);
  return result;
}

// ---------------------------------------------------------------------------
// GPT against the double reference GPT
// ---------------------------------------------------------------------------
TEST(Gpt, MatchesReferenceLossAndEveryGradient) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const nn::ModelConfig config = tiny_gpt();
  const int64_t batch = 2, tokens = 7;
  auto model = models::build_model(config, spec_for(ctx, DType::f32, rng()));
  const auto randomized = randomize(ctx, *model, rng);
  const std::vector<std::string>& names = randomized.first;
  const Inputs& values = randomized.second;
  auto ids = random_indices(ctx, Shape{batch, tokens}, DType::i32, rng, 0, config.vocab_size);
  auto targets = random_indices(ctx, Shape{batch, tokens}, DType::i64, rng, 0, config.vocab_size);
  targets.values[3] = targets.values[9] = -100;  // ignored positions
  targets.tensor = ctx.from_doubles(targets.tensor.shape(), DType::i64, targets.values);

  const ref::GptShape shape{config.vocab_size, config.seq_length,  config.num_layers,
                            config.num_heads,  config.hidden_size, config.ffn()};
  const ref::Ids id_values = as_ids(ids.values), target_values = as_ids(targets.values);
  nn::zero_grads(model->parameters());
  const StepResult step = train_step(*model, ids.tensor, targets.tensor, nn::Pass{});
  EXPECT_EQ(step.logits.shape(), (Shape{batch, tokens, config.vocab_size}));
  EXPECT_TRUE(all_close(step.logits, ref::gpt_logits(shape, as_params(names, values), id_values, batch, tokens),
                        kModelForward));
  const double expected_loss = ref::gpt_loss(shape, as_params(names, values), id_values, target_values, batch, tokens);
  expect_loss_near(step.loss.loss, expected_loss);
  EXPECT_EQ(step.loss.count, batch * tokens - 2);

  const ReferenceFunction loss_of = [&](const Inputs& in) {
    return std::vector<double>{ref::gpt_loss(shape, as_params(names, in), id_values, target_values, batch, tokens)};
  };
  const auto params = model->parameters();
  ASSERT_EQ(params.size(), names.size());
  for (size_t k = 0; k < params.size(); ++k)
    EXPECT_TRUE(all_close(params[k]->grad, numeric_gradient(loss_of, values, k, {1.0}), kModelBackward))
        << params[k]->name;
}

// ---------------------------------------------------------------------------
// Llama against the double reference written as Hugging Face computes it
// ---------------------------------------------------------------------------
// 4 query heads of width 4 in 2 key/value groups, SwiGLU 12 wide, untied.
nn::ModelConfig tiny_llama(int64_t groups, bool untied) {
  nn::ModelConfig config;
  config.kind = nn::ModelKind::llama;
  config.vocab_size = 11;
  config.seq_length = 9;
  config.num_layers = 2;
  config.num_heads = 4;
  config.num_query_groups = groups;
  config.hidden_size = 16;
  config.ffn_hidden_size = 12;
  config.rotary_base = 500000.0f;
  config.norm_epsilon = 1e-6f;
  config.untie_embeddings = untied;
  return config;
}

// The reference's description of a decoder with `config`'s choices.
ref::LlamaShape reference_shape(const nn::ModelConfig& config) {
  const nn::DecoderChoices d = config.decoder();
  ref::LlamaShape shape{config.vocab_size, config.num_layers, config.num_heads, config.query_groups(),
                        config.hidden_size, config.ffn(), config.rotary_base, config.norm_epsilon,
                        !d.untie_embeddings};
  shape.layer_norm = d.normalization == nn::Normalization::layer_norm;
  shape.learned_positions = !d.rotary;
  shape.gelu = !d.swiglu;
  shape.bias = d.bias;
  shape.gpt2_qkv = !config.grouped_attention();
  return shape;
}

void expect_llama_matches_reference(const nn::ModelConfig& config) {
  Context ctx;
  auto rng = make_rng();
  const int64_t batch = 2, tokens = 9;
  auto model = models::build_model(config, spec_for(ctx, DType::f32, rng()));
  const auto randomized = randomize(ctx, *model, rng);
  const std::vector<std::string>& names = randomized.first;
  const Inputs& values = randomized.second;
  auto ids = random_indices(ctx, Shape{batch, tokens}, DType::i32, rng, 0, config.vocab_size);
  auto targets = random_indices(ctx, Shape{batch, tokens}, DType::i64, rng, 0, config.vocab_size);
  targets.values[2] = -100;  // an ignored position
  targets.tensor = ctx.from_doubles(targets.tensor.shape(), DType::i64, targets.values);
  const ref::LlamaShape shape = reference_shape(config);
  const ref::Ids id_values = as_ids(ids.values), target_values = as_ids(targets.values);
  nn::zero_grads(model->parameters());
  const StepResult step = train_step(*model, ids.tensor, targets.tensor, nn::Pass{});
  EXPECT_TRUE(all_close(step.logits, ref::llama_logits(shape, as_params(names, values), id_values, batch, tokens),
                        kModelForward));
  expect_loss_near(step.loss.loss,
                   ref::llama_loss(shape, as_params(names, values), id_values, target_values, batch, tokens));
  const ReferenceFunction loss_of = [&](const Inputs& in) {
    return std::vector<double>{ref::llama_loss(shape, as_params(names, in), id_values, target_values, batch, tokens)};
  };
  const auto params = model->parameters();
  ASSERT_EQ(params.size(), names.size());
  for (size_t k = 0; k < params.size(); ++k)
    EXPECT_TRUE(all_close(params[k]->grad, numeric_gradient(loss_of, values, k, {1.0}), kModelBackward))
        << params[k]->name;
}

TEST(Llama, GroupedQueryAttentionMatchesReferenceLossAndEveryGradient) {
  TESSERA_SEED_TRACE();
  expect_llama_matches_reference(tiny_llama(2, true));
}

TEST(Llama, MultiQueryAndMultiHeadTiedMatchReference) {
  TESSERA_SEED_TRACE();
  expect_llama_matches_reference(tiny_llama(1, true));
  expect_llama_matches_reference(tiny_llama(4, false));
}

// Megatron's switches each work on their own: the GPT with one of the
// Llama's choices, the Llama with one of GPT-2's, each against the reference
// in logits, loss and every parameter's gradient.
TEST(DecoderSwitches, EachWorksOnItsOwnInTheGptAndTheLlama) {
  TESSERA_SEED_TRACE();
  const auto gpt_with = [](const std::function<void(nn::ModelConfig&)>& change) {
    nn::ModelConfig config = tiny_llama(4, false);
    config.kind = nn::ModelKind::gpt;
    config.num_query_groups = 0;
    change(config);
    return config;
  };
  const std::vector<std::pair<std::string, nn::ModelConfig>> cases = {
      {"gpt --normalization RMSNorm", gpt_with([](auto& m) { m.normalization = nn::Normalization::rms_norm; })},
      {"gpt --position-embedding-type rope", gpt_with([](auto& m) { m.rotary = true; })},
      {"gpt --swiglu", gpt_with([](auto& m) { m.swiglu = true; })},
      {"gpt --disable-bias-linear", gpt_with([](auto& m) { m.bias = false; })},
      {"gpt --untie-embeddings-and-output-weights", gpt_with([](auto& m) { m.untie_embeddings = true; })},
      {"gpt --group-query-attention --num-query-groups 2", gpt_with([](auto& m) { m.num_query_groups = 2; })},
      {"gpt with every Llama switch", gpt_with([](auto& m) {
         m.normalization = nn::Normalization::rms_norm;
         m.rotary = m.swiglu = m.untie_embeddings = true;
         m.bias = false;
         m.num_query_groups = 2;
       })},
      {"llama --normalization LayerNorm",
       [] {
         nn::ModelConfig m = tiny_llama(2, true);
         m.normalization = nn::Normalization::layer_norm;
         return m;
       }()},
      {"llama --position-embedding-type learned_absolute", [] {
         nn::ModelConfig m = tiny_llama(2, true);
         m.rotary = false;
         return m;
       }()}};
  for (const auto& [what, config] : cases) {
    SCOPED_TRACE(what);
    expect_llama_matches_reference(config);
  }
}

TEST(Llama, ParametersAreTheDocumentedNamesAndShapes) {
  Context ctx;
  const nn::ModelConfig config = tiny_llama(2, true);
  auto model = models::build_model(config, spec_for(ctx, DType::f32, 3));
  std::map<std::string, Shape> shapes;
  for (const Parameter* p : model->parameters()) shapes[p->name] = p->shard.global_shape;
  const int64_t c = 16, dh = 4, f = 12;
  EXPECT_EQ(shapes.at("wte.weight"), (Shape{11, c}));
  EXPECT_EQ(shapes.at("blocks.1.attn.qkv.weight"), (Shape{2 * (2 + 2) * dh, c}));
  EXPECT_EQ(shapes.at("blocks.1.attn.proj.weight"), (Shape{c, 4 * dh}));
  EXPECT_EQ(shapes.at("blocks.0.mlp.fc.weight"), (Shape{2 * f, c}));
  EXPECT_EQ(shapes.at("blocks.0.mlp.proj.weight"), (Shape{c, f}));
  EXPECT_EQ(shapes.at("blocks.0.ln1.weight"), (Shape{c}));
  EXPECT_EQ(shapes.at("ln_f.weight"), (Shape{c}));
  EXPECT_EQ(shapes.at("lm_head.weight"), (Shape{11, c}));
  EXPECT_EQ(shapes.size(), size_t(1 + 2 * 6 + 2));  // no biases anywhere
}

// Micro-batches accumulate: two halves at scale 1/2 give the mean of their gradients.
TEST(Gpt, MicroBatchGradientsAccumulate) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const nn::ModelConfig config = tiny_gpt();
  auto model = models::build_model(config, spec_for(ctx, DType::f32, rng()));
  randomize(ctx, *model, rng);
  RandomTensor ids[2], targets[2];
  for (int i = 0; i < 2; ++i) {
    ids[i] = random_indices(ctx, Shape{2, 6}, DType::i64, rng, 0, config.vocab_size);
    targets[i] = random_indices(ctx, Shape{2, 6}, DType::i32, rng, 0, config.vocab_size);
  }
  std::vector<std::vector<double>> alone[2];
  for (int i = 0; i < 2; ++i) {
    nn::zero_grads(model->parameters());
    train_step(*model, ids[i].tensor, targets[i].tensor, nn::Pass{1, 0, uint64_t(i)});
    for (Parameter* p : model->parameters()) alone[i].push_back(p->grad.to_doubles());
  }
  nn::zero_grads(model->parameters());
  for (int i = 0; i < 2; ++i) train_step(*model, ids[i].tensor, targets[i].tensor, nn::Pass{1, 0, uint64_t(i)}, 0.5f);
  const auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<double> mean(alone[0][k].size());
    for (size_t j = 0; j < mean.size(); ++j) mean[j] = 0.5 * (alone[0][k][j] + alone[1][k][j]);
    EXPECT_TRUE(all_close(params[k]->grad, mean, {1e-5, 1e-7})) << params[k]->name;
  }
}

// ---------------------------------------------------------------------------
// Recomputation
// ---------------------------------------------------------------------------
TEST(GptRecompute, BitIdenticalGradients) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::ModelConfig config = tiny_gpt();
  config.dropout = 0.1f;  // recomputation must re-draw the same masks
  const nn::ModelSpec spec = spec_for(ctx, DType::f32, rng());
  auto plain = models::build_model(config, spec);
  config.recompute = true;
  auto recomputed = models::build_model(config, spec);  // same seed: the same initial values
  auto ids = random_indices(ctx, Shape{3, 7}, DType::i32, rng, 0, config.vocab_size);
  auto targets = random_indices(ctx, Shape{3, 7}, DType::i32, rng, 0, config.vocab_size);
  const nn::Pass pass{rng(), 5, 1};
  const StepResult a = train_step(*plain, ids.tensor, targets.tensor, pass);
  const StepResult b = train_step(*recomputed, ids.tensor, targets.tensor, pass);
  EXPECT_EQ(a.logits.to_vector<float>(), b.logits.to_vector<float>());
  EXPECT_EQ(a.loss.loss, b.loss.loss);
  const auto pa = plain->parameters(), pb = recomputed->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t k = 0; k < pa.size(); ++k) {
    EXPECT_EQ(pa[k]->value.to_vector<float>(), pb[k]->value.to_vector<float>()) << pa[k]->name;
    EXPECT_EQ(pa[k]->grad.to_vector<float>(), pb[k]->grad.to_vector<float>()) << pa[k]->name;
  }
}

// Dropout on the attention probabilities (--attention-dropout) of the GPT and
// the Llama: recomputation re-draws the same masks (bit-identical logits,
// loss and gradients); the dropout is on (the gradients differ from the model
// without it); another step draws other masks; evaluation has none (the
// logits of the model without it, exactly).
TEST(AttentionDropout, RecomputedBitIdenticallyOnInTrainingOffInEvaluation) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (nn::ModelConfig config : {tiny_gpt(), tiny_llama(2, true)}) {
    SCOPED_TRACE(std::string(nn::model_name(config.kind)));
    const nn::ModelSpec spec = spec_for(ctx, DType::f32, rng());
    nn::ModelConfig without = config;
    config.attention_dropout = 0.2f;
    auto plain = models::build_model(config, spec);
    config.recompute = true;
    auto recomputed = models::build_model(config, spec);  // same seed: the same initial values
    auto off = models::build_model(without, spec);
    auto ids = random_indices(ctx, Shape{3, 7}, DType::i32, rng, 0, config.vocab_size);
    auto targets = random_indices(ctx, Shape{3, 7}, DType::i32, rng, 0, config.vocab_size);
    const nn::Pass pass{rng(), 5, 1};
    const StepResult a = train_step(*plain, ids.tensor, targets.tensor, pass);
    const StepResult b = train_step(*recomputed, ids.tensor, targets.tensor, pass);
    const StepResult c = train_step(*off, ids.tensor, targets.tensor, pass);
    EXPECT_EQ(a.logits.to_vector<float>(), b.logits.to_vector<float>());
    EXPECT_EQ(a.loss.loss, b.loss.loss);
    EXPECT_NE(a.logits.to_vector<float>(), c.logits.to_vector<float>()) << "attention dropout is off";
    const auto pa = plain->parameters(), pb = recomputed->parameters(), pc = off->parameters();
    ASSERT_EQ(pa.size(), pb.size());
    bool gradients_differ = false;
    for (size_t k = 0; k < pa.size(); ++k) {
      EXPECT_EQ(pa[k]->grad.to_vector<float>(), pb[k]->grad.to_vector<float>()) << pa[k]->name;
      gradients_differ = gradients_differ || pa[k]->grad.to_vector<float>() != pc[k]->grad.to_vector<float>();
    }
    EXPECT_TRUE(gradients_differ);

    Saved again, next;
    EXPECT_EQ(plain->forward(ids.tensor, again, pass).to_vector<float>(), a.logits.to_vector<float>());
    EXPECT_NE(plain->forward(ids.tensor, next, nn::Pass{pass.seed, 6, 1}).to_vector<float>(),
              a.logits.to_vector<float>())
        << "step 6 drew the masks of step 5";

    plain->eval();
    off->eval();
    Saved on_saved, off_saved;
    EXPECT_EQ(plain->forward(ids.tensor, on_saved, pass).to_vector<float>(),
              off->forward(ids.tensor, off_saved, pass).to_vector<float>())
        << "evaluation dropped attention probabilities";
  }
}

// Peak bytes allocated during one forward + loss + backward, above what was
// allocated before (parameters, gradients, the batch).
size_t peak_activation_bytes(bool recompute, int64_t& parameter_bytes) {
  Context ctx;
  nn::ModelConfig config;
  config.kind = nn::ModelKind::gpt;
  config.vocab_size = 64;
  config.seq_length = 64;
  config.num_layers = 4;
  config.num_heads = 4;
  config.hidden_size = 64;
  config.dropout = 0.1f;
  config.recompute = recompute;
  auto model = models::build_model(config, spec_for(ctx, DType::f32, 7));
  std::mt19937_64 rng(11);
  auto ids = random_indices(ctx, Shape{4, 64}, DType::i32, rng, 0, config.vocab_size);
  auto targets = random_indices(ctx, Shape{4, 64}, DType::i32, rng, 0, config.vocab_size);
  parameter_bytes = nn::parameter_count(*model) * 8;  // value + grad, f32
  Allocator& allocator = ctx.allocator(Device::cpu());
  const size_t before = allocator.stats().allocated_bytes;
  allocator.reset_peak_stats();
  train_step(*model, ids.tensor, targets.tensor, nn::Pass{3, 1, 0});
  return allocator.stats().peak_allocated_bytes - before;
}

TEST(GptRecompute, LowersPeakActivationMemoryByAtLeast40Percent) {
  int64_t parameter_bytes = 0;
  const size_t off = peak_activation_bytes(false, parameter_bytes);
  const size_t on = peak_activation_bytes(true, parameter_bytes);
  const double reduction = 1.0 - double(on) / double(off);
  std::printf(
      "GPT B=4 T=64 C=64 L=4: peak activation bytes recompute off=%zu on=%zu (%.1f%% lower); parameters+grads=%lld\n",
      off, on, 100.0 * reduction, static_cast<long long>(parameter_bytes));
  RecordProperty("peak_activation_bytes_off", std::to_string(off));
  RecordProperty("peak_activation_bytes_on", std::to_string(on));
  EXPECT_GE(reduction, 0.40) << "off " << off << " bytes, on " << on << " bytes";
}

// ---------------------------------------------------------------------------
// MLP and CNN against composed references
// ---------------------------------------------------------------------------
TEST(Mlp, MatchesReferenceLossAndEveryGradient) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::ModelConfig config;
  config.kind = nn::ModelKind::mlp;
  config.channels = 1;
  config.height = 4;
  config.width = 5;
  config.num_classes = 4;
  config.hidden = {6, 5};
  auto model = models::build_model(config, spec_for(ctx, DType::f32, rng()));
  const auto randomized = randomize(ctx, *model, rng, 1.0);
  const std::vector<std::string>& names = randomized.first;
  const Inputs& values = randomized.second;
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
                                             "layers.2.weight", "layers.2.bias"}));
  const int64_t n = 3;
  auto x = random_tensor(ctx, Shape{n, 1, 4, 5}, DType::f32, rng);
  auto targets = random_indices(ctx, Shape{n}, DType::i64, rng, 0, 4);
  const auto logits_of = [&](const Inputs& p) {
    ref::Vec h = ref::relu(ref::linear(x.values, p[0], p[1], n, 20, 6));
    h = ref::relu(ref::linear(h, p[2], p[3], n, 6, 5));
    return ref::linear(h, p[4], p[5], n, 5, 4);
  };
  nn::zero_grads(model->parameters());
  const StepResult step = train_step(*model, x.tensor, targets.tensor, nn::Pass{});
  EXPECT_TRUE(all_close(step.logits, logits_of(values), forward_tolerance(DType::f32)));
  const ReferenceFunction loss_of = [&](const Inputs& p) {
    return std::vector<double>{ref::cross_entropy(logits_of(p), as_ids(targets.values), 4)};
  };
  expect_loss_near(step.loss.loss, loss_of(values)[0]);
  const auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k)
    EXPECT_TRUE(all_close(params[k]->grad, numeric_gradient(loss_of, values, k, {1.0}), kModelBackward))
        << params[k]->name;
}

TEST(Cnn, MatchesReferenceLossAndSampledGradients) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::ModelConfig config;
  config.kind = nn::ModelKind::cnn;
  config.channels = 2;
  config.height = 8;
  config.width = 9;  // pools floor 9 → 4 → 2
  config.num_classes = 3;
  auto model = models::build_model(config, spec_for(ctx, DType::f32, rng()));
  // The model's own (PyTorch-style, uniform ±1/√fan_in) initial values, from a
  // fresh seed: they keep the logits of order one. Larger weights make the
  // logits large and the predictions confident, and then 1 − p, computed in
  // f32 next to logits of magnitude 30, loses its leading digits.
  std::vector<std::string> names;
  Inputs values;
  for (Parameter* p : model->parameters()) {
    names.push_back(p->name);
    values.push_back(p->value.to_doubles());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight",
                                             "fc1.bias", "fc2.weight", "fc2.bias"}));
  const int64_t n = 2;
  auto x = random_tensor(ctx, Shape{n, 2, 8, 9}, DType::f32, rng);
  auto targets = random_indices(ctx, Shape{n}, DType::i32, rng, 0, 3);
  const auto logits_of = [&](const Inputs& p) {
    ref::Vec h = ref::relu(ref::conv2d(x.values, p[0], p[1], n, 2, 8, 9, 32, 5, 1, 2));
    h = ref::maxpool2d(h, n, 32, 8, 9, 2, 2, 0);  // → 4×4
    h = ref::relu(ref::conv2d(h, p[2], p[3], n, 32, 4, 4, 64, 5, 1, 2));
    h = ref::maxpool2d(h, n, 64, 4, 4, 2, 2, 0);  // → 2×2, flattened as [n, 256]
    h = ref::relu(ref::linear(h, p[4], p[5], n, 256, 1024));
    return ref::linear(h, p[6], p[7], n, 1024, 3);
  };
  nn::zero_grads(model->parameters());
  const StepResult step = train_step(*model, x.tensor, targets.tensor, nn::Pass{});
  EXPECT_TRUE(all_close(step.logits, logits_of(values), kModelForward));
  const std::function<double(const Inputs&)> loss_of = [&](const Inputs& p) {
    return ref::cross_entropy(logits_of(p), as_ids(targets.values), 3);
  };
  expect_loss_near(step.loss.loss, loss_of(values));
  // Every parameter has too many elements for a full central-difference sweep
  // of this reference: check ten random elements of each (away from kinks: a
  // conv1 bias moves 2048 ReLU inputs of fc1 at once).
  Inputs perturbed = values;
  const auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    const std::vector<double> grad = params[k]->grad.to_doubles();
    std::uniform_int_distribution<size_t> pick(0, grad.size() - 1);
    int checked = 0;
    for (int tries = 0; checked < 10 && tries < 40; ++tries) {
      const size_t i = pick(rng);
      const double tolerance = kModelBackward.abs + kModelBackward.rel * std::abs(grad[i]);
      const double expected = numeric_derivative(loss_of, perturbed, k, i, tolerance);
      if (std::isnan(expected)) continue;  // at a kink: draw another element
      ++checked;
      EXPECT_NEAR(grad[i], expected, tolerance) << params[k]->name << "[" << i << "]";
    }
    EXPECT_EQ(checked, 10) << params[k]->name << ": too many samples at kinks";
  }
}

// ---------------------------------------------------------------------------
// Initialisation
// ---------------------------------------------------------------------------
TEST(NameStream, IsFnv1a64) {
  // The published FNV-1a 64-bit test vectors.
  EXPECT_EQ(nn::name_stream(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(nn::name_stream("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(nn::name_stream("foobar"), 0x85944171f73967e8ull);
}

// Element i of a parameter is mean + std·N(seed, name_stream(name), i), as
// core/rng.h computes it: GPT-2's rules per parameter.
TEST(Init, GptValuesAreTheDocumentedFunctionOfSeedNameAndIndex) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const uint64_t seed = rng();
  nn::ModelConfig config = tiny_gpt();
  config.num_layers = 3;
  auto model = models::build_model(config, spec_for(ctx, DType::f32, seed));
  const float residual_std = 0.02f / std::sqrt(6.0f);
  for (Parameter* p : model->parameters()) {
    const std::string& name = p->name;
    const bool bias = name.ends_with(".bias");
    const bool norm = name.starts_with("ln_f") || name.find(".ln") != std::string::npos;
    std::vector<double> expected(size_t(p->value.numel()));
    for (size_t i = 0; i < expected.size(); ++i) {
      if (bias) {
        expected[i] = 0.0;
      } else if (norm) {
        expected[i] = 1.0;
      } else {
        const bool residual = name.ends_with("attn.proj.weight") || name.ends_with("mlp.proj.weight");
        expected[i] = double(0.0f + (residual ? residual_std : 0.02f) * philox_normal(seed, nn::name_stream(name), i));
      }
    }
    EXPECT_TRUE(all_close(p->value, expected, {0, 0})) << name;
    EXPECT_EQ(p->weight_decay, !bias && !norm) << name;
  }
}

TEST(Init, DependsOnNameNotOnLayoutOrCreationOrder) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const uint64_t seed = rng();
  nn::ModelConfig small = tiny_gpt(), large = tiny_gpt();
  large.num_layers = 4;
  large.seq_length = 9;  // a longer wpe: its first rows are the same
  auto a = models::build_model(small, spec_for(ctx, DType::f32, seed));
  auto b = models::build_model(large, spec_for(ctx, DType::f32, seed));
  std::map<std::string, Parameter*> by_name;
  for (Parameter* p : b->parameters()) by_name[p->name] = p;
  for (Parameter* p : a->parameters()) {
    ASSERT_TRUE(by_name.count(p->name)) << p->name;
    const std::vector<float> mine = p->value.to_vector<float>();
    std::vector<float> theirs = by_name[p->name]->value.to_vector<float>();
    theirs.resize(mine.size());                              // wpe: the prefix
    const bool residual = p->name.ends_with("proj.weight");  // its std depends on the depth
    if (!residual) {
      EXPECT_EQ(mine, theirs) << p->name;
    }
  }
  // The MLP's first layer does not depend on the layers after it.
  nn::ModelConfig m1, m2;
  m1.hidden = {16, 8};
  m2.hidden = {16, 32, 4};
  auto x = models::build_model(m1, spec_for(ctx, DType::f32, seed));
  auto y = models::build_model(m2, spec_for(ctx, DType::f32, seed));
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(x->parameters()[k]->name, y->parameters()[k]->name);
    EXPECT_EQ(x->parameters()[k]->value.to_vector<float>(), y->parameters()[k]->value.to_vector<float>());
  }
  // Another seed, other values.
  auto c = models::build_model(small, spec_for(ctx, DType::f32, seed + 1));
  EXPECT_NE(a->parameters()[0]->value.to_vector<float>(), c->parameters()[0]->value.to_vector<float>());
}

TEST(Init, Bf16ValuesAreTheF32ValuesRounded) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const uint64_t seed = rng();
  auto f32 = models::build_model(tiny_gpt(), spec_for(ctx, DType::f32, seed));
  auto bf16 = models::build_model(tiny_gpt(), spec_for(ctx, DType::bf16, seed));
  const auto pf = f32->parameters(), pb = bf16->parameters();
  for (size_t k = 0; k < pf.size(); ++k) {
    EXPECT_EQ(pb[k]->value.dtype(), DType::bf16);
    EXPECT_EQ(pb[k]->grad.dtype(), DType::f32);
    EXPECT_TRUE(all_close(pb[k]->value, round_to(DType::bf16, pf[k]->value.to_doubles()), {0, 0})) << pf[k]->name;
  }
}

TEST(Gpt, ParameterNamesAndCount) {
  Context ctx;
  nn::ModelConfig config = tiny_gpt();
  config.num_layers = 1;
  auto model = models::build_model(config, spec_for(ctx, DType::f32, 1));
  std::vector<std::string> names;
  for (Parameter* p : model->parameters()) names.push_back(p->name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"wte.weight", "wpe.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias",
                                      "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight",
                                      "blocks.0.attn.proj.bias", "blocks.0.ln2.weight", "blocks.0.ln2.bias",
                                      "blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.bias", "blocks.0.mlp.proj.weight",
                                      "blocks.0.mlp.proj.bias", "ln_f.weight", "ln_f.bias"}));
  const int64_t v = 11, t = 7, c = 8, f = 32;
  const int64_t block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c);
  EXPECT_EQ(nn::parameter_count(*model), v * c + t * c + block + 2 * c);
}

// ---------------------------------------------------------------------------
// ModelConfig validation
// ---------------------------------------------------------------------------
void expect_rejected(const nn::ModelConfig& config, const std::string& fragment) {
  try {
    config.validate();
    ADD_FAILURE() << "accepted; expected an error mentioning '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(fragment), std::string::npos) << "message: " << e.message();
  }
}

TEST(ModelConfig, ValidationNamesTheFlag) {
  nn::ModelConfig gpt;
  gpt.kind = nn::ModelKind::gpt;
  gpt.hidden_size = 256;
  EXPECT_NO_THROW(gpt.validate());
  nn::ModelConfig c = gpt;
  c.num_heads = 5;
  expect_rejected(c, "--num-heads 5 does not divide --hidden-size 256");
  try {
    nn::parse_model_kind("rnn");
    ADD_FAILURE() << "--model rnn was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--model 'rnn' is not a model this build knows; use mlp, cnn, gpt or llama"),
              std::string::npos)
        << error.what();
  }
  for (const nn::ModelKind kind : {nn::ModelKind::mlp, nn::ModelKind::cnn, nn::ModelKind::gpt, nn::ModelKind::llama})
    EXPECT_EQ(nn::parse_model_kind(nn::model_name(kind)), kind);
  c = gpt;
  c.vocab_size = 0;
  expect_rejected(c, "--vocab-size 0");
  c = gpt;
  c.seq_length = -3;
  expect_rejected(c, "--seq-length -3");
  c = gpt;
  c.num_layers = 0;
  expect_rejected(c, "--num-layers 0");
  c = gpt;
  c.dropout = 1.0f;
  expect_rejected(c, "--dropout 1");
  c = gpt;
  c.attention_dropout = 1.0f;
  expect_rejected(c, "--attention-dropout 1");
  c = gpt;
  c.attention_dropout = -0.5f;
  expect_rejected(c, "--attention-dropout -0.5");
  c = gpt;
  c.ffn_hidden_size = -1;
  expect_rejected(c, "--ffn-hidden-size -1");
  nn::ModelConfig mlp;
  mlp.hidden = {128, 0};
  expect_rejected(mlp, "--hidden");
  nn::ModelConfig cnn;
  cnn.kind = nn::ModelKind::cnn;
  cnn.height = 3;
  expect_rejected(cnn, "at least 4x4");
  cnn = nn::ModelConfig{};
  cnn.kind = nn::ModelKind::cnn;
  cnn.num_classes = 1;
  expect_rejected(cnn, "at least 2");
  // build_model validates too.
  Context ctx;
  EXPECT_THROW(models::build_model(c, spec_for(ctx, DType::f32, 1)), Error);
}

// --moe-layer-freq: Megatron's integer N (layers 0, N, 2N, ...) or a list of
// one 0/1 per layer; the mixture of experts' settings refused naming the flag.
TEST(ModelConfig, MoeLayersFollowTheFrequencyOrThePattern) {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::llama;
  m.num_layers = 7;
  m.num_experts = 4;
  for (const int every : {1, 2, 3, 7}) {
    m.moe_layer_freq = std::to_string(every);
    EXPECT_NO_THROW(m.validate());
    for (int64_t layer = 0; layer < m.num_layers; ++layer)
      EXPECT_EQ(m.moe_layer(layer), layer % every == 0) << "every " << every << ", layer " << layer;
  }
  m.moe_layer_freq = "[0, 1,1,0,0,1,1]";
  EXPECT_NO_THROW(m.validate());
  const std::vector<bool> expected = {false, true, true, false, false, true, true};
  for (int64_t layer = 0; layer < m.num_layers; ++layer) EXPECT_EQ(m.moe_layer(layer), expected[size_t(layer)]);
  nn::ModelConfig dense = m;
  dense.num_experts = 0;
  for (int64_t layer = 0; layer < m.num_layers; ++layer) EXPECT_FALSE(dense.moe_layer(layer));
  nn::ModelConfig c = m;
  c.moe_layer_freq = "[1,0,1]";
  expect_rejected(c, "--moe-layer-freq '[1,0,1]' has 3 entries; --num-layers is 7");
  c.moe_layer_freq = "[1,2,1,1,1,1,1]";
  expect_rejected(c, "a 0 (dense) or 1 (experts) per layer");
  c.moe_layer_freq = "0";
  expect_rejected(c, "--moe-layer-freq '0' must be a whole number N >= 1");
  c.moe_layer_freq = "2x";
  expect_rejected(c, "--moe-layer-freq '2x'");
  c = m;
  c.moe_router_topk = 5;
  expect_rejected(c, "--moe-router-topk 5 must be from 1 to --num-experts 4");
  c = m;
  c.moe_expert_capacity_factor = -1;
  expect_rejected(c, "--moe-expert-capacity-factor -1");
  c = m;
  c.moe_aux_loss_coeff = -0.5;
  expect_rejected(c, "--moe-aux-loss-coeff -0.5");
}

// Sizes have upper bounds (a typo is refused at once, naming the flag), and
// the head count suggested for a width it does not divide is found in
// O(sqrt n): the old search tried every number up to the width (minutes for
// --hidden-size 99999999999). Each case runs in a thread with a deadline, so
// a search that does not end fails instead of hanging the suite.
TEST(ModelConfig, TypoSizesAreRefusedAtOnceNamingTheFlag) {
  nn::ModelConfig gpt;
  gpt.kind = nn::ModelKind::gpt;
  const auto expect_rejected_soon = [](const nn::ModelConfig& config, const std::string& fragment) {
    // A detached thread: a search that never ends is reported, not waited for.
    std::promise<std::string> answer;
    std::future<std::string> verdict = answer.get_future();
    std::thread([config, answer = std::move(answer)]() mutable {
      try {
        config.validate();
        answer.set_value("accepted");
      } catch (const Error& e) {
        answer.set_value(e.message());
      }
    }).detach();
    ASSERT_EQ(verdict.wait_for(std::chrono::seconds(20)), std::future_status::ready)
        << "validate() still running after 20 s for '" << fragment << "'";
    const std::string message = verdict.get();
    EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message;
  };
  nn::ModelConfig c = gpt;
  c.hidden_size = 99999999999;
  expect_rejected_soon(c, "--hidden-size 99999999999 is larger than 1048576");
  c = gpt;
  c.num_layers = 1 << 20;
  expect_rejected_soon(c, "--num-layers 1048576 is larger than 16384");
  c = gpt;
  c.vocab_size = int64_t(1) << 32;
  expect_rejected_soon(c, "--vocab-size 4294967296 is larger than 2147483647");
  c = gpt;
  c.seq_length = int64_t(1) << 40;
  expect_rejected_soon(c, "--seq-length");
  c = gpt;
  c.ffn_hidden_size = int64_t(1) << 30;
  expect_rejected_soon(c, "--ffn-hidden-size");
  nn::ModelConfig mlp;
  mlp.hidden = {128, int64_t(1) << 40};
  expect_rejected_soon(mlp, "--hidden: a width of 1099511627776 is larger than 1048576");
  // The largest accepted width that no head count of 4 divides still gets its suggestion at once.
  c = gpt;
  c.hidden_size = 1048573;  // prime: only 1 and itself divide it
  c.num_heads = 4;
  expect_rejected_soon(c, "e.g. --num-heads 1: heads of 1048573");
}

// nearest_divisor against the naive search over every candidate, on random
// sizes and targets (ties go to the larger divisor).
TEST(ModelConfig, NearestDivisorMatchesTheNaiveSearch) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t n = std::uniform_int_distribution<int64_t>(1, trial < 1000 ? 200 : 100000)(rng);
    const int64_t target = std::uniform_int_distribution<int64_t>(1, n + 10)(rng);
    int64_t naive = 1;
    for (int64_t d = 1; d <= n; ++d)
      if (n % d == 0 && std::llabs(d - target) <= std::llabs(naive - target)) naive = d;
    ASSERT_EQ(nn::nearest_divisor(n, target), naive) << "n " << n << " target " << target;
  }
}

// ---------------------------------------------------------------------------
// Mixed precision: a bf16 model trains a step
// ---------------------------------------------------------------------------
TEST(Bf16Model, TrainsAStepWithoutNaN) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::ModelConfig gpt = tiny_gpt();
  gpt.dropout = 0.1f;
  nn::ModelConfig mlp;
  mlp.channels = 1;
  mlp.height = 6;
  mlp.width = 6;
  mlp.hidden = {32, 32};
  for (const nn::ModelConfig& config : {gpt, mlp}) {
    auto model = models::build_model(config, spec_for(ctx, DType::bf16, rng()));
    const bool is_gpt = config.kind == nn::ModelKind::gpt;
    // The MLP gets f32 images (InputCast converts them); the GPT token ids.
    const Tensor input = is_gpt ? random_indices(ctx, Shape{4, 7}, DType::i32, rng, 0, 11).tensor
                                : random_tensor(ctx, Shape{16, 1, 6, 6}, DType::f32, rng).tensor;
    const Tensor targets =
        random_indices(ctx, is_gpt ? Shape{4, 7} : Shape{16}, DType::i64, rng, 0, is_gpt ? 11 : config.num_classes)
            .tensor;
    // The loss on this batch before and after one step, in eval mode (no dropout).
    const auto eval_loss = [&]() {
      model->eval();
      Saved saved, loss_saved;
      const Tensor logits = model->forward(input, saved, nn::Pass{});
      EXPECT_EQ(logits.dtype(), DType::bf16);
      EXPECT_TRUE(all_finite(logits)) << config.kind;
      model->train();
      return nn::CrossEntropyLoss().forward(logits, targets, loss_saved).loss;
    };
    const double before = eval_loss();
    nn::zero_grads(model->parameters());
    const StepResult step = train_step(*model, input, targets, nn::Pass{5, 0, 0});
    ASSERT_TRUE(std::isfinite(step.loss.loss)) << config.kind;
    double grad_norm = 0;
    for (Parameter* p : model->parameters()) {
      ASSERT_EQ(p->grad.dtype(), DType::f32);
      EXPECT_TRUE(all_finite(p->grad)) << p->name;
      for (const double g : p->grad.to_doubles()) grad_norm += g * g;
    }
    EXPECT_GT(grad_norm, 0.0) << config.kind;
    // The gradient of the eval-mode loss (dropout off), so that the step below
    // is plain gradient descent on the loss it is judged by.
    model->eval();
    nn::zero_grads(model->parameters());
    train_step(*model, input, targets, nn::Pass{});
    model->train();
    // One SGD step on f32 master copies, written back to the bf16 weights.
    for (Parameter* p : model->parameters()) {
      Tensor master = ctx.empty(p->value.shape(), DType::f32);
      ops::cast(p->value, master);
      Tensor momentum = ctx.zeros(p->value.shape(), DType::f32);
      ops::SgdParams sgd;
      sgd.lr = 0.1f;
      ops::sgd_step(master, p->grad, momentum, sgd, &p->value);
    }
    const double after = eval_loss();
    std::printf("%s bf16: loss %.4f -> %.4f after one SGD step (lr 0.1)\n",
                std::string(nn::model_name(config.kind)).c_str(), before, after);
    ASSERT_TRUE(std::isfinite(after)) << config.kind;
    // At initialisation a small gradient step lowers the loss on its own batch
    // (by 0.5-5 % here), more than bf16 rounding of the weights moves it.
    EXPECT_LT(after, before) << config.kind;
  }
}

// ---------------------------------------------------------------------------
// Loss and accuracy
// ---------------------------------------------------------------------------
class CrossEntropyLoss : public DtypeTest {};

TEST_P(CrossEntropyLoss, ForwardBackward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const int64_t batch = 3, tokens = 5, vocab = 7;
  auto logits = random_tensor(ctx, Shape{batch, tokens, vocab}, dtype, rng, -3.0, 3.0);
  auto targets = random_indices(ctx, Shape{batch, tokens}, DType::i64, rng, 0, vocab);
  targets.values[0] = targets.values[7] = targets.values[8] = -1;
  targets.tensor = ctx.from_doubles(targets.tensor.shape(), DType::i64, targets.values);
  const nn::CrossEntropyLoss loss(-1);
  Saved saved;
  const nn::LossValue value = loss.forward(logits.tensor, targets.tensor, saved);
  const ref::Ids ids = as_ids(targets.values);
  const double expected = ref::cross_entropy(logits.values, ids, vocab, -1);
  // The kernel works in f32 on the stored values whatever their dtype.
  expect_loss_near(value.loss, expected);
  EXPECT_EQ(value.count, batch * tokens - 3);
  const float scale = 0.37f;
  loss.backward(logits.tensor, targets.tensor, scale, saved);
  const ReferenceFunction f = [&](const Inputs& in) {
    return std::vector<double>{double(scale) * ref::cross_entropy(in[0], ids, vocab, -1)};
  };
  EXPECT_TRUE(
      all_close(logits.tensor, numeric_gradient(f, Inputs{logits.values}, 0, {1.0}), backward_tolerance(dtype)));
}

// Columns [begin, begin + count) of a row-major [rows, width] matrix.
std::vector<double> columns(const std::vector<double>& matrix, int64_t width, int64_t begin, int64_t count) {
  std::vector<double> out;
  for (size_t row = 0; row < matrix.size() / size_t(width); ++row)
    for (int64_t c = 0; c < count; ++c) out.push_back(matrix[row * size_t(width) + size_t(begin + c)]);
  return out;
}

// The forward's end and the backward that CrossEntropyLoss and the
// vocabulary-parallel loss share (nn::finish_cross_entropy_forward,
// nn::cross_entropy_backward_in_place): over the whole vocabulary as the
// first calls them, and over column shards with the global logsumexp as the
// second does, against central differences of the double loss.
TEST_P(CrossEntropyLoss, SharedBackwardOverTheVocabularyAndItsShards) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const int64_t rows = 9, vocab = 11, ignore = -1;
  const float scale = 0.61f;
  auto logits = random_tensor(ctx, Shape{rows, vocab}, dtype, rng, -3.0, 3.0);
  auto targets = random_indices(ctx, Shape{rows}, DType::i64, rng, 0, vocab);
  targets.values[2] = targets.values[5] = double(ignore);
  targets.tensor = ctx.from_doubles(Shape{rows}, DType::i64, targets.values);
  const ref::Ids ids = as_ids(targets.values);
  Tensor losses = ctx.empty(Shape{rows}, DType::f32), logsumexp = ctx.empty(Shape{rows}, DType::f32);
  ops::cross_entropy_forward(logits.tensor, targets.tensor, losses, logsumexp, ignore);
  const auto forward = [&](Saved& saved) {
    return nn::finish_cross_entropy_forward(losses, logsumexp, targets.tensor, ignore, saved);
  };
  const ReferenceFunction f = [&](const Inputs& in) {
    return std::vector<double>{double(scale) * ref::cross_entropy(in[0], ids, vocab, ignore)};
  };
  const std::vector<double> expected = numeric_gradient(f, Inputs{logits.values}, 0, {1.0});

  Saved saved;
  const nn::LossValue value = forward(saved);
  EXPECT_EQ(value.count, rows - 2);
  expect_loss_near(value.loss, ref::cross_entropy(logits.values, ids, vocab, ignore));
  Tensor whole = ctx.from_doubles(Shape{rows, vocab}, dtype, logits.values);
  nn::cross_entropy_backward_in_place(whole, targets.tensor, scale, saved, ignore, "test loss");
  EXPECT_TRUE(all_close(whole, expected, backward_tolerance(dtype)));
  EXPECT_CONTAINS(
      error_of([&] { nn::cross_entropy_backward_in_place(whole, targets.tensor, scale, saved, ignore, "test loss"); }),
      "test loss backward: no matching forward");  // the backward consumed what the forward kept

  for (const auto& [begin, width] : {std::pair<int64_t, int64_t>{0, 4}, {4, 7}}) {
    SCOPED_TRACE("columns from " + std::to_string(begin));
    Saved shard_saved;
    forward(shard_saved);
    Tensor shard = ctx.from_doubles(Shape{rows, width}, dtype, columns(logits.values, vocab, begin, width));
    nn::cross_entropy_backward_in_place(shard, targets.tensor, scale, shard_saved, ignore, "test loss", begin, vocab);
    EXPECT_TRUE(all_close(shard, columns(expected, vocab, begin, width), backward_tolerance(dtype)));
  }
}

INSTANTIATE_FLOAT_DTYPES(CrossEntropyLoss);

TEST(CrossEntropyLossEdges, AllIgnoredAndMismatch) {
  Context ctx;
  auto rng = make_rng();
  auto logits = random_tensor(ctx, Shape{4, 5}, DType::f32, rng);
  Tensor targets = ctx.full(Shape{4}, DType::i32, -100);
  const nn::CrossEntropyLoss loss;
  Saved saved;
  const nn::LossValue value = loss.forward(logits.tensor, targets, saved);
  EXPECT_EQ(value.count, 0);
  EXPECT_EQ(value.loss, 0.0);
  loss.backward(logits.tensor, targets, 1.0f, saved);
  EXPECT_TRUE(all_close(logits.tensor, std::vector<double>(20, 0.0), {0, 0}));
  EXPECT_THROW(loss.forward(logits.tensor, ctx.zeros(Shape{5}, DType::i32), saved), Error);
  EXPECT_THROW(loss.forward(logits.tensor, ctx.zeros(Shape{4}, DType::f32), saved), Error);
  Saved empty;
  EXPECT_THROW(loss.backward(logits.tensor, targets, 1.0f, empty), Error);
}

TEST(CountCorrect, CountsArgmaxMatches) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const int64_t rows = 40, classes = 5;
  auto logits = random_tensor(ctx, Shape{rows, classes}, DType::f32, rng);
  auto targets = random_indices(ctx, Shape{rows}, DType::i64, rng, 0, classes);
  targets.values[2] = -100;
  targets.tensor = ctx.from_doubles(Shape{rows}, DType::i64, targets.values);
  int64_t expected = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = logits.values.data() + r * classes;
    const int64_t best = std::max_element(row, row + classes) - row;
    expected += (targets.values[size_t(r)] == double(best)) ? 1 : 0;
  }
  EXPECT_EQ(nn::count_correct(logits.tensor, targets.tensor), expected);
}

}  // namespace
}  // namespace tessera::testing

namespace tessera::testing {
namespace {

// models::layer_costs (what pipeline partitioning balances) counts what the
// built models hold: each GPT block's parameters, the embeddings on the first
// stage, the final norm and the head's copy of the tied table on the last;
// each MLP layer's weight and bias.
int64_t elements_named(nn::Module& model, const std::string& prefix) {
  int64_t count = 0;
  for (nn::Parameter* p : model.parameters())
    if (p->name.rfind(prefix, 0) == 0) count += p->value.numel();
  return count;
}

TEST(LayerCosts, CountTheParametersOfTheBuiltModels) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  nn::ModelConfig gpt = tiny_gpt();
  gpt.num_layers = 3;
  gpt.ffn_hidden_size = 24;
  auto model = models::build_model(gpt, spec_for(ctx, DType::f32, rng()));
  const nn::LayerCosts costs = models::layer_costs(gpt);
  ASSERT_EQ(costs.layers.size(), 3u);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(costs.layers[size_t(i)], elements_named(*model, "blocks." + std::to_string(i) + ".")) << i;
  EXPECT_EQ(costs.first, elements_named(*model, "wte") + elements_named(*model, "wpe"));
  EXPECT_EQ(costs.last, elements_named(*model, "ln_f") + elements_named(*model, "wte"));

  nn::ModelConfig mlp;
  mlp.hidden = {7, 5};
  mlp.channels = 1;
  mlp.height = 3;
  mlp.width = 4;
  mlp.num_classes = 6;
  auto net = models::build_model(mlp, spec_for(ctx, DType::f32, rng()));
  const nn::LayerCosts layers = models::layer_costs(mlp);
  ASSERT_EQ(layers.layers.size(), 3u);
  int64_t total = 0;
  for (int64_t cost : layers.layers) total += cost;
  EXPECT_EQ(total, nn::parameter_count(*net));
  EXPECT_EQ(layers.layers[0], 12 * 7 + 7);
}

}  // namespace
}  // namespace tessera::testing
