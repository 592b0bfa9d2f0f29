// nn::Optimizer (AdamW, SGD) over Parameters: several steps against double
// implementations of PyTorch's rules written here (per-parameter weight-decay
// flag, scheduled lr, grad_scale), bf16/f16 parameters with f32 masters (the
// master follows the f32 run bit for bit, the value is the rounded master),
// checkpoint state by name and resuming from it, invalid configs; the global
// gradient norm against a double sum and the clipping coefficient.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "nn/optimizer.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using nn::OptimizerConfig;
using nn::OptimizerKind;
using nn::Parameter;

// Odd sizes; the first is larger than one CPU thread's grain.
const std::vector<Shape> kShapes{Shape{9001}, Shape{7, 13}, Shape{3}};
constexpr int kSteps = 4;
// f32 state updated in f32 over a few steps, against double (as in the kernel tests).
const Tolerance kStateTolerance{2e-5, 1e-6};

// Parameters with stable addresses, and the double values the tests track.
struct Model {
  std::vector<std::unique_ptr<Parameter>> parameters;
  std::vector<Parameter*> pointers() const {
    std::vector<Parameter*> out;
    for (const auto& p : parameters) out.push_back(p.get());
    return out;
  }
};

// One parameter per shape in kShapes, values random in `dtype`, f32 grads
// (redrawn by fresh_grads); the last parameter has no weight decay (a bias).
Model make_model(Context& ctx, DType dtype, std::mt19937_64& rng, std::vector<std::vector<double>>& values) {
  Model model;
  values.clear();
  for (size_t i = 0; i < kShapes.size(); ++i) {
    auto value = random_tensor(ctx, kShapes[i], dtype, rng);
    auto p = std::make_unique<Parameter>();
    p->name = "layer" + std::to_string(i) + ".weight";
    p->value = value.tensor;
    p->grad = poisoned(ctx, kShapes[i], DType::f32);
    p->weight_decay = i + 1 < kShapes.size();
    values.push_back(value.values);
    model.parameters.push_back(std::move(p));
  }
  return model;
}

// A copy of `model` with the same values and gradients in another dtype
// (values must be representable there).
Model same_model_in(Context& ctx, const Model& model, DType dtype) {
  Model out;
  for (const auto& p : model.parameters) {
    auto q = std::make_unique<Parameter>(*p);
    q->value = ctx.from_doubles(p->value.shape(), dtype, p->value.to_doubles());
    q->grad = p->grad;  // shared: both read the same gradients
    out.parameters.push_back(std::move(q));
  }
  return out;
}

std::vector<std::vector<double>> fresh_grads(Context& ctx, const Model& model, std::mt19937_64& rng) {
  std::vector<std::vector<double>> grads;
  for (const auto& p : model.parameters) {
    auto g = random_tensor(ctx, p->grad.shape(), DType::f32, rng, -2.0, 2.0);
    p->grad.copy_(g.tensor);
    grads.push_back(g.values);
  }
  return grads;
}

struct AdamWReference {
  std::vector<double> param, m, v;
  void step(const std::vector<double>& grad, double lr, double grad_scale, double weight_decay,
            const OptimizerConfig& c, int64_t t) {
    const double bias1 = 1 - std::pow(double(c.beta1), double(t));
    const double bias2 = 1 - std::pow(double(c.beta2), double(t));
    for (size_t i = 0; i < param.size(); ++i) {
      const double g = grad[i] * grad_scale;
      param[i] *= 1 - lr * weight_decay;
      m[i] = c.beta1 * m[i] + (1 - double(c.beta1)) * g;
      v[i] = c.beta2 * v[i] + (1 - double(c.beta2)) * g * g;
      param[i] -= lr / bias1 * m[i] / (std::sqrt(v[i] / bias2) + double(c.eps));
    }
  }
};

struct SgdReference {
  std::vector<double> param, buffer;
  void step(const std::vector<double>& grad, double lr, double grad_scale, double weight_decay,
            const OptimizerConfig& c, int64_t t) {
    for (size_t i = 0; i < param.size(); ++i) {
      double g = grad[i] * grad_scale + weight_decay * param[i];
      if (c.momentum > 0) {
        buffer[i] = t == 1 ? g : double(c.momentum) * buffer[i] + (1 - double(c.dampening)) * g;
        g = c.nesterov ? g + double(c.momentum) * buffer[i] : buffer[i];
      }
      param[i] -= lr * g;
    }
  }
};

