// cast, scale_, axpy, add: forward against references (cast bit-exact
// against core/half.h rounding, including overflow, subnormals and NaN),
// backward against central differences of the linear maps (the gradients are
// computed with the operators themselves, as a trainer would), GPU against CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

const Shape kLargeShape{3, 1031, 17};
const Shape kSmallShape{7, 13};
const DType kFloatDtypes[] = {DType::f32, DType::bf16, DType::f16};

// Random values plus values that stress the conversions: beyond f16's range
// (to infinity), f16 subnormals, halfway cases, ±0 and infinities.
std::vector<double> cast_inputs(DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(-4.0, 4.0);
  std::vector<double> values(size_t(kLargeShape.numel()));
  for (double& v : values) v = dist(rng);
  const double specials[] = {1e5,
                             -7e4,
                             65504,
                             65520,
                             1e-6,
                             -3e-7,
                             6e-8,
                             1e-9,
                             1.0009765625 + 0.00048828125,
                             0.0,
                             -0.0,
                             3.0e38,
                             std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity()};
  for (size_t i = 0; i < std::size(specials); ++i) values[i * 97] = specials[i];
  return round_to(dtype, values);
}

class Cast : public DtypeTest {};  // parameter: the source dtype

TEST_P(Cast, Forward) {
  TESSERA_SEED_TRACE();
  const DType source = GetParam();
  Context ctx;
  auto rng = make_rng();
  const auto values = cast_inputs(source, rng);
  Tensor x = ctx.from_doubles(kLargeShape, source, values);
  for (const DType target : kFloatDtypes) {
    Tensor y = poisoned(ctx, kLargeShape, target);
    ops::cast(x, y);
    // round_to converts through float with core/half.h, round to nearest even.
    EXPECT_TRUE(all_close(y, round_to(target, values), {0, 0})) << source << " -> " << target;
    // Any shape with the same number of elements.
    Tensor flat = poisoned(ctx, Shape{kLargeShape.numel()}, target);
    ops::cast(x, flat);
    EXPECT_TRUE(all_close(flat, round_to(target, values), {0, 0})) << source << " -> " << target << " (flat)";
  }
  // NaN stays NaN.
  Tensor nan = ctx.full(Shape{5}, source, std::nan(""));
  for (const DType target : kFloatDtypes) {
    Tensor y = ctx.zeros(Shape{5}, target);
    ops::cast(nan, y);
    for (const double v : y.to_doubles()) EXPECT_TRUE(std::isnan(v)) << source << " -> " << target;
  }
}

TEST_P(Cast, Backward) {
  TESSERA_SEED_TRACE();
  const DType source = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kSmallShape, source, rng);
  for (const DType target : kFloatDtypes) {
    // d cast / dx is the identity: the gradient is grad_y cast back to the source dtype.
    auto grad_y = random_tensor(ctx, kSmallShape, target, rng);
    Tensor grad_x = poisoned(ctx, kSmallShape, source);
    ops::cast(grad_y.tensor, grad_x);
    const auto identity = [](const Inputs& in) { return in[0]; };
    const auto expected = numeric_gradient(identity, Inputs{x.values}, 0, grad_y.values);
    EXPECT_TRUE(all_close(grad_x, expected, backward_tolerance(source))) << source << " <- " << target;
  }
}

TEST_P(Cast, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType source = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  Tensor x = ctx.from_doubles(kLargeShape, source, cast_inputs(source, rng));
  for (const DType target : kFloatDtypes) {
    Tensor y_cpu = poisoned(ctx, kLargeShape, target), y_gpu = poisoned(ctx, kLargeShape, target, gpu);
    ops::cast(x, y_cpu);
    ops::cast(x.to(gpu), y_gpu);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, {0, 0})) << source << " -> " << target;  // the same rounding code
  }
}

INSTANTIATE_FLOAT_DTYPES(Cast);

std::vector<double> scaled(const std::vector<double>& x, double alpha) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = alpha * x[i];
  return y;
}
std::vector<double> sum_of(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> y(a.size());
  for (size_t i = 0; i < a.size(); ++i) y[i] = a[i] + b[i];
  return y;
}

class Scale : public DtypeTest {};

TEST_P(Scale, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  const float alpha = -1.37f;
  ops::scale_(x.tensor, alpha);
  EXPECT_TRUE(all_close(x.tensor, scaled(x.values, alpha), forward_tolerance(dtype)));
}

