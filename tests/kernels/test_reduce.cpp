// Whole-tensor reductions (sum, mean, max, sum_squares): forward on 1,000,003
// elements against a double reference, backward against central differences
// (and the analytic formula on a large tensor), GPU against CPU; the result
// does not depend on the thread count; max's gradient goes to the first maximum.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

const Shape kLargeShape{1000003};  // prime: no chunk or vector width divides it
const Shape kSmallShape{7, 13};

// The result is f32 whatever the input dtype (the input values are exact in
// double), reduced in double (CPU) and rounded once: the f32 bounds apply.
const Tolerance kResultTolerance{1e-5, 1e-6};
// GPU sums in f32 along a tree of ~20 levels over a million elements: rounding
// errors add up to ~1e-7 of the magnitudes involved (results are ~1e3 or larger,
// or ~1e-3 for the mean).
const Tolerance kDeviceTolerance{1e-5, 1e-6};

struct Reduction {
  const char* name;
  double (*reference)(const std::vector<double>&);
  void (*forward)(const Tensor&, Tensor&);
  void (*backward)(const Tensor& x, const Tensor& grad_out, Tensor& grad_x);
};

double sum_reference(const std::vector<double>& x) {
  return std::accumulate(x.begin(), x.end(), 0.0);
}
double mean_reference(const std::vector<double>& x) {
  return sum_reference(x) / double(x.size());
}
double max_reference(const std::vector<double>& x) {
  return *std::max_element(x.begin(), x.end());
}
double sum_squares_reference(const std::vector<double>& x) {
  double total = 0;
  for (const double v : x) total += v * v;
  return total;
}

const Reduction kSum{"sum", sum_reference, ops::sum,
                     [](const Tensor&, const Tensor& g, Tensor& gx) { ops::sum_backward(g, gx); }};
const Reduction kMean{"mean", mean_reference, ops::mean,
                      [](const Tensor&, const Tensor& g, Tensor& gx) { ops::mean_backward(g, gx); }};
const Reduction kMax{"max", max_reference, ops::max, ops::max_backward};
const Reduction kSumSquares{"sum_squares", sum_squares_reference, ops::sum_squares, ops::sum_squares_backward};

double run_forward(const Reduction& r, const Tensor& x) {
  Context& ctx = x.context();
  Tensor out = poisoned(ctx, Shape{1}, DType::f32, x.device());
  r.forward(x, out);
  return out.to_doubles()[0];
}

void check_forward(const Reduction& r, DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  // Shifted so that sums do not cancel to nothing; a small tensor runs on one chunk.
  for (const Shape& shape : {kLargeShape, kSmallShape}) {
    auto x = random_tensor(ctx, shape, dtype, rng, -1.0, 3.0);
    EXPECT_TRUE(all_close({run_forward(r, x.tensor)}, {r.reference(x.values)}, kResultTolerance))
        << r.name << " " << shape.to_string();
  }
}

// Random values with a unique maximum (distinct multiples of 1/64, exact in every
// dtype), so that the central differences of max are well defined.
std::vector<double> distinct_values(size_t n, std::mt19937_64& rng) {
  std::vector<double> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = (double(i) - double(n) / 2) / 64.0;
  std::shuffle(values.begin(), values.end(), rng);
  return values;
}

void check_backward(const Reduction& r, DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const auto values = distinct_values(size_t(kSmallShape.numel()), rng);
  Tensor x = ctx.from_doubles(kSmallShape, dtype, values);
  const double g = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
  Tensor grad_out = ctx.from_doubles(Shape{1}, DType::f32, std::vector<double>{double(float(g))});
  Tensor grad_x = poisoned(ctx, kSmallShape, dtype);
  r.backward(x, grad_out, grad_x);
  const auto f = [&](const Inputs& in) { return std::vector<double>{r.reference(in[0])}; };
  const auto expected = numeric_gradient(f, Inputs{values}, 0, {double(float(g))});
  EXPECT_TRUE(all_close(grad_x, expected, backward_tolerance(dtype))) << r.name;

  // A large tensor, on several threads: the gradient of each element from the formula.
  auto big = random_tensor(ctx, kLargeShape, dtype, rng);
  Tensor big_grad = poisoned(ctx, kLargeShape, dtype);
  r.backward(big.tensor, grad_out, big_grad);
  std::vector<double> formula(big.values.size(), 0.0);
  const double gf = double(float(g));
  const size_t first_max = size_t(std::max_element(big.values.begin(), big.values.end()) - big.values.begin());
  for (size_t i = 0; i < formula.size(); ++i) {
    if (r.backward == kSumSquares.backward) formula[i] = 2 * big.values[i] * gf;
    if (r.reference == mean_reference) formula[i] = gf / double(formula.size());
    if (r.reference == sum_reference) formula[i] = gf;
    if (r.reference == max_reference) formula[i] = i == first_max ? gf : 0.0;
  }
  EXPECT_TRUE(all_close(big_grad, formula, forward_tolerance(dtype))) << r.name << " (large)";
}

void check_gpu(const Reduction& r, DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, dtype, rng, -1.0, 3.0);
  const Tensor x_gpu = x.tensor.to(gpu);
  EXPECT_TRUE(all_close({run_forward(r, x_gpu)}, {run_forward(r, x.tensor)}, kDeviceTolerance)) << r.name;
  Tensor grad_out = ctx.from_doubles(Shape{1}, DType::f32, std::vector<double>{0.75});
  Tensor gx_cpu = poisoned(ctx, kLargeShape, dtype), gx_gpu = poisoned(ctx, kLargeShape, dtype, gpu);
  r.backward(x.tensor, grad_out, gx_cpu);
  r.backward(x_gpu, grad_out.to(gpu), gx_gpu);
  EXPECT_TRUE(all_close(gx_gpu, gx_cpu, device_tolerance(dtype))) << r.name << " backward";
}

