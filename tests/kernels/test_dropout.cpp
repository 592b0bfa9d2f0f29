// Dropout: the mask is the contract of ops.h (keep(i) = U(seed, kDropoutRngStream,
// offset + i) ≥ p), recomputed here from core/rng.h; forward checks its
// statistics, the kept values, reproducibility and the offset (sharding)
// rule; backward against central differences with the mask fixed; GPU exact.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

const Shape kLargeShape{3, 1031, 17};
const Shape kSmallShape{7, 13};

// keep(i) compares with p as the operator receives it (a float).
std::vector<bool> reference_mask(size_t n, double p, uint64_t seed, uint64_t offset) {
  const double p_float = double(float(p));
  std::vector<bool> keep(n);
  for (size_t i = 0; i < n; ++i) keep[i] = double(philox_uniform(seed, ops::kDropoutRngStream, offset + i)) >= p_float;
  return keep;
}

std::vector<double> apply_mask(const std::vector<double>& x, const std::vector<bool>& keep, double p) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = keep[i] ? x[i] / (1.0 - p) : 0.0;
  return y;
}

bool identical(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i])) return false;
  return x.size() == y.size();
}

class Dropout : public DtypeTest {};

TEST_P(Dropout, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const uint64_t seed = rng(), offset = rng() >> 8;
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  const size_t n = x.values.size();

  // p = 0.75: 1/(1 − p) = 4 exactly, so kept values are exactly 4·x in every dtype.
  // p = 0.3: the scale is rounded to f32, so kept values are x/(1 − p) to the dtype's rounding.
  for (const double p : {0.75, 0.3}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    Tensor y = poisoned(ctx, kLargeShape, dtype);
    ops::dropout_forward(x.tensor, y, float(p), seed, offset);
    const auto keep = reference_mask(n, p, seed, offset);
    const Tolerance tolerance = p == 0.75 ? Tolerance{0, 0} : forward_tolerance(dtype);
    EXPECT_TRUE(all_close(y, apply_mask(x.values, keep, p), tolerance));

    // The fraction kept is 1 − p within 5 standard deviations of a binomial.
    size_t kept = 0;
    for (const bool k : keep) kept += k;
    const double sigma = std::sqrt(p * (1 - p) / double(n));
    EXPECT_NEAR(double(kept) / double(n), 1 - p, 5 * sigma);

    // Same seed and offset: the same output, bit for bit.
    Tensor again = poisoned(ctx, kLargeShape, dtype);
    ops::dropout_forward(x.tensor, again, float(p), seed, offset);
    EXPECT_TRUE(identical(y, again));

    // Another offset: another mask.
    Tensor shifted = poisoned(ctx, kLargeShape, dtype);
    ops::dropout_forward(x.tensor, shifted, float(p), seed, offset + 1);
    EXPECT_FALSE(identical(y, shifted));

    // A shard [k, n) with offset + k draws exactly its slice of the whole mask.
    const int64_t k = 12345;
    Tensor x_tail = x.tensor.flatten().slice(k, int64_t(n));
    Tensor y_tail = poisoned(ctx, Shape{int64_t(n) - k}, dtype);
    ops::dropout_forward(x_tail, y_tail, float(p), seed, offset + uint64_t(k));
    EXPECT_TRUE(identical(y_tail, y.flatten().slice(k, int64_t(n))));
  }

  // p = 0 is the identity, p = 1 drops everything (no division by zero).
  Tensor y0 = poisoned(ctx, kLargeShape, dtype);
  ops::dropout_forward(x.tensor, y0, 0.0f, seed, offset);
  EXPECT_TRUE(all_close(y0, x.values, {0, 0}));
  Tensor y1 = poisoned(ctx, kLargeShape, dtype);
  ops::dropout_forward(x.tensor, y1, 1.0f, seed, offset);
  EXPECT_TRUE(all_close(y1, std::vector<double>(n, 0.0), {0, 0}));

  // In place: y may be x.
  Tensor inplace = x.tensor.clone();
  ops::dropout_forward(inplace, inplace, 0.75f, seed, offset);
  EXPECT_TRUE(all_close(inplace, apply_mask(x.values, reference_mask(n, 0.75, seed, offset), 0.75), {0, 0}));
}

