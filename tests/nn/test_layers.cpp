// Layers of nn/layers.h: every layer's forward against the naive double
// references of tests/support/reference_nn.h, and its backward (the input
// gradient and every parameter gradient) against central differences of those
// references; gradients accumulate; dropout masks are the documented
// counter-based ones; recomputation gives bit-identical gradients.
// Parameters are overwritten with fresh random values, so no test depends on
// an initialiser.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/context.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "nn/layers.h"
#include "parallel/tensor_parallel.h"
#include "parallel/transformer_block.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/reference_nn.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace ref = reference;
using nn::Module;
using nn::Parameter;
using nn::Saved;

// Tolerances for composite layers (attention, MLP and transformer blocks) in
// f32: a few hundred f32 roundings along each path, each ≤ 6e-8 relative,
// with cancellations in the sums, leave ~1e-5 relative; 1e-4 keeps headroom
// while a wrong term (an error of order 1) cannot pass.
constexpr Tolerance kBlockForward{1e-4, 1e-5};
constexpr Tolerance kBlockBackward{1e-4, 1e-5};
// bf16 through a layer: inputs and parameters are exact bf16 values, every
// output (and every intermediate activation) is rounded to 8 bits (2^-9 ≈
// 2e-3 relative), and the gradients' inputs (dy, activations) are rounded
// too; 3e-2 bounds a few such roundings on values of order one.
constexpr Tolerance kBf16Layer{3e-2, 3e-2};

nn::ModelSpec spec_for(Context& ctx, DType dtype, std::mt19937_64& rng) {
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.dtype = dtype;
  spec.seed = rng();
  return spec;
}

// Overwrites every parameter with fresh uniform values in [low, high)
// (rounded to the parameter's dtype); returns them in parameters() order.
std::vector<ref::Vec> randomize(Context& ctx, Module& m, std::mt19937_64& rng, double low = -1.0, double high = 1.0) {
  std::vector<ref::Vec> values;
  for (Parameter* p : m.parameters()) {
    auto r = random_tensor(ctx, p->value.shape(), p->value.dtype(), rng, low, high);
    p->value.copy_(r.tensor);
    values.push_back(r.values);
  }
  return values;
}

// The parameters of `m` by name, taking their values from inputs[1 + k].
ref::Params params_from(const std::vector<std::string>& names, const Inputs& inputs) {
  ref::Params p;
  for (size_t k = 0; k < names.size(); ++k) p[names[k]] = inputs[1 + k];
  return p;
}

std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> names;
  for (Parameter* p : m.parameters()) names.push_back(p->name);
  return names;
}

// The reference of a layer as a function of {input, parameters...}.
using LayerReference = std::function<ref::Vec(const Inputs&)>;

// Forward against the reference on fresh random parameters.
void check_forward(Context& ctx, Module& m, const RandomTensor& x, const LayerReference& reference,
                   std::mt19937_64& rng, Tolerance tolerance) {
  Inputs inputs{x.values};
  for (auto& v : randomize(ctx, m, rng)) inputs.push_back(v);
  Saved saved;
  const Tensor y = m.forward(x.tensor, saved, nn::Pass{});
  EXPECT_EQ(y.dtype(), m.spec().dtype);
  EXPECT_TRUE(all_close(y, reference(inputs), tolerance)) << m.name() << " forward";
}

// Forward, then backward of a random upstream gradient into zeroed parameter
// gradients: the input gradient (when `input_grad`) and every parameter's
// gradient against central differences of the reference.
void check_backward(Context& ctx, Module& m, const RandomTensor& x, const LayerReference& reference,
                    std::mt19937_64& rng, Tolerance tolerance, bool input_grad = true) {
  Inputs inputs{x.values};
  for (auto& v : randomize(ctx, m, rng)) inputs.push_back(v);
  Saved saved;
  const Tensor y = m.forward(x.tensor, saved, nn::Pass{});
  auto dy = random_tensor(ctx, y.shape(), y.dtype(), rng);
  nn::zero_grads(m.parameters());
  const Tensor dx = m.backward(dy.tensor, saved);
  EXPECT_TRUE(saved.tensors.empty() && saved.children.empty()) << m.name() << ": backward keeps its saved state";
  if (input_grad) {
    ASSERT_TRUE(dx.defined());
    EXPECT_EQ(dx.shape(), x.tensor.shape());
    EXPECT_EQ(dx.dtype(), x.tensor.dtype());
    EXPECT_TRUE(all_close(dx, numeric_gradient(reference, inputs, 0, dy.values), tolerance)) << m.name() << " input";
  }
  const auto params = m.parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_EQ(params[k]->grad.dtype(), DType::f32);
    EXPECT_TRUE(all_close(params[k]->grad, numeric_gradient(reference, inputs, 1 + k, dy.values), tolerance))
        << params[k]->name;
  }
}