// The learning rate and grad scale of step t (1-based): they change every step.
float lr_of(int t) {
  return 0.01f * float(5 - t) / 4.0f;
}
float grad_scale_of(int t) {
  return t % 2 == 0 ? 0.5f : 1.25f;
}

std::map<std::string, Tensor*> state_by_name(nn::Optimizer& optimizer) {
  std::map<std::string, Tensor*> out;
  for (auto& [name, tensor] : optimizer.state_tensors()) out[name] = tensor;
  return out;
}

OptimizerConfig adamw_config() {
  OptimizerConfig c;
  c.kind = OptimizerKind::adamw;
  c.lr = 0.01f;
  c.beta1 = 0.8f;
  c.beta2 = 0.95f;
  c.eps = 1e-6f;
  c.weight_decay = 0.1f;
  return c;
}

OptimizerConfig sgd_config(float momentum, float dampening, bool nesterov) {
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.lr = 0.01f;
  c.momentum = momentum;
  c.dampening = dampening;
  c.nesterov = nesterov;
  c.weight_decay = 0.05f;
  return c;
}

TEST(Optimizer, AdamWMatchesReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (float weight_decay : {0.0f, 0.1f}) {
    SCOPED_TRACE("weight_decay=" + std::to_string(weight_decay));
    OptimizerConfig config = adamw_config();
    config.weight_decay = weight_decay;
    std::vector<std::vector<double>> values;
    Model model = make_model(ctx, DType::f32, rng, values);
    std::vector<AdamWReference> refs;
    for (const auto& v : values) refs.push_back({v, std::vector<double>(v.size()), std::vector<double>(v.size())});

    nn::Optimizer optimizer(model.pointers(), config);
    EXPECT_EQ(optimizer.step_count(), 0);
    for (int t = 1; t <= kSteps; ++t) {
      const auto grads = fresh_grads(ctx, model, rng);
      optimizer.step(lr_of(t), grad_scale_of(t));
      for (size_t i = 0; i < refs.size(); ++i) {
        const double decay = model.parameters[i]->weight_decay ? weight_decay : 0.0;
        refs[i].step(grads[i], lr_of(t), grad_scale_of(t), decay, config, t);
      }
    }
    EXPECT_EQ(optimizer.step_count(), kSteps);
    auto state = state_by_name(optimizer);
    for (size_t i = 0; i < refs.size(); ++i) {
      const Parameter& p = *model.parameters[i];
      EXPECT_TRUE(all_close(p.value, refs[i].param, kStateTolerance)) << p.name;
      EXPECT_TRUE(all_close(*state.at(p.name + ".exp_avg"), refs[i].m, kStateTolerance)) << p.name;
      EXPECT_TRUE(all_close(*state.at(p.name + ".exp_avg_sq"), refs[i].v, kStateTolerance)) << p.name;
    }
  }
}

TEST(Optimizer, WeightDecayOnlyWhereFlagged) {
  // Zero gradients: AdamW's update is pure decay, so decayed parameters shrink
  // by exactly (1 − lr·wd) per step and the others do not move at all.
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  Model model = make_model(ctx, DType::f32, rng, values);
  for (auto& p : model.parameters) p->grad.fill_(0.0);
  const OptimizerConfig config = adamw_config();
  nn::Optimizer optimizer(model.pointers(), config);
  optimizer.step(config.lr);
  optimizer.step(config.lr);
  for (size_t i = 0; i < values.size(); ++i) {
    const Parameter& p = *model.parameters[i];
    const double factor = p.weight_decay ? std::pow(1 - double(config.lr) * double(config.weight_decay), 2) : 1.0;
    std::vector<double> expected = values[i];
    for (double& v : expected) v *= factor;
    EXPECT_TRUE(all_close(p.value, expected, kStateTolerance)) << p.name;
  }
}

struct SgdCase {
  float momentum, dampening;
  bool nesterov;
};

