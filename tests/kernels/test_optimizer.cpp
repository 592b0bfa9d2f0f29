// Fused optimizer steps: several AdamW and SGD steps against double-precision
// implementations of PyTorch's update rules (torch.optim.AdamW, torch.optim.SGD)
// written here, with weight decay, grad_scale and a low-precision param_copy;
// GPU against CPU. Parameterised over the gradient's dtype (param_copy uses
// the same dtype). Optimizers have no backward pass.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

const Shape kShape{50021};  // odd, and larger than one thread's grain
constexpr int kSteps = 4;

// The state is f32 and updated in f32 for a few steps: a few f32 roundings
// of values of order one (param) or of the update (m, v) accumulate.
const Tolerance kStateTolerance{2e-5, 1e-6};

// AdamW's hyper-parameters as torch.optim.AdamW holds them (Python floats),
// kept apart from ops::AdamWParams so that the reference never sees a value
// rounded to that struct's types.
struct AdamWSettings {
  double lr, beta1, beta2, eps, weight_decay;
  float grad_scale;
  ops::AdamWParams at_step(int64_t step) const {
    return {.lr = lr,
            .beta1 = beta1,
            .beta2 = beta2,
            .eps = eps,
            .weight_decay = weight_decay,
            .step = step,
            .grad_scale = grad_scale};
  }
};

// torch.optim.AdamW (torch/optim/adam.py, _single_tensor_adam, the CPU
// default; the foreach path computes the same scalars): the step's scalars
// in Python, in double from the double hyper-parameters, each handed to an
// f32 tensor operation and so rounded to f32 there; the per-element
// arithmetic here in double.
struct AdamWReference {
  std::vector<double> param, m, v;
  void step(const std::vector<double>& grad, const AdamWSettings& h, int64_t step_number) {
    const auto f32 = [](double x) { return double(float(x)); };
    const double step = double(step_number);
    const double bias_correction1 = 1 - std::pow(h.beta1, step);
    const double bias_correction2 = 1 - std::pow(h.beta2, step);
    const double step_size = h.lr / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    const double decay = f32(1 - h.lr * h.weight_decay);  // param.mul_(1 - lr * weight_decay)
    const double lerp_weight = f32(1 - h.beta1);          // exp_avg.lerp_(grad, 1 - beta1)
    const double beta2 = f32(h.beta2),
                 value = f32(1 - h.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    const double divisor = f32(bias_correction2_sqrt), eps = f32(h.eps);  // (exp_avg_sq.sqrt() / ...).add_(eps)
    const double update = f32(-step_size);  // param.addcdiv_(exp_avg, denom, value=-step_size)
    for (size_t i = 0; i < param.size(); ++i) {
      const double g = grad[i] * double(h.grad_scale);
      param[i] *= decay;
      m[i] += lerp_weight * (g - m[i]);
      v[i] = v[i] * beta2 + value * g * g;
      const double denom = std::sqrt(v[i]) / divisor + eps;
      param[i] += update * m[i] / denom;
    }
  }
};

struct SgdReference {
  std::vector<double> param, buffer;
  void step(const std::vector<double>& grad, const ops::SgdParams& p) {
    for (size_t i = 0; i < param.size(); ++i) {
      double g = grad[i] * double(p.grad_scale) + double(p.weight_decay) * param[i];
      if (p.momentum != 0.0f) {
        buffer[i] = p.first_step ? g : double(p.momentum) * buffer[i] + (1 - double(p.dampening)) * g;
        g = p.nesterov ? g + double(p.momentum) * buffer[i] : buffer[i];
      }
      param[i] -= double(p.lr) * g;
    }
  }
};

// Initial f32 parameters in [-2, 2) and kSteps gradients of `dtype` in [-1, 1), fresh.
struct StepInputs {
  std::vector<double> initial;
  std::vector<RandomTensor> grads;
};
StepInputs random_step_inputs(Context& ctx, DType dtype, std::mt19937_64& rng) {
  StepInputs inputs{random_tensor(ctx, kShape, DType::f32, rng, -2.0, 2.0).values, {}};
  for (int s = 0; s < kSteps; ++s) inputs.grads.push_back(random_tensor(ctx, kShape, dtype, rng, -1.0, 1.0));
  return inputs;
}

// β1 = 0.9, and β1 = 0.3 (a moment weight 1 − β1 ≥ ½).
constexpr AdamWSettings kAdamWCases[] = {{1e-2, 0.9, 0.99, 1e-8, 0.1, 0.5f}, {1e-2, 0.3, 0.99, 1e-8, 0.1, 0.5f}};

// Runs kSteps AdamW steps on `device` from the given initial values; the
// gradient of step s is grads[s]. The first step writes no param_copy.
struct AdamWRun {
  Tensor param, m, v, copy;
};
AdamWRun run_adamw(Context& ctx, Device device, DType dtype, const AdamWSettings& settings,
                   const std::vector<double>& initial, const std::vector<RandomTensor>& grads) {
  AdamWRun run{ctx.from_doubles(kShape, DType::f32, initial, device), ctx.zeros(kShape, DType::f32, device),
               ctx.zeros(kShape, DType::f32, device), poisoned(ctx, kShape, dtype, device)};
  for (int s = 0; s < kSteps; ++s)
    ops::adamw_step(run.param, grads[size_t(s)].tensor.to(device), run.m, run.v, settings.at_step(s + 1),
                    s == 0 ? nullptr : &run.copy);
  return run;
}

class AdamW : public DtypeTest {};

TEST_P(AdamW, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const AdamWSettings& settings : kAdamWCases) {
    SCOPED_TRACE("beta1 " + std::to_string(settings.beta1));
    const auto [initial, grads] = random_step_inputs(ctx, dtype, rng);
    const AdamWRun run = run_adamw(ctx, Device::cpu(), dtype, settings, initial, grads);

    AdamWReference reference{initial, std::vector<double>(initial.size()), std::vector<double>(initial.size())};
    for (int s = 0; s < kSteps; ++s) reference.step(grads[size_t(s)].values, settings, s + 1);
    EXPECT_TRUE(all_close(run.param, reference.param, kStateTolerance)) << "param";
    EXPECT_TRUE(all_close(run.m, reference.m, kStateTolerance)) << "m";
    EXPECT_TRUE(all_close(run.v, reference.v, kStateTolerance)) << "v";
    // The copy is the updated f32 parameter rounded to its dtype.
    EXPECT_TRUE(all_close(run.copy, round_to(dtype, run.param.to_doubles()), {0, 0})) << "param_copy";
  }
}