// ---------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------
struct LinearCase {
  bool bias;
  ops::Activation activation;
};
const LinearCase kLinearCases[] = {{true, ops::Activation::none},
                                   {false, ops::Activation::none},
                                   {true, ops::Activation::relu},
                                   {true, ops::Activation::gelu}};

LayerReference linear_reference(const LinearCase& c, int64_t rows, int64_t in, int64_t out) {
  return [=](const Inputs& in_values) {
    ref::Vec y = ref::linear(in_values[0], in_values[1], c.bias ? in_values[2] : ref::Vec{}, rows, in, out);
    if (c.activation == ops::Activation::relu) return ref::relu(y);
    if (c.activation == ops::Activation::gelu) return ref::gelu(y);
    return y;
  };
}

class LinearLayer : public DtypeTest {};

TEST_P(LinearLayer, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const LinearCase& c : kLinearCases) {
    nn::Linear layer(spec_for(ctx, dtype, rng), "fc", 37, 19, c.bias, c.activation);
    auto x = random_tensor(ctx, Shape{3, 5, 37}, dtype, rng);  // [..., in]: any leading dimensions
    check_forward(ctx, layer, x, linear_reference(c, 15, 37, 19), rng, forward_tolerance(dtype));
  }
}

TEST_P(LinearLayer, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const LinearCase& c : kLinearCases) {
    nn::Linear layer(spec_for(ctx, dtype, rng), "fc", 7, 6, c.bias, c.activation);
    auto x = random_tensor(ctx, Shape{3, 5, 7}, dtype, rng);
    check_backward(ctx, layer, x, linear_reference(c, 15, 7, 6), rng,
                   dtype == DType::f32 ? backward_tolerance(dtype) : kBf16Layer);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LinearLayer, ::testing::Values(DType::f32, DType::bf16), dtype_param_name);

TEST(LinearLayerBasics, NamesShapesAndInit) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::Linear layer(spec_for(ctx, DType::f32, rng), "blocks.0.fc", 40, 3);
  const auto params = layer.parameters();
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0]->name, "blocks.0.fc.weight");
  EXPECT_EQ(params[0]->value.shape(), (Shape{3, 40}));
  EXPECT_TRUE(params[0]->weight_decay);
  EXPECT_EQ(params[1]->name, "blocks.0.fc.bias");
  EXPECT_FALSE(params[1]->weight_decay);
  // PyTorch's init: uniform(±1/√in) for weight and bias.
  const double bound = 1.0 / std::sqrt(40.0);
  for (Parameter* p : params) {
    for (const double v : p->value.to_doubles()) EXPECT_LE(std::abs(v), bound);
    for (const double g : p->grad.to_doubles()) EXPECT_EQ(g, 0.0);
  }
}