TEST_P(Scale, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kSmallShape, dtype, rng);
  auto grad = random_tensor(ctx, kSmallShape, dtype, rng);
  const float alpha = 0.61f;
  ops::scale_(grad.tensor, alpha);  // d(alpha·x)/dx applied to grad_y: scale it
  const auto f = [&](const Inputs& in) { return scaled(in[0], alpha); };
  EXPECT_TRUE(all_close(grad.tensor, numeric_gradient(f, Inputs{x.values}, 0, grad.values), backward_tolerance(dtype)));
}

TEST_P(Scale, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  Tensor on_gpu = x.tensor.to(Device::cuda(0));
  ops::scale_(x.tensor, 2.9f);
  ops::scale_(on_gpu, 2.9f);
  EXPECT_TRUE(all_close(on_gpu, x.tensor, device_tolerance(dtype)));
}

INSTANTIATE_FLOAT_DTYPES(Scale);

class Axpy : public DtypeTest {};

TEST_P(Axpy, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto y = random_tensor(ctx, Shape{kLargeShape.numel()}, dtype, rng, -4.0, 4.0);  // any shape, same count
  const float alpha = -0.73f;
  ops::axpy(alpha, x.tensor, y.tensor);
  EXPECT_TRUE(all_close(y.tensor, sum_of(y.values, scaled(x.values, alpha)), forward_tolerance(dtype)));
  // y may be x: x += alpha·x.
  ops::axpy(alpha, x.tensor, x.tensor);
  EXPECT_TRUE(all_close(x.tensor, scaled(x.values, 1.0 + double(alpha)), forward_tolerance(dtype)));
}

TEST_P(Axpy, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kSmallShape, dtype, rng);
  auto y = random_tensor(ctx, kSmallShape, dtype, rng);
  auto grad_out = random_tensor(ctx, kSmallShape, dtype, rng);
  const float alpha = 1.9f;
  const auto f = [&](const Inputs& in) { return sum_of(in[1], scaled(in[0], alpha)); };
  // grad_x = alpha·grad_out, accumulated into a zero gradient with axpy; grad_y = grad_out.
  Tensor grad_x = ctx.zeros(kSmallShape, dtype);
  ops::axpy(alpha, grad_out.tensor, grad_x);
  EXPECT_TRUE(all_close(grad_x, numeric_gradient(f, Inputs{x.values, y.values}, 0, grad_out.values),
                        backward_tolerance(dtype)));
  Tensor grad_y = ctx.zeros(kSmallShape, dtype);
  ops::axpy(1.0f, grad_out.tensor, grad_y);
  EXPECT_TRUE(all_close(grad_y, numeric_gradient(f, Inputs{x.values, y.values}, 1, grad_out.values),
                        backward_tolerance(dtype)));
}

TEST_P(Axpy, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto y = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  Tensor y_gpu = y.tensor.to(gpu);
  ops::axpy(0.37f, x.tensor, y.tensor);
  ops::axpy(0.37f, x.tensor.to(gpu), y_gpu);
  EXPECT_TRUE(all_close(y_gpu, y.tensor, device_tolerance(dtype)));
}

// A bf16/f16 (or f32) x added into an f32 y: how modules accumulate a
// low-precision parameter gradient into its f32 main gradient. The inputs are
// exact in f32, so one f32 multiply-add and one rounding: f32 tolerance.
TEST_P(Axpy, IntoF32) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto y = random_tensor(ctx, Shape{kLargeShape.numel()}, DType::f32, rng, -4.0, 4.0);
  const float alpha = 0.37f;
  ops::axpy(alpha, x.tensor, y.tensor);
  EXPECT_TRUE(all_close(y.tensor, sum_of(y.values, scaled(x.values, alpha)), forward_tolerance(DType::f32)));
}

TEST_P(Axpy, GpuIntoF32MatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto y = random_tensor(ctx, kLargeShape, DType::f32, rng, -4.0, 4.0);
  Tensor y_gpu = y.tensor.to(gpu);
  ops::axpy(-1.3f, x.tensor, y.tensor);
  ops::axpy(-1.3f, x.tensor.to(gpu), y_gpu);
  EXPECT_TRUE(all_close(y_gpu, y.tensor, device_tolerance(DType::f32)));
}

