// ReLU and GELU: forward against a double reference, backward against central
// differences of that reference, GPU against CPU. Every dtype, odd sizes.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

double gelu_reference(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}
double relu_reference(double x) {
  return x > 0 ? x : 0;
}

std::vector<double> map_values(double (*f)(double), const std::vector<double>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = f(x[i]);
  return y;
}

struct Activation {
  const char* name;
  double (*reference)(double);
  void (*forward)(const Tensor&, Tensor&);
  void (*backward)(const Tensor&, const Tensor&, Tensor&);
};
const Activation kRelu{"relu", relu_reference, ops::relu_forward, ops::relu_backward};
const Activation kGelu{"gelu", gelu_reference, ops::gelu_forward, ops::gelu_backward};

// Large enough to cross the CPU's threading grain, odd so no vector width divides it.
const Shape kLargeShape{3, 1031, 17};
const Shape kSmallShape{7, 13};

void check_forward(const Activation& act, DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  Tensor y = poisoned(ctx, kLargeShape, dtype);
  act.forward(x.tensor, y);
  EXPECT_TRUE(all_close(y, map_values(act.reference, x.values), forward_tolerance(dtype))) << act.name;

  // In place: y may be x.
  act.forward(x.tensor, x.tensor);
  EXPECT_TRUE(all_close(x.tensor, map_values(act.reference, x.values), forward_tolerance(dtype)))
      << act.name << " in place";
}

void check_backward(const Activation& act, DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kSmallShape, dtype, rng, -4.0, 4.0);
  auto grad_y = random_tensor(ctx, kSmallShape, dtype, rng, -1.0, 1.0);
  Tensor grad_x = poisoned(ctx, kSmallShape, dtype);
  act.backward(x.tensor, grad_y.tensor, grad_x);
  const auto f = [&](const Inputs& in) { return map_values(act.reference, in[0]); };
  const auto expected = numeric_gradient(f, Inputs{x.values}, 0, grad_y.values);
  EXPECT_TRUE(all_close(grad_x, expected, backward_tolerance(dtype))) << act.name;
}

void check_gpu(const Activation& act, DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto grad_y = random_tensor(ctx, kLargeShape, dtype, rng, -1.0, 1.0);
  Tensor y_cpu = poisoned(ctx, kLargeShape, dtype), y_gpu = poisoned(ctx, kLargeShape, dtype, gpu);
  act.forward(x.tensor, y_cpu);
  act.forward(x.tensor.to(gpu), y_gpu);
  EXPECT_TRUE(all_close(y_gpu, y_cpu, device_tolerance(dtype))) << act.name << " forward";
  Tensor gx_cpu = poisoned(ctx, kLargeShape, dtype), gx_gpu = poisoned(ctx, kLargeShape, dtype, gpu);
  act.backward(x.tensor, grad_y.tensor, gx_cpu);
  act.backward(x.tensor.to(gpu), grad_y.tensor.to(gpu), gx_gpu);
  EXPECT_TRUE(all_close(gx_gpu, gx_cpu, device_tolerance(dtype))) << act.name << " backward";
}

class Relu : public DtypeTest {};
TEST_P(Relu, Forward) {
  check_forward(kRelu, GetParam());
}
TEST_P(Relu, Backward) {
  check_backward(kRelu, GetParam());
}
TEST_P(Relu, GpuMatchesCpu) {
  check_gpu(kRelu, GetParam());
}
INSTANTIATE_FLOAT_DTYPES(Relu);

class Gelu : public DtypeTest {};
TEST_P(Gelu, Forward) {
  check_forward(kGelu, GetParam());
}
TEST_P(Gelu, Backward) {
  check_backward(kGelu, GetParam());
}
TEST_P(Gelu, GpuMatchesCpu) {
  check_gpu(kGelu, GetParam());
}
INSTANTIATE_FLOAT_DTYPES(Gelu);

TEST(Activation, RejectsMismatchedShapes) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32), y = ctx.zeros(Shape{4, 6}, DType::f32);
  EXPECT_THROW(ops::gelu_forward(x, y), Error);
  Tensor z = ctx.zeros(Shape{4, 5}, DType::bf16);
  EXPECT_THROW(ops::relu_forward(x, z), Error);
}

}  // namespace
}  // namespace tessera::testing