// Parameter gradients add up over calls (micro-batches); the trainer zeroes them.
TEST(LinearLayerBasics, GradientsAccumulate) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const DType dtype : {DType::f32, DType::bf16}) {
    nn::Linear layer(spec_for(ctx, dtype, rng), "fc", 9, 4, true, ops::Activation::gelu);
    randomize(ctx, layer, rng);
    auto x1 = random_tensor(ctx, Shape{6, 9}, dtype, rng), x2 = random_tensor(ctx, Shape{5, 9}, dtype, rng);
    auto dy1 = random_tensor(ctx, Shape{6, 4}, dtype, rng), dy2 = random_tensor(ctx, Shape{5, 4}, dtype, rng);
    const auto run = [&](const RandomTensor& x, const RandomTensor& dy) {
      Saved saved;
      layer.forward(x.tensor, saved, nn::Pass{});
      layer.backward(dy.tensor, saved);
    };
    std::vector<std::vector<double>> separate[2];
    for (int i = 0; i < 2; ++i) {
      nn::zero_grads(layer.parameters());
      run(i == 0 ? x1 : x2, i == 0 ? dy1 : dy2);
      for (Parameter* p : layer.parameters()) separate[i].push_back(p->grad.to_doubles());
    }
    nn::zero_grads(layer.parameters());
    run(x1, dy1);
    run(x2, dy2);
    const auto params = layer.parameters();
    for (size_t k = 0; k < params.size(); ++k)
      EXPECT_TRUE(all_close(params[k]->grad, ref::add(separate[0][k], separate[1][k]), {1e-6, 1e-7}))
          << params[k]->name << " " << dtype;
  }
}

TEST(LinearLayerBasics, RejectsWrongInputs) {
  Context ctx;
  auto rng = make_rng();
  nn::Linear layer(spec_for(ctx, DType::f32, rng), "fc", 8, 3);
  Saved saved;
  try {
    layer.forward(ctx.zeros(Shape{4, 7}, DType::f32), saved, nn::Pass{});
    FAIL() << "a 7-feature input was accepted by an 8-feature layer";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("fc"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("[4, 7]"), std::string::npos) << e.message();
  }
  EXPECT_THROW(layer.forward(ctx.zeros(Shape{4, 8}, DType::bf16), saved, nn::Pass{}), Error);
  Saved empty;
  EXPECT_THROW(layer.backward(ctx.zeros(Shape{4, 3}, DType::f32), empty), Error);
}

// ---------------------------------------------------------------------------
// Conv2d, MaxPool2d
// ---------------------------------------------------------------------------
struct ConvCase {
  int64_t n, c, h, w, k;
  int r, stride, pad;
  bool bias;
};
const ConvCase kConvCases[] = {{2, 3, 7, 6, 4, 3, 2, 1, true}, {2, 2, 8, 8, 3, 5, 1, 2, false}};

LayerReference conv_reference(const ConvCase& c) {
  return [=](const Inputs& in) {
    return ref::conv2d(in[0], in[1], c.bias ? in[2] : ref::Vec{}, c.n, c.c, c.h, c.w, c.k, c.r, c.stride, c.pad);
  };
}

class Conv2dLayer : public DtypeTest {};

TEST_P(Conv2dLayer, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const ConvCase& c : kConvCases) {
    nn::Conv2d layer(spec_for(ctx, dtype, rng), "conv", c.c, c.k, c.r, c.stride, c.pad, c.bias);
    auto x = random_tensor(ctx, Shape{c.n, c.c, c.h, c.w}, dtype, rng);
    check_forward(ctx, layer, x, conv_reference(c), rng, forward_tolerance(dtype));
  }
}

TEST_P(Conv2dLayer, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const ConvCase& c : kConvCases) {
    nn::Conv2d layer(spec_for(ctx, dtype, rng), "conv", c.c, c.k, c.r, c.stride, c.pad, c.bias);
    auto x = random_tensor(ctx, Shape{c.n, c.c, c.h, c.w}, dtype, rng);
    check_backward(ctx, layer, x, conv_reference(c), rng, dtype == DType::f32 ? backward_tolerance(dtype) : kBf16Layer);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Conv2dLayer, ::testing::Values(DType::f32, DType::bf16), dtype_param_name);

TEST(Conv2dLayerBasics, NoInputGradientWhenNotNeeded) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const ConvCase c = kConvCases[0];
  nn::Conv2d layer(spec_for(ctx, DType::f32, rng), "conv", c.c, c.k, c.r, c.stride, c.pad, c.bias);
  layer.set_input_grad(false);
  auto x = random_tensor(ctx, Shape{c.n, c.c, c.h, c.w}, DType::f32, rng);
  check_backward(ctx, layer, x, conv_reference(c), rng, backward_tolerance(DType::f32), /*input_grad=*/false);
}