TEST_P(AdamW, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  auto rng = make_rng();
  for (const AdamWSettings& settings : kAdamWCases) {
    SCOPED_TRACE("beta1 " + std::to_string(settings.beta1));
    const auto [initial, grads] = random_step_inputs(ctx, dtype, rng);
    const AdamWRun cpu = run_adamw(ctx, Device::cpu(), dtype, settings, initial, grads);
    const AdamWRun gpu = run_adamw(ctx, Device::cuda(0), dtype, settings, initial, grads);
    // The GPU may contract a·b + c into one fma: the f32 state differs in the last bits.
    EXPECT_TRUE(all_close(gpu.param, cpu.param, kStateTolerance)) << "param";
    EXPECT_TRUE(all_close(gpu.m, cpu.m, kStateTolerance)) << "m";
    EXPECT_TRUE(all_close(gpu.v, cpu.v, kStateTolerance)) << "v";
    EXPECT_TRUE(all_close(gpu.copy, cpu.copy, device_tolerance(dtype))) << "param_copy";
  }
}

INSTANTIATE_FLOAT_DTYPES(AdamW);

// 2000 steps with Megatron's β2 = 0.95 and the default 0.999: torch
// computes 1 − β^step and the moments' weights 1 − β from β in double, so
// holding β in f32 (0.999f = 0.99900001287) shifts the second moment's weight
// 1 − β by 1.3e-5 of itself, and β^2000 by 2.6e-5: the moments drift from
// torch's by ~1e-5, two orders above the f32 rounding of the update itself.
TEST(AdamWLongRun, MatchesTorchsDoubleScalarsOver2000Steps) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const Shape shape{257};
  constexpr int kLongSteps = 2000;
  for (const double beta2 : {0.95, 0.999}) {
    SCOPED_TRACE("beta2 " + std::to_string(beta2));
    const auto initial = random_tensor(ctx, shape, DType::f32, rng, -1.0, 1.0).values;
    Tensor param = ctx.from_doubles(shape, DType::f32, initial), m = ctx.zeros(shape, DType::f32),
           v = ctx.zeros(shape, DType::f32);
    AdamWReference reference{initial, std::vector<double>(initial.size()), std::vector<double>(initial.size())};
    const AdamWSettings settings{3e-4, 0.9, beta2, 1e-8, 0.1, 1.0f};
    for (int s = 1; s <= kLongSteps; ++s) {
      const RandomTensor grad = random_tensor(ctx, shape, DType::f32, rng, -1.0, 1.0);
      ops::adamw_step(param, grad.tensor, m, v, settings.at_step(s));
      reference.step(grad.values, settings, s);
    }
    // The f32 rounding of 2000 updates: a random walk of ~1e-6 (β2 = 0.999
    // remembers ~1000 steps) in the second moment, of a few 1e-6 in the
    // parameters (values of order one rounded each step); no drift on average.
    EXPECT_TRUE(all_close(v, reference.v, {5e-6, 0})) << "v";
    EXPECT_TRUE(all_close(m, reference.m, {0, 5e-7})) << "m";
    EXPECT_TRUE(all_close(param, reference.param, {0, 2e-5})) << "param";
    const std::vector<double> v_values = v.to_doubles();
    double mean_relative_error = 0;
    for (size_t i = 0; i < v_values.size(); ++i)
      mean_relative_error += (v_values[i] - reference.v[i]) / reference.v[i] / double(v_values.size());
    EXPECT_LT(std::abs(mean_relative_error), 1e-6) << "the second moment drifts from torch's";
  }
}