TEST(Optimizer, SgdMatchesReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const SgdCase& sc : {SgdCase{0.0f, 0.0f, false}, SgdCase{0.9f, 0.0f, false}, SgdCase{0.9f, 0.3f, false},
                            SgdCase{0.8f, 0.0f, true}}) {
    SCOPED_TRACE("momentum=" + std::to_string(sc.momentum) + " dampening=" + std::to_string(sc.dampening) +
                 " nesterov=" + std::to_string(sc.nesterov));
    const OptimizerConfig config = sgd_config(sc.momentum, sc.dampening, sc.nesterov);
    std::vector<std::vector<double>> values;
    Model model = make_model(ctx, DType::f32, rng, values);
    std::vector<SgdReference> refs;
    for (const auto& v : values) refs.push_back({v, std::vector<double>(v.size())});
    nn::Optimizer optimizer(model.pointers(), config);
    for (int t = 1; t <= kSteps; ++t) {
      const auto grads = fresh_grads(ctx, model, rng);
      optimizer.step(lr_of(t), grad_scale_of(t));
      for (size_t i = 0; i < refs.size(); ++i) {
        const double decay = model.parameters[i]->weight_decay ? config.weight_decay : 0.0;
        refs[i].step(grads[i], lr_of(t), grad_scale_of(t), decay, config, t);
      }
    }
    auto state = state_by_name(optimizer);
    for (size_t i = 0; i < refs.size(); ++i) {
      const Parameter& p = *model.parameters[i];
      EXPECT_TRUE(all_close(p.value, refs[i].param, kStateTolerance)) << p.name;
      if (sc.momentum > 0) {
        EXPECT_TRUE(all_close(*state.at(p.name + ".momentum_buffer"), refs[i].buffer, kStateTolerance)) << p.name;
      } else {
        EXPECT_EQ(state.count(p.name + ".momentum_buffer"), 0u) << p.name;
      }
    }
  }
}

// bf16/f16 parameters: the optimizer updates an f32 master that must follow
// an f32 run on the same (representable) values and gradients bit for bit,
// and the value must be that master rounded; the master also matches the
// double reference.
void check_low_precision(const OptimizerConfig& config, DType dtype) {
  TESSERA_SEED_TRACE();
  SCOPED_TRACE(std::string(nn::optimizer_kind_name(config.kind)) + " " + std::string(dtype_name(dtype)));
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  Model low = make_model(ctx, dtype, rng, values);
  Model full = same_model_in(ctx, low, DType::f32);
  nn::Optimizer low_optimizer(low.pointers(), config);
  nn::Optimizer full_optimizer(full.pointers(), config);
  std::vector<AdamWReference> adamw_refs;
  std::vector<SgdReference> sgd_refs;
  for (const auto& v : values) {
    adamw_refs.push_back({v, std::vector<double>(v.size()), std::vector<double>(v.size())});
    sgd_refs.push_back({v, std::vector<double>(v.size())});
  }
  // Masters start as the values.
  auto low_state = state_by_name(low_optimizer);
  for (size_t i = 0; i < values.size(); ++i)
    EXPECT_EQ(low_state.at(low.parameters[i]->name + ".master")->to_doubles(), values[i]);
  EXPECT_EQ(state_by_name(full_optimizer).count(full.parameters[0]->name + ".master"), 0u) << "f32 needs no master";

  for (int t = 1; t <= kSteps; ++t) {
    const auto grads = fresh_grads(ctx, low, rng);  // shared with `full`
    low_optimizer.step(lr_of(t), grad_scale_of(t));
    full_optimizer.step(lr_of(t), grad_scale_of(t));
    for (size_t i = 0; i < values.size(); ++i) {
      const double decay = low.parameters[i]->weight_decay ? config.weight_decay : 0.0;
      adamw_refs[i].step(grads[i], lr_of(t), grad_scale_of(t), decay, config, t);
      sgd_refs[i].step(grads[i], lr_of(t), grad_scale_of(t), decay, config, t);
    }
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const Parameter& p = *low.parameters[i];
    const std::vector<double> master = low_state.at(p.name + ".master")->to_doubles();
    EXPECT_EQ(master, full.parameters[i]->value.to_doubles()) << p.name << ": master differs from the f32 run";
    EXPECT_EQ(p.value.dtype(), dtype);
    EXPECT_EQ(p.value.to_doubles(), round_to(dtype, master)) << p.name << ": value is not the rounded master";
    const auto& reference = config.kind == OptimizerKind::adamw ? adamw_refs[i].param : sgd_refs[i].param;
    EXPECT_TRUE(all_close(master, reference, kStateTolerance)) << p.name;
  }
}

TEST(Optimizer, LowPrecisionParametersKeepF32Masters) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    check_low_precision(adamw_config(), dtype);
    check_low_precision(sgd_config(0.9f, 0.1f, false), dtype);
  }
}