TEST(MaxPool2dLayer, Forward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const DType dtype : {DType::f32, DType::bf16}) {
    nn::MaxPool2d pool(spec_for(ctx, dtype, rng), "pool", 2);
    auto x = random_tensor(ctx, Shape{2, 3, 7, 6}, dtype, rng);
    check_forward(ctx, pool, x, [](const Inputs& in) { return ref::maxpool2d(in[0], 2, 3, 7, 6, 2, 2, 0); }, rng,
                  {0, 0});  // a maximum is one of the inputs: exact
    nn::MaxPool2d padded(spec_for(ctx, dtype, rng), "pool", 3, 2, 1);
    check_forward(ctx, padded, x, [](const Inputs& in) { return ref::maxpool2d(in[0], 2, 3, 7, 6, 3, 2, 1); }, rng,
                  {0, 0});
  }
}

TEST(MaxPool2dLayer, Backward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::MaxPool2d pool(spec_for(ctx, DType::f32, rng), "pool", 3, 2, 1);
  auto x = random_tensor(ctx, Shape{2, 3, 7, 6}, DType::f32, rng);
  check_backward(
      ctx, pool, x, [](const Inputs& in) { return ref::maxpool2d(in[0], 2, 3, 7, 6, 3, 2, 1); }, rng,
      backward_tolerance(DType::f32));
}

// ---------------------------------------------------------------------------
// ReLU, GELU, LayerNorm, RMSNorm
// ---------------------------------------------------------------------------
class ActivationLayers : public DtypeTest {};

TEST_P(ActivationLayers, ForwardBackward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  nn::ReLU relu(spec_for(ctx, dtype, rng), "relu");
  nn::GELU gelu(spec_for(ctx, dtype, rng), "gelu");
  const LayerReference relu_ref = [](const Inputs& in) { return ref::relu(in[0]); };
  const LayerReference gelu_ref = [](const Inputs& in) { return ref::gelu(in[0]); };
  auto x = random_tensor(ctx, Shape{4, 3, 9}, dtype, rng, -3.0, 3.0);
  check_forward(ctx, relu, x, relu_ref, rng, forward_tolerance(dtype));
  check_forward(ctx, gelu, x, gelu_ref, rng, forward_tolerance(dtype));
  check_backward(ctx, relu, x, relu_ref, rng, backward_tolerance(dtype));
  check_backward(ctx, gelu, x, gelu_ref, rng, backward_tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ActivationLayers, ::testing::Values(DType::f32, DType::bf16), dtype_param_name);

class LayerNormLayer : public DtypeTest {};

TEST_P(LayerNormLayer, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const bool bias : {true, false}) {
    nn::LayerNorm layer(spec_for(ctx, dtype, rng), "ln", 10, 1e-5f, bias);
    auto x = random_tensor(ctx, Shape{3, 4, 10}, dtype, rng, -2.0, 2.0);
    check_forward(
        ctx, layer, x, [&](const Inputs& in) { return ref::layernorm(in[0], in[1], bias ? in[2] : ref::Vec{}, 10); },
        rng, forward_tolerance(dtype));
  }
}

TEST_P(LayerNormLayer, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const bool bias : {true, false}) {
    nn::LayerNorm layer(spec_for(ctx, dtype, rng), "ln", 10, 1e-5f, bias);
    auto x = random_tensor(ctx, Shape{3, 4, 10}, dtype, rng, -2.0, 2.0);
    check_backward(
        ctx, layer, x, [&](const Inputs& in) { return ref::layernorm(in[0], in[1], bias ? in[2] : ref::Vec{}, 10); },
        rng, dtype == DType::f32 ? backward_tolerance(dtype) : kBf16Layer);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LayerNormLayer, ::testing::Values(DType::f32, DType::bf16), dtype_param_name);

class RMSNormLayer : public DtypeTest {};