INSTANTIATE_FLOAT_DTYPES(Axpy);

class Add : public DtypeTest {};

TEST_P(Add, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto a = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto b = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  Tensor out = poisoned(ctx, kLargeShape, dtype);
  ops::add(a.tensor, b.tensor, out);
  const auto expected = sum_of(a.values, b.values);
  EXPECT_TRUE(all_close(out, expected, forward_tolerance(dtype)));
  // out may be a or b.
  Tensor a2 = a.tensor.clone(), b2 = b.tensor.clone();
  ops::add(a2, b.tensor, a2);
  EXPECT_TRUE(all_close(a2, expected, forward_tolerance(dtype))) << "out = a";
  ops::add(a.tensor, b2, b2);
  EXPECT_TRUE(all_close(b2, expected, forward_tolerance(dtype))) << "out = b";
}

TEST_P(Add, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  auto a = random_tensor(ctx, kSmallShape, dtype, rng);
  auto b = random_tensor(ctx, kSmallShape, dtype, rng);
  auto grad_out = random_tensor(ctx, kSmallShape, dtype, rng);
  const auto f = [](const Inputs& in) { return sum_of(in[0], in[1]); };
  // Both gradients are grad_out, accumulated onto existing gradients with add.
  for (size_t wrt : {size_t(0), size_t(1)}) {
    auto existing = random_tensor(ctx, kSmallShape, dtype, rng);
    Tensor grad = existing.tensor.clone();
    ops::add(grad, grad_out.tensor, grad);
    const auto expected =
        sum_of(existing.values, numeric_gradient(f, Inputs{a.values, b.values}, wrt, grad_out.values));
    EXPECT_TRUE(all_close(grad, expected, forward_tolerance(dtype))) << "input " << wrt;
  }
}

TEST_P(Add, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  auto a = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  auto b = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  Tensor out_cpu = poisoned(ctx, kLargeShape, dtype), out_gpu = poisoned(ctx, kLargeShape, dtype, gpu);
  ops::add(a.tensor, b.tensor, out_cpu);
  ops::add(a.tensor.to(gpu), b.tensor.to(gpu), out_gpu);
  EXPECT_TRUE(all_close(out_gpu, out_cpu, {0, 0}));  // one f32 addition, one rounding: no room to differ
}

INSTANTIATE_FLOAT_DTYPES(Add);

TEST(Blas1Arguments, RejectsBadArguments) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor ints = ctx.zeros(Shape{4, 5}, DType::i32);
  Tensor short_y = ctx.zeros(Shape{19}, DType::f32);
  Tensor bf16_y = ctx.zeros(Shape{4, 5}, DType::bf16);
  EXPECT_THROW(ops::cast(x, ints), Error);
  EXPECT_THROW(ops::cast(x, short_y), Error);
  EXPECT_THROW(ops::scale_(ints, 2.0f), Error);
  EXPECT_THROW(ops::axpy(1.0f, x, short_y), Error);
  EXPECT_THROW(ops::axpy(1.0f, x, bf16_y), Error);  // only a low-precision x into an f32 y mixes dtypes
  Tensor f16_y = ctx.zeros(Shape{4, 5}, DType::f16);
  EXPECT_THROW(ops::axpy(1.0f, bf16_y, f16_y), Error);
  EXPECT_THROW(ops::axpy(1.0f, ints, x), Error);
  EXPECT_THROW(ops::add(x, bf16_y, bf16_y), Error);
  EXPECT_THROW(ops::add(x, x, short_y), Error);
  // Partial overlaps are refused; a cast into different bytes of the same storage is fine.
  Tensor flat = ctx.zeros(Shape{40}, DType::f32);
  Tensor first = flat.slice(0, 20), shifted = flat.slice(10, 30), last = flat.slice(20, 40);
  EXPECT_THROW(ops::add(first, first, shifted), Error);
  EXPECT_THROW(ops::cast(first, shifted), Error);
  ops::cast(first, last);
  Tensor as_bf16 = ctx.zeros(Shape{20}, DType::bf16);
  Tensor same_bytes_bf16(first.storage(), first.offset_bytes(), Shape{20}, DType::bf16);
  EXPECT_THROW(ops::cast(first, same_bytes_bf16), Error);
  ops::cast(first, as_bf16);
}

}  // namespace
}  // namespace tessera::testing
