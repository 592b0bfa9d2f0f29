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

struct AdamWReference {
  std::vector<double> param, m, v;
  void step(const std::vector<double>& grad, const ops::AdamWParams& p) {
    const double bias1 = 1 - std::pow(double(p.beta1), double(p.step));
    const double bias2 = 1 - std::pow(double(p.beta2), double(p.step));
    for (size_t i = 0; i < param.size(); ++i) {
      const double g = grad[i] * double(p.grad_scale);
      param[i] *= 1 - double(p.lr) * double(p.weight_decay);
      m[i] = double(p.beta1) * m[i] + (1 - double(p.beta1)) * g;
      v[i] = double(p.beta2) * v[i] + (1 - double(p.beta2)) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(bias2) + double(p.eps);
      param[i] -= double(p.lr) / bias1 * m[i] / denom;
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

ops::AdamWParams adamw_params(int64_t step) {
  ops::AdamWParams p;
  p.lr = 1e-2f;
  p.beta1 = 0.9f;
  p.beta2 = 0.99f;
  p.eps = 1e-8f;
  p.weight_decay = 0.1f;
  p.grad_scale = 0.5f;
  p.step = step;
  return p;
}

// Runs kSteps AdamW steps on `device` from the given initial values; the
// gradient of step s is grads[s]. The first step writes no param_copy.
struct AdamWRun {
  Tensor param, m, v, copy;
};
AdamWRun run_adamw(Context& ctx, Device device, DType dtype, const std::vector<double>& initial,
                   const std::vector<RandomTensor>& grads) {
  AdamWRun run{ctx.from_doubles(kShape, DType::f32, initial, device), ctx.zeros(kShape, DType::f32, device),
               ctx.zeros(kShape, DType::f32, device), poisoned(ctx, kShape, dtype, device)};
  for (int s = 0; s < kSteps; ++s)
    ops::adamw_step(run.param, grads[size_t(s)].tensor.to(device), run.m, run.v, adamw_params(s + 1),
                    s == 0 ? nullptr : &run.copy);
  return run;
}

class AdamW : public DtypeTest {};

TEST_P(AdamW, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const auto initial = random_tensor(ctx, kShape, DType::f32, rng, -2.0, 2.0).values;
  std::vector<RandomTensor> grads;
  for (int s = 0; s < kSteps; ++s) grads.push_back(random_tensor(ctx, kShape, dtype, rng, -1.0, 1.0));
  const AdamWRun run = run_adamw(ctx, Device::cpu(), dtype, initial, grads);

  AdamWReference reference{initial, std::vector<double>(initial.size()), std::vector<double>(initial.size())};
  for (int s = 0; s < kSteps; ++s) reference.step(grads[size_t(s)].values, adamw_params(s + 1));
  EXPECT_TRUE(all_close(run.param, reference.param, kStateTolerance)) << "param";
  EXPECT_TRUE(all_close(run.m, reference.m, kStateTolerance)) << "m";
  EXPECT_TRUE(all_close(run.v, reference.v, kStateTolerance)) << "v";
  // The copy is the updated f32 parameter rounded to its dtype.
  EXPECT_TRUE(all_close(run.copy, round_to(dtype, run.param.to_doubles()), {0, 0})) << "param_copy";
}

TEST_P(AdamW, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  auto rng = make_rng();
  const auto initial = random_tensor(ctx, kShape, DType::f32, rng, -2.0, 2.0).values;
  std::vector<RandomTensor> grads;
  for (int s = 0; s < kSteps; ++s) grads.push_back(random_tensor(ctx, kShape, dtype, rng, -1.0, 1.0));
  const AdamWRun cpu = run_adamw(ctx, Device::cpu(), dtype, initial, grads);
  const AdamWRun gpu = run_adamw(ctx, Device::cuda(0), dtype, initial, grads);
  // The GPU may contract a·b + c into one fma: the f32 state differs in the last bits.
  EXPECT_TRUE(all_close(gpu.param, cpu.param, kStateTolerance)) << "param";
  EXPECT_TRUE(all_close(gpu.m, cpu.m, kStateTolerance)) << "m";
  EXPECT_TRUE(all_close(gpu.v, cpu.v, kStateTolerance)) << "v";
  EXPECT_TRUE(all_close(gpu.copy, cpu.copy, device_tolerance(dtype))) << "param_copy";
}

INSTANTIATE_FLOAT_DTYPES(AdamW);

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
    const auto initial = random_tensor(ctx, kShape, DType::f32, rng, -2.0, 2.0).values;
    std::vector<RandomTensor> grads;
    for (int s = 0; s < kSteps; ++s) grads.push_back(random_tensor(ctx, kShape, dtype, rng, -1.0, 1.0));
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
    const auto initial = random_tensor(ctx, kShape, DType::f32, rng, -2.0, 2.0).values;
    std::vector<RandomTensor> grads;
    for (int s = 0; s < kSteps; ++s) grads.push_back(random_tensor(ctx, kShape, dtype, rng, -1.0, 1.0));
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