TEST_P(RMSNormLayer, ForwardBackward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  nn::RMSNorm layer(spec_for(ctx, dtype, rng), "norm", 11);
  const LayerReference reference = [](const Inputs& in) { return ref::rmsnorm(in[0], in[1], 11); };
  auto x = random_tensor(ctx, Shape{5, 11}, dtype, rng, -2.0, 2.0);
  check_forward(ctx, layer, x, reference, rng, forward_tolerance(dtype));
  check_backward(ctx, layer, x, reference, rng, dtype == DType::f32 ? backward_tolerance(dtype) : kBf16Layer);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RMSNormLayer, ::testing::Values(DType::f32, DType::bf16), dtype_param_name);

// ---------------------------------------------------------------------------
// Embedding, PositionEmbedding, Flatten, InputCast
// ---------------------------------------------------------------------------
class EmbeddingLayer : public DtypeTest {};

TEST_P(EmbeddingLayer, ForwardBackward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const int64_t vocab = 7, dim = 6;
  nn::Embedding layer(spec_for(ctx, dtype, rng), "wte", vocab, dim);
  for (const DType id_dtype : {DType::i32, DType::i64}) {
    auto ids = random_indices(ctx, Shape{3, 5}, id_dtype, rng, 0, vocab);  // 15 ids over 7 rows: repeats
    const ref::Ids id_values(ids.values.begin(), ids.values.end());
    const LayerReference reference = [&](const Inputs& in) { return ref::embedding(id_values, in[1], dim); };
    const Inputs inputs{{}, randomize(ctx, layer, rng)[0]};
    Saved saved;
    const Tensor out = layer.forward(ids.tensor, saved, nn::Pass{});
    EXPECT_EQ(out.shape(), (Shape{3, 5, dim}));
    EXPECT_TRUE(all_close(out, reference(inputs), {0, 0}));  // a copy of rows: exact
    auto dy = random_tensor(ctx, out.shape(), dtype, rng);
    nn::zero_grads(layer.parameters());
    EXPECT_FALSE(layer.backward(dy.tensor, saved).defined()) << "ids have no gradient";
    EXPECT_TRUE(all_close(layer.weight().grad, numeric_gradient(reference, inputs, 1, dy.values),
                          backward_tolerance(DType::f32)))
        << id_dtype;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmbeddingLayer, ::testing::Values(DType::f32, DType::bf16), dtype_param_name);

TEST(PositionEmbeddingLayer, ForwardBackward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const int64_t batch = 2, tokens = 5, max_tokens = 7, dim = 6;
  nn::PositionEmbedding layer(spec_for(ctx, DType::f32, rng), "wpe", max_tokens, dim);
  const LayerReference reference = [&](const Inputs& in) {
    ref::Vec y = in[0];
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < tokens * dim; ++i) y[size_t(b * tokens * dim + i)] += in[1][size_t(i)];
    return y;
  };
  auto x = random_tensor(ctx, Shape{batch, tokens, dim}, DType::f32, rng);
  check_forward(ctx, layer, x, reference, rng, forward_tolerance(DType::f32));
  check_backward(ctx, layer, x, reference, rng, backward_tolerance(DType::f32));  // rows ≥ tokens: zero gradient
  Saved saved;
  EXPECT_THROW(layer.forward(ctx.zeros(Shape{1, 8, dim}, DType::f32), saved, nn::Pass{}), Error);
}

TEST(FlattenLayer, ForwardBackward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::Flatten flatten(spec_for(ctx, DType::f32, rng), "flatten");
  auto x = random_tensor(ctx, Shape{3, 2, 4, 5}, DType::f32, rng);
  Saved saved;
  const Tensor y = flatten.forward(x.tensor, saved, nn::Pass{});
  EXPECT_EQ(y.shape(), (Shape{3, 40}));
  EXPECT_TRUE(all_close(y, x.values, {0, 0}));
  auto dy = random_tensor(ctx, Shape{3, 40}, DType::f32, rng);
  const Tensor dx = flatten.backward(dy.tensor, saved);
  EXPECT_EQ(dx.shape(), x.tensor.shape());
  EXPECT_TRUE(all_close(dx, dy.values, {0, 0}));
}

