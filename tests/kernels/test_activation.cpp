// ReLU, GELU and SwiGLU: forward against a double reference, backward against
// central differences of that reference, GPU against CPU. Every dtype, odd
// sizes. SwiGLU also in place (grad_x = x) and with its argument checks.
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

// SwiGLU: x [R, 2F] holds [gate | up] per row; y [R, F] = silu(gate)·up.
std::vector<double> swiglu_reference(const std::vector<double>& x, int64_t width) {
  std::vector<double> y(x.size() / 2);
  for (size_t i = 0; i < y.size(); ++i) {
    const size_t row = i / size_t(width), f = i % size_t(width);
    const double gate = x[row * 2 * size_t(width) + f], up = x[row * 2 * size_t(width) + size_t(width) + f];
    y[i] = gate / (1.0 + std::exp(-gate)) * up;
  }
  return y;
}

// Rows across the CPU's threading grain with an odd F; a 3-D input; F = 1.
const Shape kSwigluShapes[] = {Shape{3, 1031, 2 * 17}, Shape{2, 5, 2 * 64}, Shape{9, 2}};

class Swiglu : public DtypeTest {};

TEST_P(Swiglu, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Shape& shape : kSwigluShapes) {
    SCOPED_TRACE(shape.to_string());
    const int64_t width = shape[-1] / 2;
    auto x = random_tensor(ctx, shape, dtype, rng, -6.0, 6.0);
    Tensor y = poisoned(ctx, shape.with_dim(-1, width), dtype);
    ops::swiglu_forward(x.tensor, y);
    EXPECT_TRUE(all_close(y, swiglu_reference(x.values, width), forward_tolerance(dtype)));
  }
}

// grad_x of SwiGLU by central differences of the double forward, element by
// element (each output depends on its own gate and up only), so that shapes
// too large for numeric_gradient's full sweep can be checked.
std::vector<double> swiglu_gradient_by_differences(const std::vector<double>& x, const std::vector<double>& grad_y,
                                                   int64_t width) {
  const auto gated = [](double gate, double up) { return gate / (1.0 + std::exp(-gate)) * up; };
  constexpr double kStep = 1e-4;
  std::vector<double> grad_x(x.size());
  for (size_t i = 0; i < grad_y.size(); ++i) {
    const size_t gate = i / size_t(width) * 2 * size_t(width) + i % size_t(width), up = gate + size_t(width);
    const double a = x[gate], u = x[up];
    grad_x[gate] = grad_y[i] * (gated(a + kStep, u) - gated(a - kStep, u)) / (2 * kStep);
    grad_x[up] = grad_y[i] * (gated(a, u + kStep) - gated(a, u - kStep)) / (2 * kStep);
  }
  return grad_x;
}

// Against central differences of the double forward: element by element on
// every shape (the forward's too, whose rows cross the CPU's threading grain),
// and the whole sweep of numeric_gradient on the small ones; in place too.
TEST_P(Swiglu, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Shape& shape :
       {Shape{7, 2 * 13}, Shape{2, 3, 2 * 5}, kSwigluShapes[0], kSwigluShapes[1], kSwigluShapes[2]}) {
    SCOPED_TRACE(shape.to_string());
    const int64_t width = shape[-1] / 2;
    auto x = random_tensor(ctx, shape, dtype, rng, -6.0, 6.0);
    auto grad_y = random_tensor(ctx, shape.with_dim(-1, width), dtype, rng);
    Tensor grad_x = poisoned(ctx, shape, dtype);
    ops::swiglu_backward(x.tensor, grad_y.tensor, grad_x);
    const auto expected = swiglu_gradient_by_differences(x.values, grad_y.values, width);
    EXPECT_TRUE(all_close(grad_x, expected, backward_tolerance(dtype)));
    if (shape.numel() <= 1024) {
      const auto f = [&](const Inputs& in) { return swiglu_reference(in[0], width); };
      EXPECT_TRUE(all_close(grad_x, numeric_gradient(f, Inputs{x.values}, 0, grad_y.values), backward_tolerance(dtype)))
          << "numeric_gradient";
    }
    // In place: grad_x may be x (the activations are not needed after the backward).
    ops::swiglu_backward(x.tensor, grad_y.tensor, x.tensor);
    EXPECT_TRUE(all_close(x.tensor, expected, backward_tolerance(dtype))) << "in place";
  }
}

TEST_P(Swiglu, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const Shape& shape : kSwigluShapes) {
    SCOPED_TRACE(shape.to_string());
    const Shape half = shape.with_dim(-1, shape[-1] / 2);
    auto x = random_tensor(ctx, shape, dtype, rng, -6.0, 6.0);
    auto grad_y = random_tensor(ctx, half, dtype, rng);
    Tensor y_cpu = poisoned(ctx, half, dtype), y_gpu = poisoned(ctx, half, dtype, gpu);
    ops::swiglu_forward(x.tensor, y_cpu);
    ops::swiglu_forward(x.tensor.to(gpu), y_gpu);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, device_tolerance(dtype))) << "forward";
    Tensor gx_cpu = poisoned(ctx, shape, dtype), gx_gpu = poisoned(ctx, shape, dtype, gpu);
    ops::swiglu_backward(x.tensor, grad_y.tensor, gx_cpu);
    ops::swiglu_backward(x.tensor.to(gpu), grad_y.tensor.to(gpu), gx_gpu);
    EXPECT_TRUE(all_close(gx_gpu, gx_cpu, device_tolerance(dtype))) << "backward";
  }
}

TEST_P(Swiglu, RejectsBadArguments) {
  const DType dtype = GetParam();
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 10}, dtype), y = ctx.zeros(Shape{4, 5}, dtype), grad_x = ctx.zeros(Shape{4, 10}, dtype);
  EXPECT_NO_THROW(ops::swiglu_forward(x, y));
  EXPECT_NO_THROW(ops::swiglu_backward(x, y, grad_x));
  Tensor odd = ctx.zeros(Shape{4, 9}, dtype), odd_y = ctx.zeros(Shape{4, 4}, dtype);
  EXPECT_THROW(ops::swiglu_forward(odd, odd_y), Error);  // no [gate | up] split
  Tensor full_width = ctx.zeros(Shape{4, 10}, dtype);
  EXPECT_THROW(ops::swiglu_forward(x, full_width), Error);  // y must be [.., F]
  Tensor other_dtype = ctx.zeros(Shape{4, 5}, dtype == DType::f32 ? DType::bf16 : DType::f32);
  EXPECT_THROW(ops::swiglu_forward(x, other_dtype), Error);
  EXPECT_THROW(ops::swiglu_backward(x, full_width, grad_x), Error);  // grad_y must be [.., F]
  EXPECT_THROW(ops::swiglu_backward(x, y, y), Error);                // grad_x must be [.., 2F]
  Tensor first_half = x.flatten().slice(0, 20).view(Shape{4, 5});
  EXPECT_THROW(ops::swiglu_forward(x, first_half), Error);  // y overlapping x
  Tensor storage = ctx.zeros(Shape{48}, dtype);
  const Tensor input = storage.slice(0, 40).view(Shape{4, 10});
  Tensor shifted = storage.slice(8, 48).view(Shape{4, 10});
  EXPECT_THROW(ops::swiglu_backward(input, y, shifted), Error);  // grad_x partly over x
}

INSTANTIATE_FLOAT_DTYPES(Swiglu);

}  // namespace
}  // namespace tessera::testing