TEST(Optimizer, StateTensorNames) {
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  const auto names = [](nn::Optimizer& o) {
    std::vector<std::string> out;
    for (auto& [name, tensor] : o.state_tensors()) {
      out.push_back(name);
      EXPECT_EQ(tensor->dtype(), DType::f32) << name;
    }
    return out;
  };
  Model bf16 = make_model(ctx, DType::bf16, rng, values);
  Model f32 = make_model(ctx, DType::f32, rng, values);
  {
    nn::Optimizer o(bf16.pointers(), adamw_config());
    const auto n = names(o);
    ASSERT_EQ(n.size(), 3 * kShapes.size());
    EXPECT_EQ(n[0], "layer0.weight.exp_avg");
    EXPECT_EQ(n[1], "layer0.weight.exp_avg_sq");
    EXPECT_EQ(n[2], "layer0.weight.master");
    EXPECT_EQ(o.state_tensors()[2].second->shape(), kShapes[0]);
  }
  {
    nn::Optimizer o(f32.pointers(), sgd_config(0.9f, 0.0f, true));
    EXPECT_EQ(names(o), (std::vector<std::string>{"layer0.weight.momentum_buffer", "layer1.weight.momentum_buffer",
                                                  "layer2.weight.momentum_buffer"}));
  }
  {
    nn::Optimizer o(f32.pointers(), sgd_config(0.0f, 0.0f, false));
    EXPECT_TRUE(names(o).empty());
  }
}

TEST(Optimizer, ResumesFromStateTensors) {
  // Run A for kSteps steps; run B for two, copy B's state and step count into a
  // fresh optimizer C over copies of B's parameters (as a checkpoint would),
  // then continue C: it must end exactly where A does. bf16, so masters count.
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  Model a = make_model(ctx, DType::bf16, rng, values);
  Model b = same_model_in(ctx, a, DType::bf16);
  nn::Optimizer opt_a(a.pointers(), adamw_config());
  auto opt_b = std::make_unique<nn::Optimizer>(b.pointers(), adamw_config());
  for (int t = 1; t <= 2; ++t) {
    fresh_grads(ctx, a, rng);  // b shares a's gradients
    opt_a.step(lr_of(t), grad_scale_of(t));
    opt_b->step(lr_of(t), grad_scale_of(t));
  }
  // "Checkpoint": values and optimizer state to host copies; then a new model
  // whose values are deliberately wrong, restored from the checkpoint.
  std::map<std::string, std::vector<double>> saved;
  for (auto& [name, tensor] : opt_b->state_tensors()) saved[name] = tensor->to_doubles();
  const int64_t saved_step = opt_b->step_count();
  opt_b.reset();
  Model c = same_model_in(ctx, b, DType::bf16);
  for (auto& p : c.parameters) p->value.fill_(0.0);
  nn::Optimizer opt_c(c.pointers(), adamw_config());
  for (auto& [name, tensor] : opt_c.state_tensors())
    tensor->copy_(ctx.from_doubles(tensor->shape(), DType::f32, saved.at(name)));
  opt_c.set_step_count(saved_step);
  opt_c.values_from_masters();
  for (int t = 3; t <= kSteps; ++t) {
    fresh_grads(ctx, a, rng);  // c shares a's gradients too
    opt_a.step(lr_of(t), grad_scale_of(t));
    opt_c.step(lr_of(t), grad_scale_of(t));
  }
  auto state_a = state_by_name(opt_a), state_c = state_by_name(opt_c);
  for (const auto& [name, tensor] : state_a) EXPECT_EQ(tensor->to_doubles(), state_c.at(name)->to_doubles()) << name;
  for (size_t i = 0; i < a.parameters.size(); ++i)
    EXPECT_EQ(a.parameters[i]->value.to_doubles(), c.parameters[i]->value.to_doubles()) << a.parameters[i]->name;

  // masters_from_values: masters become the (new) values.
  c.parameters[1]->value.fill_(0.5);
  opt_c.masters_from_values();
  EXPECT_EQ(state_by_name(opt_c).at("layer1.weight.master")->to_doubles(),
            std::vector<double>(size_t(kShapes[1].numel()), 0.5));
}

// Runs f, which must throw tessera::Error whose message contains `needle`.
template <typename F>
void expect_error_naming(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(needle), std::string::npos) << "message: " << e.message();
  }
}