TEST(InputCastLayer, CastsToTheModelDtypeAndBack) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::InputCast cast(spec_for(ctx, DType::bf16, rng), "input_cast");
  auto x = random_tensor(ctx, Shape{4, 9}, DType::f32, rng);
  Saved saved;
  const Tensor y = cast.forward(x.tensor, saved, nn::Pass{});
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_TRUE(all_close(y, round_to(DType::bf16, x.values), {0, 0}));
  auto dy = random_tensor(ctx, Shape{4, 9}, DType::bf16, rng);
  const Tensor dx = cast.backward(dy.tensor, saved);
  EXPECT_EQ(dx.dtype(), DType::f32);
  EXPECT_TRUE(all_close(dx, dy.values, {0, 0}));
  // Already in the model's dtype: the input itself.
  auto same = random_tensor(ctx, Shape{4, 9}, DType::bf16, rng);
  EXPECT_TRUE(cast.forward(same.tensor, saved, nn::Pass{}).shares_storage_with(same.tensor));
}

// ---------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------
TEST(DropoutLayer, MaskIsTheDocumentedCounterBasedOne) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const float p = 0.3f;
  nn::Dropout dropout(spec_for(ctx, DType::f32, rng), "blocks.1.mlp.dropout", p);
  const nn::Pass pass{rng(), 17, 3};
  auto x = random_tensor(ctx, Shape{40, 50}, DType::f32, rng, 0.5, 1.5);  // no zeros: a zero output means dropped
  Saved saved;
  const Tensor y = dropout.forward(x.tensor, saved, pass);
  const uint64_t seed = nn::dropout_seed(pass, "blocks.1.mlp.dropout");
  std::vector<double> expected(x.values.size());
  size_t dropped = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const bool keep = philox_uniform(seed, ops::kDropoutRngStream, i) >= p;
    expected[i] = keep ? x.values[i] / (1.0 - double(p)) : 0.0;
    dropped += keep ? 0 : 1;
  }
  EXPECT_TRUE(all_close(y, expected, forward_tolerance(DType::f32)));
  // 2000 draws at p = 0.3: 600 expected, standard deviation ≈ 20.5; ±6σ.
  EXPECT_NEAR(double(dropped), 600.0, 123.0);

  // Backward applies the same mask to the gradient.
  auto dy = random_tensor(ctx, Shape{40, 50}, DType::f32, rng);
  const Tensor dx = dropout.backward(dy.tensor, saved);
  std::vector<double> expected_dx(dy.values.size());
  for (size_t i = 0; i < expected_dx.size(); ++i)
    expected_dx[i] = expected[i] == 0.0 ? 0.0 : dy.values[i] / (1.0 - double(p));
  EXPECT_TRUE(all_close(dx, expected_dx, forward_tolerance(DType::f32)));
}

TEST(DropoutLayer, ReproducibleAndDistinctPerPass) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  nn::Dropout dropout(spec_for(ctx, DType::f32, rng), "drop", 0.5f);
  nn::Dropout other(spec_for(ctx, DType::f32, rng), "other", 0.5f);
  auto x = random_tensor(ctx, Shape{1000}, DType::f32, rng, 0.5, 1.5);
  const nn::Pass pass{rng(), 4, 1};
  const auto run = [&](nn::Dropout& d, const nn::Pass& ps) {
    Saved saved;
    return d.forward(x.tensor, saved, ps).to_vector<float>();
  };
  const auto base = run(dropout, pass);
  EXPECT_EQ(run(dropout, pass), base) << "the same pass and module draw the same mask";
  EXPECT_NE(run(dropout, nn::Pass{pass.seed, pass.step + 1, pass.micro_batch}), base) << "another step";
  EXPECT_NE(run(dropout, nn::Pass{pass.seed, pass.step, pass.micro_batch + 1}), base) << "another micro-batch";
  EXPECT_NE(run(dropout, nn::Pass{pass.seed + 1, pass.step, pass.micro_batch}), base) << "another seed";
  EXPECT_NE(run(other, pass), base) << "another module";
}