TEST_P(Dropout, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const uint64_t seed = rng(), offset = rng() >> 8;
  const double p = 0.4;
  auto x = random_tensor(ctx, kSmallShape, dtype, rng);
  auto grad_y = random_tensor(ctx, kSmallShape, dtype, rng);
  Tensor grad_x = poisoned(ctx, kSmallShape, dtype);
  ops::dropout_backward(grad_y.tensor, grad_x, float(p), seed, offset);
  const auto keep = reference_mask(x.values.size(), p, seed, offset);
  const auto f = [&](const Inputs& in) { return apply_mask(in[0], keep, p); };
  EXPECT_TRUE(all_close(grad_x, numeric_gradient(f, Inputs{x.values}, 0, grad_y.values), backward_tolerance(dtype)));
  // The backward regenerates the forward's mask: grad_x is 0 exactly where y is.
  Tensor y = poisoned(ctx, kSmallShape, dtype);
  ops::dropout_forward(x.tensor, y, float(p), seed, offset);
  const auto ys = y.to_doubles(), gs = grad_x.to_doubles();
  for (size_t i = 0; i < ys.size(); ++i) EXPECT_EQ(ys[i] == 0.0, gs[i] == 0.0) << "element " << i;
}

TEST_P(Dropout, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  const uint64_t seed = rng(), offset = rng() >> 8;
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -4.0, 4.0);
  for (const float p : {0.0f, 0.3f, 1.0f}) {
    Tensor y_cpu = poisoned(ctx, kLargeShape, dtype), y_gpu = poisoned(ctx, kLargeShape, dtype, gpu);
    ops::dropout_forward(x.tensor, y_cpu, p, seed, offset);
    ops::dropout_forward(x.tensor.to(gpu), y_gpu, p, seed, offset);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, {0, 0})) << "forward, p = " << p;  // the same mask and the same f32 product
    Tensor g_cpu = poisoned(ctx, kLargeShape, dtype), g_gpu = poisoned(ctx, kLargeShape, dtype, gpu);
    ops::dropout_backward(x.tensor, g_cpu, p, seed, offset);
    ops::dropout_backward(x.tensor.to(gpu), g_gpu, p, seed, offset);
    EXPECT_TRUE(all_close(g_gpu, g_cpu, {0, 0})) << "backward, p = " << p;
  }
}

INSTANTIATE_FLOAT_DTYPES(Dropout);

TEST(DropoutArguments, RejectsBadArguments) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor y = ctx.zeros(Shape{4, 5}, DType::f32);
  EXPECT_THROW(ops::dropout_forward(x, y, 1.5f, 1, 0), Error);
  EXPECT_THROW(ops::dropout_forward(x, y, -0.1f, 1, 0), Error);
  EXPECT_THROW(ops::dropout_forward(x, y, std::nanf(""), 1, 0), Error);
  Tensor wrong_shape = ctx.zeros(Shape{4, 6}, DType::f32);
  EXPECT_THROW(ops::dropout_forward(x, wrong_shape, 0.5f, 1, 0), Error);
  Tensor wrong_dtype = ctx.zeros(Shape{4, 5}, DType::bf16);
  EXPECT_THROW(ops::dropout_backward(x, wrong_dtype, 0.5f, 1, 0), Error);
  // A partial overlap of input and output is refused.
  Tensor flat = ctx.zeros(Shape{30}, DType::f32);
  Tensor a = flat.slice(0, 20), b = flat.slice(10, 30);
  EXPECT_THROW(ops::dropout_forward(a, b, 0.5f, 1, 0), Error);
}

}  // namespace
}  // namespace tessera::testing