class Sum : public DtypeTest {};
TEST_P(Sum, Forward) {
  check_forward(kSum, GetParam());
}
TEST_P(Sum, Backward) {
  check_backward(kSum, GetParam());
}
TEST_P(Sum, GpuMatchesCpu) {
  check_gpu(kSum, GetParam());
}
INSTANTIATE_FLOAT_DTYPES(Sum);

class Mean : public DtypeTest {};
TEST_P(Mean, Forward) {
  check_forward(kMean, GetParam());
}
TEST_P(Mean, Backward) {
  check_backward(kMean, GetParam());
}
TEST_P(Mean, GpuMatchesCpu) {
  check_gpu(kMean, GetParam());
}
INSTANTIATE_FLOAT_DTYPES(Mean);

class Max : public DtypeTest {};
TEST_P(Max, Forward) {
  check_forward(kMax, GetParam());
}
TEST_P(Max, Backward) {
  check_backward(kMax, GetParam());
}
TEST_P(Max, GpuMatchesCpu) {
  check_gpu(kMax, GetParam());
}
INSTANTIATE_FLOAT_DTYPES(Max);

class SumSquares : public DtypeTest {};
TEST_P(SumSquares, Forward) {
  check_forward(kSumSquares, GetParam());
}
TEST_P(SumSquares, Backward) {
  check_backward(kSumSquares, GetParam());
}
TEST_P(SumSquares, GpuMatchesCpu) {
  check_gpu(kSumSquares, GetParam());
}
INSTANTIATE_FLOAT_DTYPES(SumSquares);

TEST(Reduce, IndependentOfThreadCount) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeShape, DType::f32, rng, -1.0, 3.0);
  const int threads = omp_get_max_threads();
  for (const Reduction* r : {&kSum, &kMean, &kMax, &kSumSquares}) {
    omp_set_num_threads(1);
    const double serial = run_forward(*r, x.tensor);
    omp_set_num_threads(std::max(threads, 2));
    const double parallel = run_forward(*r, x.tensor);
    omp_set_num_threads(threads);
    EXPECT_EQ(serial, parallel) << r->name;
  }
}

TEST(Reduce, MaxGradientGoesToTheFirstMaximum) {
  Context ctx;
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    // The maximum 2.5 appears at 3, 40 000 (another chunk) and 70 001.
    std::vector<double> values(70003, 0.0);
    for (size_t i = 0; i < values.size(); ++i) values[i] = double(i % 17) / 8.0;  // up to 2.0
    values[3] = values[40000] = values[70001] = 2.5;
    Tensor x = ctx.from_doubles(Shape{int64_t(values.size())}, dtype, values);
    Tensor grad_out = ctx.full(Shape{1}, DType::f32, 1.5);
    Tensor grad_x = poisoned(ctx, x.shape(), dtype);
    ops::max_backward(x, grad_out, grad_x);
    std::vector<double> expected(values.size(), 0.0);
    expected[3] = 1.5;
    EXPECT_TRUE(all_close(grad_x, expected, {0, 0})) << dtype;
  }
}

TEST(Reduce, NanAndEmpty) {
  Context ctx;
  std::vector<double> values(1001, 1.0);
  values[500] = std::nan("");
  Tensor x = ctx.from_doubles(Shape{1001}, DType::f32, values);
  Tensor out = ctx.zeros(Shape{1}, DType::f32);
  ops::max(x, out);  // max propagates NaN, as PyTorch does
  EXPECT_TRUE(std::isnan(out.to_doubles()[0]));
  ops::sum(x, out);
  EXPECT_TRUE(std::isnan(out.to_doubles()[0]));

  Tensor empty = ctx.empty(Shape{0}, DType::f32);
  ops::sum(empty, out);
  EXPECT_EQ(out.to_doubles()[0], 0.0);
  ops::mean(empty, out);  // 0 / 0
  EXPECT_TRUE(std::isnan(out.to_doubles()[0]));
  EXPECT_THROW(ops::max(empty, out), Error);
  Tensor grad_out = ctx.full(Shape{1}, DType::f32, 1.0);
  Tensor grad_empty = ctx.empty(Shape{0}, DType::f32);
  EXPECT_THROW(ops::max_backward(empty, grad_out, grad_empty), Error);
}

TEST(Reduce, RejectsBadArguments) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor out_bf16 = ctx.zeros(Shape{1}, DType::bf16);
  EXPECT_THROW(ops::sum(x, out_bf16), Error);
  Tensor out_two = ctx.zeros(Shape{2}, DType::f32);
  EXPECT_THROW(ops::mean(x, out_two), Error);
  Tensor ints = ctx.zeros(Shape{4, 5}, DType::i32);
  Tensor out = ctx.zeros(Shape{1}, DType::f32);
  EXPECT_THROW(ops::max(ints, out), Error);
  Tensor grad_x = ctx.zeros(Shape{4, 6}, DType::f32);
  EXPECT_THROW(ops::sum_squares_backward(x, out, grad_x), Error);
  Tensor grad_bf16 = ctx.zeros(Shape{4, 5}, DType::bf16);
  EXPECT_THROW(ops::max_backward(x, out, grad_bf16), Error);
}

}  // namespace
}  // namespace tessera::testing