TEST(DropoutLayer, IdentityInEvalModeAndAtZero) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, Shape{7, 9}, DType::f32, rng);
  auto dy = random_tensor(ctx, Shape{7, 9}, DType::f32, rng);
  nn::Dropout dropout(spec_for(ctx, DType::f32, rng), "drop", 0.4f);
  dropout.eval();
  nn::Dropout zero(spec_for(ctx, DType::f32, rng), "zero", 0.0f);
  for (nn::Dropout* d : {&dropout, &zero}) {
    Saved saved;
    const Tensor y = d->forward(x.tensor, saved, nn::Pass{1, 2, 3});
    EXPECT_TRUE(all_close(y, x.values, {0, 0})) << d->name();
    EXPECT_TRUE(all_close(d->backward(dy.tensor, saved), dy.values, {0, 0})) << d->name();
  }
  try {
    nn::Dropout bad(spec_for(ctx, DType::f32, rng), "drop", 1.0f);
    FAIL() << "p = 1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("--dropout"), std::string::npos) << e.message();
  }
}

// ---------------------------------------------------------------------------
// The GPT's attention, MLP and block (the tensor-parallel layers with a group of one), Sequential
// ---------------------------------------------------------------------------
constexpr int64_t kBatch = 2, kTokens = 5, kHidden = 8, kHeads = 2, kFfn = 12;

TEST(CausalSelfAttention, ForwardBackward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  parallel::ParallelSelfAttention attn(spec_for(ctx, DType::f32, rng), "attn", parallel::TensorParallelism{}, kHidden, kHeads, 0.0f);
  const auto names = names_of(attn);
  const LayerReference reference = [&](const Inputs& in) {
    return ref::causal_self_attention(params_from(names, in), "attn", in[0], kBatch, kTokens, kHidden, kHeads);
  };
  auto x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::f32, rng);
  check_forward(ctx, attn, x, reference, rng, kBlockForward);
  check_backward(ctx, attn, x, reference, rng, kBlockBackward);
}

TEST(CausalSelfAttention, Bf16Forward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  parallel::ParallelSelfAttention attn(spec_for(ctx, DType::bf16, rng), "attn", parallel::TensorParallelism{}, kHidden, kHeads, 0.0f);
  const auto names = names_of(attn);
  auto x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::bf16, rng);
  check_forward(
      ctx, attn, x,
      [&](const Inputs& in) {
        return ref::causal_self_attention(params_from(names, in), "attn", in[0], kBatch, kTokens, kHidden, kHeads);
      },
      rng, kBf16Layer);
}

TEST(CausalSelfAttention, RejectsHeadsThatDoNotDivide) {
  Context ctx;
  auto rng = make_rng();
  EXPECT_THROW(parallel::ParallelSelfAttention(spec_for(ctx, DType::f32, rng), "attn", {}, 10, 3, 0.0f), Error);
}

TEST(MlpBlock, ForwardBackward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  parallel::ParallelMlp mlp(spec_for(ctx, DType::f32, rng), "mlp", parallel::TensorParallelism{}, kHidden, kFfn, 0.0f);
  const auto names = names_of(mlp);
  const LayerReference reference = [&](const Inputs& in) {
    return ref::mlp_block(params_from(names, in), "mlp", in[0], kBatch * kTokens, kHidden, kFfn);
  };
  auto x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::f32, rng);
  check_forward(ctx, mlp, x, reference, rng, kBlockForward);
  check_backward(ctx, mlp, x, reference, rng, kBlockBackward);
}

class TransformerBlock : public ::testing::TestWithParam<bool> {};  // parameter: recompute

TEST_P(TransformerBlock, Forward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  parallel::ParallelTransformerBlock block(spec_for(ctx, DType::f32, rng), "blocks.0", {}, kHidden, kHeads, kFfn, 0.0f,
                                          0.0f, GetParam());
  const auto names = names_of(block);
  auto x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::f32, rng);
  check_forward(
      ctx, block, x,
      [&](const Inputs& in) {
        return ref::transformer_block(params_from(names, in), "blocks.0", in[0], kBatch, kTokens, kHidden, kHeads,
                                      kFfn);
      },
      rng, kBlockForward);
}

TEST_P(TransformerBlock, Backward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  parallel::ParallelTransformerBlock block(spec_for(ctx, DType::f32, rng), "blocks.0", {}, kHidden, kHeads, kFfn, 0.0f,
                                          0.0f, GetParam());
  const auto names = names_of(block);
  auto x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::f32, rng);
  check_backward(
      ctx, block, x,
      [&](const Inputs& in) {
        return ref::transformer_block(params_from(names, in), "blocks.0", in[0], kBatch, kTokens, kHidden, kHeads,
                                      kFfn);
      },
      rng, kBlockBackward);
}