TEST(Optimizer, InvalidConfigNamesTheFlag) {
  const auto with = [](OptimizerConfig c, auto edit) {
    edit(c);
    return [c] { nn::validate(c); };
  };
  const OptimizerConfig adamw = adamw_config();
  const OptimizerConfig sgd = sgd_config(0.9f, 0.0f, false);
  expect_error_naming(with(adamw, [](auto& c) { c.lr = 0; }), "--lr");
  expect_error_naming(with(adamw, [](auto& c) { c.lr = std::numeric_limits<float>::quiet_NaN(); }), "--lr");
  expect_error_naming(with(sgd, [](auto& c) { c.lr = -1; }), "--lr");
  expect_error_naming(with(adamw, [](auto& c) { c.weight_decay = -0.1f; }), "--weight-decay");
  expect_error_naming(with(adamw, [](auto& c) { c.beta1 = 1.0f; }), "--adam-beta1");
  expect_error_naming(with(adamw, [](auto& c) { c.beta1 = -0.1f; }), "--adam-beta1");
  expect_error_naming(with(adamw, [](auto& c) { c.beta2 = 1.0f; }), "--adam-beta2");
  expect_error_naming(with(adamw, [](auto& c) { c.eps = 0.0f; }), "--adam-eps");
  expect_error_naming(with(adamw, [](auto& c) { c.weight_decay = 200.0f; }), "--weight-decay");
  expect_error_naming(with(sgd, [](auto& c) { c.momentum = -0.5f; }), "--sgd-momentum");
  expect_error_naming(with(sgd, [](auto& c) { c.momentum = 1.0f; }), "--sgd-momentum");
  expect_error_naming(with(sgd, [](auto& c) { c.dampening = 1.5f; }), "--dampening");
  expect_error_naming(with(sgd, [](auto& c) { c.nesterov = true, c.momentum = 0.0f; }), "--nesterov");
  expect_error_naming(with(sgd, [](auto& c) { c.nesterov = true, c.dampening = 0.1f; }), "--nesterov");
  expect_error_naming([] { nn::parse_optimizer_kind("adam"); }, "--optimizer");
  EXPECT_EQ(nn::parse_optimizer_kind("sgd"), OptimizerKind::sgd);
  EXPECT_EQ(nn::parse_optimizer_kind("adamw"), OptimizerKind::adamw);
  // The valid ones pass, and the constructor validates too.
  EXPECT_NO_THROW(nn::validate(adamw));
  EXPECT_NO_THROW(nn::validate(sgd));
  expect_error_naming(with(sgd, [](auto& c) { c.lr = 0; }), "--lr");
  Context ctx;
  expect_error_naming(
      [&] {
        OptimizerConfig bad = adamw;
        bad.beta2 = 2.0f;
        nn::Optimizer o({}, bad);
      },
      "--adam-beta2");
}

TEST(Optimizer, RejectsBadParametersAndSteps) {
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  Model model = make_model(ctx, DType::f32, rng, values);
  for (auto& p : model.parameters) p->grad.fill_(0.0);
  {
    auto ptrs = model.pointers();
    ptrs.push_back(ptrs[0]);
    expect_error_naming([&] { nn::Optimizer o(ptrs, adamw_config()); }, "layer0.weight");
  }
  {
    const auto make = [](std::string name, Tensor value, Tensor grad, bool decay) {
      Parameter p;
      p.name = std::move(name);
      p.value = value;
      p.grad = grad;
      p.weight_decay = decay;
      return p;
    };
    Parameter no_grad = make("head.bias", ctx.zeros(Shape{4}, DType::f32), Tensor(), false);
    expect_error_naming([&] { nn::Optimizer o({&no_grad}, adamw_config()); }, "head.bias");
    Parameter wrong_grad = make("head.weight", ctx.zeros(Shape{4}, DType::f32), ctx.zeros(Shape{5}, DType::f32), true);
    expect_error_naming([&] { nn::Optimizer o({&wrong_grad}, adamw_config()); }, "head.weight");
    Parameter bf16_grad = make("head.scale", ctx.zeros(Shape{4}, DType::bf16), ctx.zeros(Shape{4}, DType::bf16), true);
    expect_error_naming([&] { nn::Optimizer o({&bf16_grad}, adamw_config()); }, "head.scale");
  }
  nn::Optimizer optimizer(model.pointers(), adamw_config());
  expect_error_naming([&] { optimizer.step(-1e-3f); }, "learning rate");
  expect_error_naming([&] { optimizer.step(1e-3f, std::numeric_limits<float>::infinity()); }, "grad_scale");
  EXPECT_EQ(optimizer.step_count(), 0) << "a rejected step must not count";
  expect_error_naming([&] { optimizer.set_step_count(-1); }, "step count");
  optimizer.step(0.0f);  // lr 0 (a schedule's floor) is allowed
  EXPECT_EQ(optimizer.step_count(), 1);
}