struct SgdCase {
  const char* name;
  float momentum, dampening, weight_decay;
  bool nesterov;
};
const SgdCase kSgdCases[] = {
    {"plain", 0.0f, 0.0f, 0.01f, false},
    {"momentum+dampening", 0.9f, 0.1f, 0.01f, false},
    {"nesterov", 0.9f, 0.0f, 0.01f, true},
};

ops::SgdParams sgd_params(const SgdCase& c, int step) {
  ops::SgdParams p;
  p.lr = 0.05f;
  p.momentum = c.momentum;
  p.dampening = c.dampening;
  p.weight_decay = c.weight_decay;
  p.nesterov = c.nesterov;
  p.first_step = step == 0;
  p.grad_scale = 2.0f;
  return p;
}

struct SgdRun {
  Tensor param, buffer, copy;
};
// kSteps steps; without momentum the buffer is an undefined tensor (it is unused).
SgdRun run_sgd(Context& ctx, Device device, DType dtype, const SgdCase& c, const std::vector<double>& initial,
               const std::vector<RandomTensor>& grads) {
  SgdRun run{ctx.from_doubles(kShape, DType::f32, initial, device),
             c.momentum != 0.0f ? poisoned(ctx, kShape, DType::f32, device) : Tensor(),
             poisoned(ctx, kShape, dtype, device)};
  for (int s = 0; s < kSteps; ++s)
    ops::sgd_step(run.param, grads[size_t(s)].tensor.to(device), run.buffer, sgd_params(c, s), &run.copy);
  return run;
}

class Sgd : public DtypeTest {};

TEST_P(Sgd, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const SgdCase& c : kSgdCases) {
    SCOPED_TRACE(c.name);
    const auto [initial, grads] = random_step_inputs(ctx, dtype, rng);
    // The buffer starts poisoned: first_step must overwrite it, never read it.
    const SgdRun run = run_sgd(ctx, Device::cpu(), dtype, c, initial, grads);
    SgdReference reference{initial, std::vector<double>(initial.size())};
    for (int s = 0; s < kSteps; ++s) reference.step(grads[size_t(s)].values, sgd_params(c, s));
    EXPECT_TRUE(all_close(run.param, reference.param, kStateTolerance)) << "param";
    if (c.momentum != 0.0f) {
      EXPECT_TRUE(all_close(run.buffer, reference.buffer, kStateTolerance)) << "buffer";
    }
    EXPECT_TRUE(all_close(run.copy, round_to(dtype, run.param.to_doubles()), {0, 0})) << "param_copy";
  }
}

TEST_P(Sgd, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  auto rng = make_rng();
  for (const SgdCase& c : kSgdCases) {
    SCOPED_TRACE(c.name);
    const auto [initial, grads] = random_step_inputs(ctx, dtype, rng);
    const SgdRun cpu = run_sgd(ctx, Device::cpu(), dtype, c, initial, grads);
    const SgdRun gpu = run_sgd(ctx, Device::cuda(0), dtype, c, initial, grads);
    EXPECT_TRUE(all_close(gpu.param, cpu.param, kStateTolerance)) << "param";
    if (c.momentum != 0.0f) {
      EXPECT_TRUE(all_close(gpu.buffer, cpu.buffer, kStateTolerance)) << "buffer";
    }
    EXPECT_TRUE(all_close(gpu.copy, cpu.copy, device_tolerance(dtype))) << "param_copy";
  }
}

INSTANTIATE_FLOAT_DTYPES(Sgd);

TEST(OptimizerArguments, RejectsBadArguments) {
  Context ctx;
  const Shape shape{10};
  Tensor param = ctx.zeros(shape, DType::f32), grad = ctx.zeros(shape, DType::bf16);
  Tensor m = ctx.zeros(shape, DType::f32), v = ctx.zeros(shape, DType::f32);
  Tensor bf16_param = ctx.zeros(shape, DType::bf16);
  EXPECT_THROW(ops::adamw_step(bf16_param, grad, m, v, {}), Error);
  Tensor short_m = ctx.zeros(Shape{9}, DType::f32);
  EXPECT_THROW(ops::adamw_step(param, grad, short_m, v, {}), Error);
  ops::AdamWParams step0;
  step0.step = 0;
  EXPECT_THROW(ops::adamw_step(param, grad, m, v, step0), Error);
  Tensor int_copy = ctx.zeros(shape, DType::i32);
  EXPECT_THROW(ops::adamw_step(param, grad, m, v, {}, &int_copy), Error);
  ops::adamw_step(param, grad, m, v, {});  // valid arguments pass

  ops::SgdParams momentum;
  momentum.momentum = 0.9f;
  Tensor none;
  EXPECT_THROW(ops::sgd_step(param, grad, none, momentum), Error);  // momentum needs a buffer
  ops::SgdParams nesterov = momentum;
  nesterov.nesterov = true;
  nesterov.dampening = 0.1f;
  EXPECT_THROW(ops::sgd_step(param, grad, m, nesterov), Error);
  Tensor int_grad = ctx.zeros(shape, DType::i64);
  EXPECT_THROW(ops::sgd_step(param, int_grad, m, {}), Error);
  ops::sgd_step(param, grad, none, {});  // no momentum: no buffer needed
}

}  // namespace
}  // namespace tessera::testing