INSTANTIATE_TEST_SUITE_P(Recompute, TransformerBlock, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param_info) {
                           return param_info.param ? "on" : "off";
                         });

// With dropout active (after attention and MLP, and on the attention
// probabilities), recomputation re-draws the same masks: the input gradient
// and every parameter gradient are bit-identical.
TEST(TransformerBlockRecompute, BitIdenticalGradients) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const DType dtype : {DType::f32, DType::bf16}) {
    const nn::ModelSpec spec = spec_for(ctx, dtype, rng);
    parallel::ParallelTransformerBlock plain(spec, "blocks.3", {}, kHidden, kHeads, kFfn, 0.2f, 0.2f, false);
    parallel::ParallelTransformerBlock recomputed(spec, "blocks.3", {}, kHidden, kHeads, kFfn, 0.2f, 0.2f, true);
    randomize(ctx, plain, rng);
    const auto params = recomputed.parameters();
    for (size_t k = 0; k < params.size(); ++k) params[k]->value.copy_(plain.parameters()[k]->value);
    auto x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, dtype, rng);
    auto dy = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, dtype, rng);
    const nn::Pass pass{rng(), 9, 2};
    std::vector<std::vector<float>> grads[2];
    std::vector<double> outputs[2], input_grads[2];
    int i = 0;
    for (parallel::ParallelTransformerBlock* block : {&plain, &recomputed}) {
      Saved saved;
      outputs[i] = block->forward(x.tensor, saved, pass).to_doubles();
      if (block->recompute()) {
        EXPECT_EQ(saved.tensors.size(), 1u) << "recompute keeps only the input";
      }
      input_grads[i] = block->backward(dy.tensor, saved).to_doubles();
      for (Parameter* p : block->parameters()) grads[i].push_back(p->grad.to_vector<float>());
      ++i;
    }
    EXPECT_EQ(outputs[0], outputs[1]) << dtype;
    EXPECT_EQ(input_grads[0], input_grads[1]) << dtype;
    for (size_t k = 0; k < params.size(); ++k) EXPECT_EQ(grads[0][k], grads[1][k]) << params[k]->name << " " << dtype;
  }
}

TEST(SequentialLayer, ForwardBackward) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const nn::ModelSpec spec = spec_for(ctx, DType::f32, rng);
  nn::Sequential seq(spec, "");
  seq.add<nn::Flatten>(spec, "flatten");
  seq.add<nn::Linear>(spec, "layers.0", 12, 9, true, ops::Activation::relu);
  seq.add<nn::GELU>(spec, "gelu");
  seq.add<nn::Linear>(spec, "layers.1", 9, 4);
  ASSERT_EQ(seq.size(), 4u);
  EXPECT_EQ(names_of(seq),
            (std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}));
  const LayerReference reference = [](const Inputs& in) {
    const ref::Vec h = ref::gelu(ref::relu(ref::linear(in[0], in[1], in[2], 5, 12, 9)));
    return ref::linear(h, in[3], in[4], 5, 9, 4);
  };
  auto x = random_tensor(ctx, Shape{5, 3, 4}, DType::f32, rng);
  check_forward(ctx, seq, x, reference, rng, forward_tolerance(DType::f32));
  check_backward(ctx, seq, x, reference, rng, backward_tolerance(DType::f32));
}

TEST(Module, TrainEvalReachesChildren) {
  Context ctx;
  auto rng = make_rng();
  parallel::ParallelTransformerBlock block(spec_for(ctx, DType::f32, rng), "b", {}, kHidden, kHeads, kFfn, 0.1f, 0.1f,
                                          false);
  EXPECT_TRUE(block.training());
  block.eval();
  EXPECT_FALSE(block.training());
  EXPECT_FALSE(block.mlp().training());
  block.train();
  EXPECT_TRUE(block.attn().training());
}

}  // namespace
}  // namespace tessera::testing