// Gradient norm over several buffers of odd sizes against a double sum.
TEST(GradNorm, MatchesDoubleReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  Model model = make_model(ctx, DType::bf16, rng, values);
  const auto grads = fresh_grads(ctx, model, rng);
  double sum = 0;
  for (const auto& g : grads)
    for (double x : g) sum += x * x;
  const nn::GradNorm norm = nn::global_grad_norm(model.pointers());
  EXPECT_TRUE(norm.finite);
  EXPECT_NEAR(norm.norm, std::sqrt(sum), 1e-5 * std::sqrt(sum));

  // The device scalar before the square root.
  const Tensor total = nn::grad_sum_squares(model.pointers());
  ASSERT_EQ(total.numel(), 1);
  EXPECT_EQ(total.dtype(), DType::f32);
  EXPECT_NEAR(total.to_doubles()[0], sum, 2e-5 * sum);

  // One buffer alone.
  double first = 0;
  for (double x : grads[2]) first += x * x;
  EXPECT_NEAR(nn::global_grad_norm({model.parameters[2].get()}).norm, std::sqrt(first), 1e-5 * std::sqrt(first));
  // No parameters: norm 0.
  EXPECT_EQ(nn::global_grad_norm({}).norm, 0.0);
  EXPECT_TRUE(nn::global_grad_norm({}).finite);
}

TEST(GradNorm, DetectsNonFinite) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  for (double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    Model model = make_model(ctx, DType::f16, rng, values);
    auto grads = fresh_grads(ctx, model, rng);
    // One bad element in the middle buffer, at a random position.
    std::uniform_int_distribution<size_t> pick(0, grads[1].size() - 1);
    grads[1][pick(rng)] = bad;
    model.parameters[1]->grad.copy_(ctx.from_doubles(kShapes[1], DType::f32, grads[1]));
    EXPECT_FALSE(nn::global_grad_norm(model.pointers()).finite) << bad;
  }
}

TEST(GradNorm, ClipCoefficient) {
  auto rng = make_rng();
  std::uniform_real_distribution<double> dist(0.1, 10.0);
  for (int i = 0; i < 20; ++i) {
    const double norm = dist(rng), max_norm = dist(rng);
    const double expected = std::min(1.0, max_norm / (norm + 1e-6));
    EXPECT_NEAR(nn::clip_coefficient(norm, max_norm), expected, 1e-7 * expected) << norm << " " << max_norm;
  }
  EXPECT_EQ(nn::clip_coefficient(0.5, 1.0), 1.0f);  // below the threshold: unchanged
  EXPECT_EQ(nn::clip_coefficient(0.0, 1.0), 1.0f);
  EXPECT_FLOAT_EQ(nn::clip_coefficient(4.0, 1.0), float(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(nn::clip_coefficient(1e9, 0.0), 1.0f);  // max_norm ≤ 0: clipping off
  EXPECT_EQ(nn::clip_coefficient(1e9, -1.0), 1.0f);
  EXPECT_EQ(nn::clip_coefficient(std::numeric_limits<double>::infinity(), 1.0), 1.0f);
}

TEST(GradNorm, ClippingThroughGradScale) {
  // Clipping folded into grad_scale: an SGD step with grad_scale = coef moves
  // the parameters by exactly lr·coef·grad, and the clipped gradient's norm
  // is max_norm (up to the 1e-6 guard).
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  std::vector<std::vector<double>> values;
  Model model = make_model(ctx, DType::f32, rng, values);
  for (auto& p : model.parameters) p->weight_decay = false;
  const auto grads = fresh_grads(ctx, model, rng);
  const nn::GradNorm norm = nn::global_grad_norm(model.pointers());
  const double max_norm = norm.norm / 3;
  const float coef = nn::clip_coefficient(norm.norm, max_norm);
  const float lr = 0.1f;
  nn::Optimizer optimizer(model.pointers(), sgd_config(0.0f, 0.0f, false));
  optimizer.step(lr, coef);
  double moved = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const std::vector<double> now = model.parameters[i]->value.to_doubles();
    std::vector<double> expected(values[i]);
    for (size_t j = 0; j < now.size(); ++j) {
      expected[j] -= double(lr) * double(coef) * grads[i][j];
      moved += (values[i][j] - now[j]) * (values[i][j] - now[j]);
    }
    EXPECT_TRUE(all_close(now, expected, kStateTolerance));
  }
  EXPECT_NEAR(std::sqrt(moved) / lr, max_norm, 1e-4 * max_norm);
}

}  // namespace
}  // namespace tessera::testing
