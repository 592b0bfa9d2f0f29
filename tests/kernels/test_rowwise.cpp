// Softmax, cross-entropy, LayerNorm and RMSNorm: forward against double
// references, backward against central differences of those references, GPU
// against CPU, and argument checks. Every dtype; rows of length 1, 3, 129,
// 1000 (and a GPT-sized vocabulary), enough rows to cross the CPU's threading
// grain, and logits of magnitude 100 for stability (exp(100) overflows f32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/functors/rowwise_math.h"
#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kF32Epsilon = 1.0 / (1 << 23);
constexpr int64_t kIgnore = -100;
// Logits this large overflow exp() in f32 unless the row maximum is subtracted first.
constexpr double kLargeLogit = 100;

struct RowShape {
  int64_t rows, d;
};
// Row counts pass the CPU's grain (2^14 / d rows per thread) where it matters.
const RowShape kForwardShapes[] = {{37, 1}, {6007, 3}, {301, 129}, {41, 1000}};
const RowShape kBackwardShapes[] = {{3, 1}, {4, 3}, {5, 13}};

Shape shape_of(RowShape s) {
  return Shape{s.rows, s.d};
}

// ---------------------------------------------------------------------------
// Double references (rows of length d)
// ---------------------------------------------------------------------------
std::vector<double> softmax_reference(const std::vector<double>& x, int64_t d) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / size_t(d); ++r) {
    const double* xr = &x[r * d];
    const double m = *std::max_element(xr, xr + d);
    double s = 0;
    for (int64_t i = 0; i < d; ++i) s += std::exp(xr[i] - m);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = std::exp(xr[i] - m) / s;
  }
  return y;
}

struct CrossEntropyReference {
  std::vector<double> losses, logsumexp;
};
CrossEntropyReference cross_entropy_reference(const std::vector<double>& logits, const std::vector<double>& targets,
                                              int64_t v, int64_t ignore_index) {
  CrossEntropyReference out;
  for (size_t r = 0; r < targets.size(); ++r) {
    const double* xr = &logits[r * v];
    const double m = *std::max_element(xr, xr + v);
    double s = 0;
    for (int64_t i = 0; i < v; ++i) s += std::exp(xr[i] - m);
    const double lse = m + std::log(s);
    const auto t = int64_t(targets[r]);
    out.logsumexp.push_back(lse);
    out.losses.push_back(t == ignore_index ? 0.0 : (t >= 0 && t < v) ? lse - xr[t] : kNan);
  }
  return out;
}

struct NormReference {
  std::vector<double> y, mean, rstd;
};
// LayerNorm; an empty `bias` means none.
NormReference layernorm_reference(const std::vector<double>& x, const std::vector<double>& weight,
                                  const std::vector<double>& bias, int64_t d, double eps) {
  NormReference out;
  out.y.resize(x.size());
  for (size_t r = 0; r < x.size() / size_t(d); ++r) {
    const double* xr = &x[r * d];
    double mean = 0, var = 0;
    for (int64_t i = 0; i < d; ++i) mean += xr[i];
    mean /= double(d);
    for (int64_t i = 0; i < d; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const double rstd = 1.0 / std::sqrt(var / double(d) + eps);
    for (int64_t i = 0; i < d; ++i)
      out.y[r * d + i] = (xr[i] - mean) * rstd * weight[i] + (bias.empty() ? 0.0 : bias[i]);
    out.mean.push_back(mean);
    out.rstd.push_back(rstd);
  }
  return out;
}

NormReference rmsnorm_reference(const std::vector<double>& x, const std::vector<double>& weight, int64_t d,
                                double eps) {
  NormReference out;
  out.y.resize(x.size());
  for (size_t r = 0; r < x.size() / size_t(d); ++r) {
    const double* xr = &x[r * d];
    double squares = 0;
    for (int64_t i = 0; i < d; ++i) squares += xr[i] * xr[i];
    const double rstd = 1.0 / std::sqrt(squares / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) out.y[r * d + i] = xr[i] * rstd * weight[i];
    out.rstd.push_back(rstd);
  }
  return out;
}

std::vector<double> plus(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

// Per-row f32 outputs (losses, logsumexp, mean, rstd) are computed in f32 from
// the stored inputs whatever the dtype, so they get f32 bounds: a few ulp of
// the largest magnitude involved (`scale`), which covers lse − logit when the
// two nearly cancel.
Tolerance f32_tolerance(double scale) {
  return {1e-5, 8 * kF32Epsilon * std::max(1.0, scale)};
}

// Norm outputs sum terms of magnitude ~3 that may cancel to near zero: a few f32 ulp of 3 absolute.
Tolerance norm_tolerance(DType dtype) {
  Tolerance t = forward_tolerance(dtype);
  t.abs = std::max(t.abs, 1e-5);
  return t;
}

// LayerNorm subtracts the mean in f32, which costs a few ulp of the row's
// largest |x|, and rstd multiplies that error, hugely when a short row's
// values nearly coincide (for d = 1, rstd = 1/√eps). So row r gets extra
// slack, a few ulp of: max|x_r|·rstd_r·max|w| for y;
// rstd_r·max|grad_y·w|·(1 + max|x_r|·rstd_r) for grad_x.
std::vector<double> layernorm_slack(const std::vector<double>& x, const std::vector<double>& weight,
                                    const std::vector<double>& rstd, int64_t d, const std::vector<double>* grad_y) {
  std::vector<double> slack;
  for (size_t r = 0; r < rstd.size(); ++r) {
    double max_x = 0, max_w = 0, max_g = 0;
    for (int64_t i = 0; i < d; ++i) {
      max_x = std::max(max_x, std::abs(x[r * d + i]));
      max_w = std::max(max_w, std::abs(weight[i]));
      if (grad_y) max_g = std::max(max_g, std::abs((*grad_y)[r * d + i] * weight[i]));
    }
    slack.push_back(16 * kF32Epsilon * rstd[r] * (grad_y ? max_g * (1 + max_x * rstd[r]) : max_x * max_w));
  }
  return slack;
}

// |actual − expected| ≤ tolerance.abs + tolerance.rel·|expected| + slack[row] for every element.
::testing::AssertionResult close_with_row_slack(const Tensor& actual, const std::vector<double>& expected,
                                                Tolerance tolerance, const std::vector<double>& slack, int64_t d) {
  const std::vector<double> values = actual.to_doubles();
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double allowed = tolerance.abs + tolerance.rel * std::abs(expected[i]) + slack[i / size_t(d)];
    const double error = std::abs(values[i] - expected[i]);
    if (!(error <= allowed)) {
      ++bad;
      const double ratio = std::isnan(error) ? INFINITY : error / allowed;
      if (ratio >= worst_ratio) worst_ratio = ratio, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << values.size() << " elements differ; worst at index " << worst
                                       << ": actual " << values[worst] << ", expected " << expected[worst]
                                       << ", allowed "
                                       << tolerance.abs + tolerance.rel * std::abs(expected[worst]) +
                                              slack[worst / size_t(d)];
}

// ---------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------
class Softmax : public DtypeTest {};

TEST_P(Softmax, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const RowShape s : kForwardShapes) {
    for (const double magnitude : {4.0, kLargeLogit}) {
      auto x = random_tensor(ctx, shape_of(s), dtype, rng, -magnitude, magnitude);
      Tensor y = poisoned(ctx, shape_of(s), dtype);
      ops::softmax_forward(x.tensor, y);
      EXPECT_TRUE(all_close(y, softmax_reference(x.values, s.d), forward_tolerance(dtype)))
          << "rows " << s.rows << " d " << s.d << " magnitude " << magnitude;
    }
  }
  // Leading dimensions are rows.
  auto x = random_tensor(ctx, Shape{3, 5, 7}, dtype, rng, -3, 3);
  Tensor y = poisoned(ctx, Shape{3, 5, 7}, dtype);
  ops::softmax_forward(x.tensor, y);
  EXPECT_TRUE(all_close(y, softmax_reference(x.values, 7), forward_tolerance(dtype))) << "3-d input";
}

TEST_P(Softmax, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const RowShape s : kBackwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, -3, 3);
    auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
    const Tensor y = ctx.from_doubles(shape_of(s), dtype, softmax_reference(x.values, s.d));
    const auto f = [&](const Inputs& in) { return softmax_reference(in[0], s.d); };
    const auto expected = numeric_gradient(f, Inputs{x.values}, 0, grad_y.values);
    Tensor grad_x = poisoned(ctx, shape_of(s), dtype);
    ops::softmax_backward(y, grad_y.tensor, grad_x);
    EXPECT_TRUE(all_close(grad_x, expected, backward_tolerance(dtype))) << "d " << s.d;
    // grad_x may be grad_y.
    ops::softmax_backward(y, grad_y.tensor, grad_y.tensor);
    EXPECT_TRUE(all_close(grad_y.tensor, expected, backward_tolerance(dtype))) << "d " << s.d << " in place";
  }
}

TEST_P(Softmax, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const RowShape s : kForwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, -kLargeLogit, kLargeLogit);
    auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
    Tensor y_cpu = poisoned(ctx, shape_of(s), dtype), y_gpu = poisoned(ctx, shape_of(s), dtype, gpu);
    ops::softmax_forward(x.tensor, y_cpu);
    ops::softmax_forward(x.tensor.to(gpu), y_gpu);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, device_tolerance(dtype))) << "forward, d " << s.d;
    Tensor gx_cpu = poisoned(ctx, shape_of(s), dtype), gx_gpu = poisoned(ctx, shape_of(s), dtype, gpu);
    ops::softmax_backward(y_cpu, grad_y.tensor, gx_cpu);
    ops::softmax_backward(y_cpu.to(gpu), grad_y.tensor.to(gpu), gx_gpu);
    EXPECT_TRUE(all_close(gx_gpu, gx_cpu, device_tolerance(dtype))) << "backward, d " << s.d;
  }
}

INSTANTIATE_FLOAT_DTYPES(Softmax);

// ---------------------------------------------------------------------------
// CrossEntropy
// ---------------------------------------------------------------------------
struct Targets {
  Tensor tensor;
  std::vector<double> values;
};

// Uniform targets in [0, v); about one in five set to `ignore_index`; with
// `invalid`, rows 1 and 3 get out-of-range targets (v, and −1).
Targets make_targets(Context& ctx, int64_t rows, int64_t v, DType index_dtype, std::mt19937_64& rng,
                     int64_t ignore_index, bool invalid, Device device = Device::cpu()) {
  std::vector<double> values = random_indices(ctx, Shape{rows}, DType::i64, rng, 0, v).values;
  std::uniform_int_distribution<int> one_in_five(0, 4);
  for (double& t : values)
    if (one_in_five(rng) == 0) t = double(ignore_index);
  if (invalid && rows > 3) {
    values[1] = double(v);
    values[3] = -1.0;
  }
  return {ctx.from_doubles(Shape{rows}, index_dtype, values, device), values};
}

// Compares with NaN where `expected` is NaN (and only there).
::testing::AssertionResult close_or_both_nan(const Tensor& actual, std::vector<double> expected, Tolerance tolerance) {
  std::vector<double> values = actual.to_doubles();
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::isnan(expected[i]) != std::isnan(values[i]))
      return ::testing::AssertionFailure() << "element " << i << " is " << values[i] << ", expected " << expected[i];
    if (std::isnan(expected[i])) values[i] = expected[i] = 0;
  }
  return all_close(values, expected, tolerance);
}

class CrossEntropy : public DtypeTest {};

TEST_P(CrossEntropy, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  struct Case {
    RowShape shape;
    double magnitude;
    int64_t ignore_index;
  };
  const Case cases[] = {{{37, 1}, 4, kIgnore},
                        {{301, 3}, kLargeLogit, kIgnore},
                        {{301, 129}, 4, 5},
                        {{41, 1000}, kLargeLogit, kIgnore},
                        {{6, 50257}, 8, kIgnore}};
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    for (const Case& c : cases) {
      const RowShape s = c.shape;
      auto logits = random_tensor(ctx, shape_of(s), dtype, rng, -c.magnitude, c.magnitude);
      const Targets targets = make_targets(ctx, s.rows, s.d, index_dtype, rng, c.ignore_index, /*invalid=*/true);
      Tensor losses = poisoned(ctx, Shape{s.rows}, DType::f32), lse = poisoned(ctx, Shape{s.rows}, DType::f32);
      ops::cross_entropy_forward(logits.tensor, targets.tensor, losses, lse, c.ignore_index);
      const auto expected = cross_entropy_reference(logits.values, targets.values, s.d, c.ignore_index);
      const Tolerance tolerance = f32_tolerance(c.magnitude + std::log(double(s.d)));
      EXPECT_TRUE(close_or_both_nan(losses, expected.losses, tolerance))
          << "losses, " << index_dtype << " targets, v " << s.d << " magnitude " << c.magnitude;
      EXPECT_TRUE(all_close(lse, expected.logsumexp, tolerance))
          << "logsumexp, " << index_dtype << " targets, v " << s.d << " magnitude " << c.magnitude;
      const std::vector<double> loss_values = losses.to_doubles();
      for (size_t r = 0; r < targets.values.size(); ++r) {
        if (targets.values[r] == double(c.ignore_index)) {
          EXPECT_EQ(loss_values[r], 0.0) << "ignored row " << r;
        }
      }
    }
  }
}

TEST_P(CrossEntropy, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    for (const RowShape s : {RowShape{5, 1}, RowShape{6, 3}, RowShape{7, 11}}) {
      auto logits = random_tensor(ctx, shape_of(s), dtype, rng, -4, 4);
      const Targets targets = make_targets(ctx, s.rows, s.d, index_dtype, rng, kIgnore, /*invalid=*/false);
      auto grad_losses = random_tensor(ctx, Shape{s.rows}, DType::f32, rng, -2, 2);
      const auto reference = cross_entropy_reference(logits.values, targets.values, s.d, kIgnore);
      const Tensor lse = ctx.from_doubles(Shape{s.rows}, DType::f32, reference.logsumexp);
      const auto f = [&](const Inputs& in) {
        return cross_entropy_reference(in[0], targets.values, s.d, kIgnore).losses;
      };
      const auto expected = numeric_gradient(f, Inputs{logits.values}, 0, grad_losses.values);
      Tensor grad_logits = poisoned(ctx, shape_of(s), dtype);
      ops::cross_entropy_backward(logits.tensor, lse, targets.tensor, grad_losses.tensor, grad_logits);
      EXPECT_TRUE(all_close(grad_logits, expected, backward_tolerance(dtype))) << index_dtype << " v " << s.d;
      // In place: the gradient overwrites the logits.
      ops::cross_entropy_backward(logits.tensor, lse, targets.tensor, grad_losses.tensor, logits.tensor);
      EXPECT_TRUE(all_close(logits.tensor, expected, backward_tolerance(dtype)))
          << index_dtype << " v " << s.d << " in place";
    }
  }
}

// Large logits through the whole pass (forward's logsumexp into the in-place
// backward), against the analytic gradient; an out-of-range target gives a
// NaN row, an ignored one a zero row.
TEST_P(CrossEntropy, BackwardLargeLogitsAndInvalidTargets) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const RowShape s{301, 129};
  const double magnitude = kLargeLogit;
  auto logits = random_tensor(ctx, shape_of(s), dtype, rng, -magnitude, magnitude);
  const Targets targets = make_targets(ctx, s.rows, s.d, DType::i64, rng, kIgnore, /*invalid=*/true);
  auto grad_losses = random_tensor(ctx, Shape{s.rows}, DType::f32, rng, -2, 2);
  Tensor losses = ctx.empty(Shape{s.rows}, DType::f32), lse = ctx.empty(Shape{s.rows}, DType::f32);
  ops::cross_entropy_forward(logits.tensor, targets.tensor, losses, lse);
  ops::cross_entropy_backward(logits.tensor, lse, targets.tensor, grad_losses.tensor, logits.tensor);
  std::vector<double> expected = softmax_reference(logits.values, s.d);
  for (int64_t r = 0; r < s.rows; ++r) {
    const auto t = int64_t(targets.values[r]);
    for (int64_t i = 0; i < s.d; ++i) {
      double& e = expected[r * s.d + i];
      if (t == kIgnore)
        e = 0;
      else if (t < 0 || t >= s.d)
        e = kNan;
      else
        e = grad_losses.values[r] * (e - (i == t ? 1.0 : 0.0));
    }
  }
  Tolerance tolerance = backward_tolerance(dtype);
  tolerance.abs =
      std::max(tolerance.abs, 2 * 8 * kF32Epsilon * magnitude);  // exp(x − lse) with lse ≈ 100 (see f32_tolerance)
  EXPECT_TRUE(close_or_both_nan(logits.tensor, expected, tolerance));
}

TEST_P(CrossEntropy, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    for (const RowShape s : {RowShape{37, 1}, RowShape{301, 129}, RowShape{41, 1000}, RowShape{6, 50257}}) {
      auto logits = random_tensor(ctx, shape_of(s), dtype, rng, -kLargeLogit, kLargeLogit);
      const Targets targets = make_targets(ctx, s.rows, s.d, index_dtype, rng, kIgnore, /*invalid=*/true);
      auto grad_losses = random_tensor(ctx, Shape{s.rows}, DType::f32, rng, -2, 2);
      Tensor losses_cpu = poisoned(ctx, Shape{s.rows}, DType::f32), lse_cpu = poisoned(ctx, Shape{s.rows}, DType::f32);
      Tensor losses_gpu = poisoned(ctx, Shape{s.rows}, DType::f32, gpu),
             lse_gpu = poisoned(ctx, Shape{s.rows}, DType::f32, gpu);
      ops::cross_entropy_forward(logits.tensor, targets.tensor, losses_cpu, lse_cpu);
      ops::cross_entropy_forward(logits.tensor.to(gpu), targets.tensor.to(gpu), losses_gpu, lse_gpu);
      const Tolerance tolerance = f32_tolerance(kLargeLogit + std::log(double(s.d)));
      EXPECT_TRUE(close_or_both_nan(losses_gpu, losses_cpu.to_doubles(), tolerance)) << "losses, v " << s.d;
      EXPECT_TRUE(all_close(lse_gpu, lse_cpu, tolerance)) << "logsumexp, v " << s.d;
      Tensor grad_cpu = poisoned(ctx, shape_of(s), dtype);
      Tensor grad_gpu = logits.tensor.to(gpu);  // in place on the device
      ops::cross_entropy_backward(logits.tensor, lse_cpu, targets.tensor, grad_losses.tensor, grad_cpu);
      ops::cross_entropy_backward(grad_gpu, lse_gpu, targets.tensor.to(gpu), grad_losses.tensor.to(gpu), grad_gpu);
      Tolerance grad_tolerance = device_tolerance(dtype);
      grad_tolerance.abs = std::max(grad_tolerance.abs, 16 * kF32Epsilon * kLargeLogit);  // exp(x − lse), lse ≈ 100
      EXPECT_TRUE(close_or_both_nan(grad_gpu, grad_cpu.to_doubles(), grad_tolerance)) << "backward, v " << s.d;
    }
  }
}

INSTANTIATE_FLOAT_DTYPES(CrossEntropy);

// ---------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------
constexpr float kEps = 1e-5f;

class LayerNorm : public DtypeTest {};

TEST_P(LayerNorm, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const RowShape s : kForwardShapes) {
    for (const bool with_bias : {true, false}) {
      // Offset from zero, so a one-pass variance would lose digits.
      auto x = random_tensor(ctx, shape_of(s), dtype, rng, 3, 5);
      auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
      auto bias = random_tensor(ctx, Shape{s.d}, dtype, rng, -1, 1);
      Tensor y = poisoned(ctx, shape_of(s), dtype);
      Tensor mean = poisoned(ctx, Shape{s.rows}, DType::f32), rstd = poisoned(ctx, Shape{s.rows}, DType::f32);
      ops::layernorm_forward(x.tensor, weight.tensor, with_bias ? bias.tensor : Tensor(), y, mean, rstd, kEps);
      const auto expected =
          layernorm_reference(x.values, weight.values, with_bias ? bias.values : std::vector<double>{}, s.d, kEps);
      const auto slack = layernorm_slack(x.values, weight.values, expected.rstd, s.d, nullptr);
      EXPECT_TRUE(close_with_row_slack(y, expected.y, norm_tolerance(dtype), slack, s.d))
          << "d " << s.d << " bias " << with_bias;
      EXPECT_TRUE(all_close(mean, expected.mean, f32_tolerance(5))) << "mean, d " << s.d;
      EXPECT_TRUE(all_close(rstd, expected.rstd, {2e-5, 1e-6})) << "rstd, d " << s.d;
    }
  }
}

void check_layernorm_backward(DType dtype, bool with_bias, bool accumulate) {
  Context ctx;
  auto rng = make_rng();
  for (const RowShape s : kBackwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, -2, 2);
    auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
    auto bias = random_tensor(ctx, Shape{s.d}, dtype, rng, -1, 1);
    auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
    const std::vector<double> no_bias;
    const auto forward = layernorm_reference(x.values, weight.values, with_bias ? bias.values : no_bias, s.d, kEps);
    const Tensor mean = ctx.from_doubles(Shape{s.rows}, DType::f32, forward.mean);
    const Tensor rstd = ctx.from_doubles(Shape{s.rows}, DType::f32, forward.rstd);

    const auto f = [&](const Inputs& in) { return layernorm_reference(in[0], in[1], in[2], s.d, kEps).y; };
    const Inputs inputs{x.values, weight.values, with_bias ? bias.values : no_bias};
    const auto expected_x = numeric_gradient(f, inputs, 0, grad_y.values);
    auto expected_w = numeric_gradient(f, inputs, 1, grad_y.values);
    auto expected_b = with_bias ? numeric_gradient(f, inputs, 2, grad_y.values) : std::vector<double>{};

    Tensor grad_x = poisoned(ctx, shape_of(s), dtype);
    Tensor grad_w = poisoned(ctx, Shape{s.d}, dtype), grad_b = poisoned(ctx, Shape{s.d}, dtype);
    if (accumulate) {
      auto prior_w = random_tensor(ctx, Shape{s.d}, dtype, rng, -1, 1);
      auto prior_b = random_tensor(ctx, Shape{s.d}, dtype, rng, -1, 1);
      grad_w.copy_(prior_w.tensor);
      grad_b.copy_(prior_b.tensor);
      expected_w = plus(expected_w, prior_w.values);
      if (with_bias) expected_b = plus(expected_b, prior_b.values);
    }
    const std::vector<double> grad_b_before = grad_b.to_doubles();
    ops::layernorm_backward(grad_y.tensor, x.tensor, weight.tensor, mean, rstd, grad_x, grad_w,
                            with_bias ? &grad_b : nullptr, accumulate);
    const Tolerance tolerance = backward_tolerance(dtype);
    const auto slack = layernorm_slack(x.values, weight.values, forward.rstd, s.d, &grad_y.values);
    EXPECT_TRUE(close_with_row_slack(grad_x, expected_x, tolerance, slack, s.d)) << "grad_x, d " << s.d;
    EXPECT_TRUE(all_close(grad_w, expected_w, tolerance)) << "grad_weight, d " << s.d;
    if (with_bias) {
      EXPECT_TRUE(all_close(grad_b, expected_b, tolerance)) << "grad_bias, d " << s.d;
    } else {
      EXPECT_TRUE(close_or_both_nan(grad_b, grad_b_before, {0, 0})) << "grad_bias touched without a bias";
    }

    // grad_x may be grad_y (the weight gradient is summed before grad_x is written).
    Tensor grad_w2 = poisoned(ctx, Shape{s.d}, dtype);
    ops::layernorm_backward(grad_y.tensor, x.tensor, weight.tensor, mean, rstd, grad_y.tensor, grad_w2, nullptr);
    EXPECT_TRUE(close_with_row_slack(grad_y.tensor, expected_x, tolerance, slack, s.d)) << "in place, d " << s.d;
    if (!accumulate) {
      EXPECT_TRUE(all_close(grad_w2, expected_w, tolerance)) << "in place grad_weight, d " << s.d;
    }
  }
}

TEST_P(LayerNorm, Backward) {
  TESSERA_SEED_TRACE();
  check_layernorm_backward(GetParam(), /*with_bias=*/true, /*accumulate=*/false);
  check_layernorm_backward(GetParam(), /*with_bias=*/false, /*accumulate=*/false);
}

TEST_P(LayerNorm, BackwardAccumulates) {
  TESSERA_SEED_TRACE();
  check_layernorm_backward(GetParam(), /*with_bias=*/true, /*accumulate=*/true);
  check_layernorm_backward(GetParam(), /*with_bias=*/false, /*accumulate=*/true);
}

// Column sums over many rows, split across threads: the totals against a
// double sum (the numeric-gradient tests use few rows).
TEST_P(LayerNorm, BackwardManyRows) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const RowShape s{513, 1000};
  auto x = random_tensor(ctx, shape_of(s), dtype, rng, -2, 2);
  auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
  auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
  const auto forward = layernorm_reference(x.values, weight.values, {}, s.d, kEps);
  const Tensor mean = ctx.from_doubles(Shape{s.rows}, DType::f32, forward.mean);
  const Tensor rstd = ctx.from_doubles(Shape{s.rows}, DType::f32, forward.rstd);
  std::vector<double> expected_w(s.d, 0.0), expected_b(s.d, 0.0), abs_sum(s.d, 0.0);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t i = 0; i < s.d; ++i) {
      const double g = grad_y.values[r * s.d + i], xhat = (x.values[r * s.d + i] - forward.mean[r]) * forward.rstd[r];
      expected_w[i] += g * xhat;
      expected_b[i] += g;
    }
  Tensor grad_x = poisoned(ctx, shape_of(s), dtype);
  Tensor grad_w = poisoned(ctx, Shape{s.d}, dtype), grad_b = poisoned(ctx, Shape{s.d}, dtype);
  ops::layernorm_backward(grad_y.tensor, x.tensor, weight.tensor, mean, rstd, grad_x, grad_w, &grad_b);
  // Sums of 513 terms of size ~1 in f32: absolute error up to ~513·2^-24·√513.
  Tolerance tolerance = forward_tolerance(dtype);
  tolerance.abs = std::max(tolerance.abs, 1e-4);
  EXPECT_TRUE(all_close(grad_w, expected_w, tolerance));
  EXPECT_TRUE(all_close(grad_b, expected_b, tolerance));
}

TEST_P(LayerNorm, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const RowShape s : kForwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, 3, 5);
    auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
    auto bias = random_tensor(ctx, Shape{s.d}, dtype, rng, -1, 1);
    auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
    Tensor y_cpu = poisoned(ctx, shape_of(s), dtype), y_gpu = poisoned(ctx, shape_of(s), dtype, gpu);
    Tensor mean_cpu = poisoned(ctx, Shape{s.rows}, DType::f32), rstd_cpu = poisoned(ctx, Shape{s.rows}, DType::f32);
    Tensor mean_gpu = poisoned(ctx, Shape{s.rows}, DType::f32, gpu),
           rstd_gpu = poisoned(ctx, Shape{s.rows}, DType::f32, gpu);
    ops::layernorm_forward(x.tensor, weight.tensor, bias.tensor, y_cpu, mean_cpu, rstd_cpu, kEps);
    ops::layernorm_forward(x.tensor.to(gpu), weight.tensor.to(gpu), bias.tensor.to(gpu), y_gpu, mean_gpu, rstd_gpu,
                           kEps);
    const std::vector<double> rstd_values = rstd_cpu.to_doubles();
    const auto slack = layernorm_slack(x.values, weight.values, rstd_values, s.d, nullptr);
    EXPECT_TRUE(close_with_row_slack(y_gpu, y_cpu.to_doubles(), norm_tolerance(dtype), slack, s.d)) << "y, d " << s.d;
    EXPECT_TRUE(all_close(mean_gpu, mean_cpu, f32_tolerance(5))) << "mean, d " << s.d;
    EXPECT_TRUE(all_close(rstd_gpu, rstd_cpu, {2e-5, 1e-6})) << "rstd, d " << s.d;

    Tensor gx_cpu = poisoned(ctx, shape_of(s), dtype), gx_gpu = poisoned(ctx, shape_of(s), dtype, gpu);
    Tensor gw_cpu = ctx.full(Shape{s.d}, dtype, 0.5), gw_gpu = ctx.full(Shape{s.d}, dtype, 0.5, gpu);
    Tensor gb_cpu = ctx.full(Shape{s.d}, dtype, 0.5), gb_gpu = ctx.full(Shape{s.d}, dtype, 0.5, gpu);
    ops::layernorm_backward(grad_y.tensor, x.tensor, weight.tensor, mean_cpu, rstd_cpu, gx_cpu, gw_cpu, &gb_cpu,
                            /*accumulate=*/true);
    ops::layernorm_backward(grad_y.tensor.to(gpu), x.tensor.to(gpu), weight.tensor.to(gpu), mean_cpu.to(gpu),
                            rstd_cpu.to(gpu), gx_gpu, gw_gpu, &gb_gpu, /*accumulate=*/true);
    // Column sums over up to 6007 rows, added in another order on the GPU.
    Tolerance sums = device_tolerance(dtype);
    sums.abs = std::max(sums.abs, 1e-4);
    const auto grad_slack = layernorm_slack(x.values, weight.values, rstd_values, s.d, &grad_y.values);
    EXPECT_TRUE(close_with_row_slack(gx_gpu, gx_cpu.to_doubles(), norm_tolerance(dtype), grad_slack, s.d))
        << "grad_x, d " << s.d;
    EXPECT_TRUE(all_close(gw_gpu, gw_cpu, sums)) << "grad_weight, d " << s.d;
    EXPECT_TRUE(all_close(gb_gpu, gb_cpu, sums)) << "grad_bias, d " << s.d;
  }
}

INSTANTIATE_FLOAT_DTYPES(LayerNorm);

// ---------------------------------------------------------------------------
// RmsNorm
// ---------------------------------------------------------------------------
class RmsNorm : public DtypeTest {};

TEST_P(RmsNorm, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const RowShape s : kForwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, -3, 3);
    auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
    Tensor y = poisoned(ctx, shape_of(s), dtype), rstd = poisoned(ctx, Shape{s.rows}, DType::f32);
    ops::rmsnorm_forward(x.tensor, weight.tensor, y, rstd, kEps);
    const auto expected = rmsnorm_reference(x.values, weight.values, s.d, kEps);
    EXPECT_TRUE(all_close(y, expected.y, norm_tolerance(dtype))) << "d " << s.d;
    EXPECT_TRUE(all_close(rstd, expected.rstd, {2e-5, 1e-6})) << "rstd, d " << s.d;
  }
}

void check_rmsnorm_backward(DType dtype, bool accumulate) {
  Context ctx;
  auto rng = make_rng();
  for (const RowShape s : kBackwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, -2, 2);
    auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
    auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
    const Tensor rstd =
        ctx.from_doubles(Shape{s.rows}, DType::f32, rmsnorm_reference(x.values, weight.values, s.d, kEps).rstd);
    const auto f = [&](const Inputs& in) { return rmsnorm_reference(in[0], in[1], s.d, kEps).y; };
    const Inputs inputs{x.values, weight.values};
    const auto expected_x = numeric_gradient(f, inputs, 0, grad_y.values);
    auto expected_w = numeric_gradient(f, inputs, 1, grad_y.values);
    Tensor grad_x = poisoned(ctx, shape_of(s), dtype), grad_w = poisoned(ctx, Shape{s.d}, dtype);
    if (accumulate) {
      auto prior = random_tensor(ctx, Shape{s.d}, dtype, rng, -1, 1);
      grad_w.copy_(prior.tensor);
      expected_w = plus(expected_w, prior.values);
    }
    ops::rmsnorm_backward(grad_y.tensor, x.tensor, weight.tensor, rstd, grad_x, grad_w, accumulate);
    EXPECT_TRUE(all_close(grad_x, expected_x, backward_tolerance(dtype))) << "grad_x, d " << s.d;
    EXPECT_TRUE(all_close(grad_w, expected_w, backward_tolerance(dtype))) << "grad_weight, d " << s.d;
    // grad_x may be grad_y.
    Tensor grad_w2 = poisoned(ctx, Shape{s.d}, dtype);
    ops::rmsnorm_backward(grad_y.tensor, x.tensor, weight.tensor, rstd, grad_y.tensor, grad_w2);
    EXPECT_TRUE(all_close(grad_y.tensor, expected_x, backward_tolerance(dtype))) << "in place, d " << s.d;
  }
}

TEST_P(RmsNorm, Backward) {
  TESSERA_SEED_TRACE();
  check_rmsnorm_backward(GetParam(), /*accumulate=*/false);
}

TEST_P(RmsNorm, BackwardAccumulates) {
  TESSERA_SEED_TRACE();
  check_rmsnorm_backward(GetParam(), /*accumulate=*/true);
}

TEST_P(RmsNorm, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const RowShape s : kForwardShapes) {
    auto x = random_tensor(ctx, shape_of(s), dtype, rng, -3, 3);
    auto weight = random_tensor(ctx, Shape{s.d}, dtype, rng, -1.5, 1.5);
    auto grad_y = random_tensor(ctx, shape_of(s), dtype, rng, -1, 1);
    Tensor y_cpu = poisoned(ctx, shape_of(s), dtype), y_gpu = poisoned(ctx, shape_of(s), dtype, gpu);
    Tensor rstd_cpu = poisoned(ctx, Shape{s.rows}, DType::f32),
           rstd_gpu = poisoned(ctx, Shape{s.rows}, DType::f32, gpu);
    ops::rmsnorm_forward(x.tensor, weight.tensor, y_cpu, rstd_cpu, kEps);
    ops::rmsnorm_forward(x.tensor.to(gpu), weight.tensor.to(gpu), y_gpu, rstd_gpu, kEps);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, norm_tolerance(dtype))) << "y, d " << s.d;
    EXPECT_TRUE(all_close(rstd_gpu, rstd_cpu, {2e-5, 1e-6})) << "rstd, d " << s.d;
    Tensor gx_cpu = poisoned(ctx, shape_of(s), dtype), gx_gpu = poisoned(ctx, shape_of(s), dtype, gpu);
    Tensor gw_cpu = poisoned(ctx, Shape{s.d}, dtype), gw_gpu = poisoned(ctx, Shape{s.d}, dtype, gpu);
    ops::rmsnorm_backward(grad_y.tensor, x.tensor, weight.tensor, rstd_cpu, gx_cpu, gw_cpu);
    ops::rmsnorm_backward(grad_y.tensor.to(gpu), x.tensor.to(gpu), weight.tensor.to(gpu), rstd_cpu.to(gpu), gx_gpu,
                          gw_gpu);
    Tolerance sums = device_tolerance(dtype);  // column sums over up to 6007 rows, in another order
    sums.abs = std::max(sums.abs, 1e-4);
    EXPECT_TRUE(all_close(gx_gpu, gx_cpu, norm_tolerance(dtype))) << "grad_x, d " << s.d;
    EXPECT_TRUE(all_close(gw_gpu, gw_cpu, sums)) << "grad_weight, d " << s.d;
  }
}

INSTANTIATE_FLOAT_DTYPES(RmsNorm);

// ---------------------------------------------------------------------------
// exp_f32, the host exponential every row operator uses
// ---------------------------------------------------------------------------
TEST(RowwiseMath, ExpIsWithinTwoUlp) {
  for (float x = -103.0f; x < 88.7f; x += 0.0137f) {
    const double expected = std::exp(double(x));
    if (expected < double(std::numeric_limits<float>::min())) continue;  // subnormal results: absolute error only
    const double ulp = std::nextafter(float(expected), INFINITY) - float(expected);
    ASSERT_LE(std::abs(double(exp_f32(x)) - expected), 2 * ulp) << "x = " << x;
  }
  EXPECT_EQ(exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(exp_f32(-200.0f), 0.0f);
  EXPECT_EQ(exp_f32(INFINITY), INFINITY);
  EXPECT_EQ(exp_f32(100.0f), INFINITY);
  EXPECT_TRUE(std::isnan(exp_f32(NAN)));
  EXPECT_EQ(exp_f32(0.0f), 1.0f);
}

// ---------------------------------------------------------------------------
// Argument checks
// ---------------------------------------------------------------------------
TEST(RowwiseArguments, Softmax) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor wrong_shape = ctx.zeros(Shape{4, 6}, DType::f32), wrong_dtype = ctx.zeros(Shape{4, 5}, DType::bf16);
  EXPECT_THROW(ops::softmax_forward(x, wrong_shape), Error);
  EXPECT_THROW(ops::softmax_forward(x, wrong_dtype), Error);
  Tensor ints = ctx.zeros(Shape{4, 5}, DType::i32);
  EXPECT_THROW(ops::softmax_forward(ints, ints), Error);
  EXPECT_THROW(ops::softmax_backward(x, x, wrong_shape), Error);
  Tensor y = ctx.zeros(Shape{4, 5}, DType::f32);
  EXPECT_NO_THROW(ops::softmax_forward(x, y));
}

TEST(RowwiseArguments, CrossEntropy) {
  Context ctx;
  Tensor logits = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor targets = ctx.zeros(Shape{4}, DType::i64), float_targets = ctx.zeros(Shape{4}, DType::f32);
  Tensor losses = ctx.zeros(Shape{4}, DType::f32), lse = ctx.zeros(Shape{4}, DType::f32);
  Tensor short_losses = ctx.zeros(Shape{3}, DType::f32), bf16_losses = ctx.zeros(Shape{4}, DType::bf16);
  EXPECT_THROW(ops::cross_entropy_forward(logits, float_targets, losses, lse), Error);
  EXPECT_THROW(ops::cross_entropy_forward(logits, targets, short_losses, lse), Error);
  EXPECT_THROW(ops::cross_entropy_forward(logits, targets, bf16_losses, lse), Error);
  EXPECT_THROW(ops::cross_entropy_forward(logits, ctx.zeros(Shape{5}, DType::i32), losses, lse), Error);
  EXPECT_NO_THROW(ops::cross_entropy_forward(logits, targets, losses, lse));
  Tensor grad = ctx.zeros(Shape{4, 5}, DType::bf16);
  EXPECT_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, grad), Error);
  EXPECT_NO_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, logits));
}

TEST(RowwiseArguments, LayerNorm) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32), y = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor weight = ctx.full(Shape{5}, DType::f32, 1.0), bias = ctx.zeros(Shape{5}, DType::f32);
  Tensor mean = ctx.zeros(Shape{4}, DType::f32), rstd = ctx.zeros(Shape{4}, DType::f32);
  EXPECT_THROW(ops::layernorm_forward(x, ctx.zeros(Shape{4}, DType::f32), bias, y, mean, rstd), Error);
  EXPECT_THROW(ops::layernorm_forward(x, weight, ctx.zeros(Shape{5}, DType::bf16), y, mean, rstd), Error);
  Tensor wrong_mean = ctx.zeros(Shape{5}, DType::f32);
  EXPECT_THROW(ops::layernorm_forward(x, weight, bias, y, wrong_mean, rstd), Error);
  EXPECT_THROW(ops::layernorm_forward(x, weight, bias, y, mean, rstd, -1.0f), Error);
  EXPECT_NO_THROW(ops::layernorm_forward(x, weight, Tensor(), y, mean, rstd));
  Tensor grad_x = ctx.zeros(Shape{4, 5}, DType::f32), grad_w = ctx.zeros(Shape{5}, DType::f32);
  Tensor bad_grad_b = ctx.zeros(Shape{6}, DType::f32);
  EXPECT_THROW(ops::layernorm_backward(y, x, weight, mean, rstd, grad_x, grad_w, &bad_grad_b), Error);
  EXPECT_THROW(ops::layernorm_backward(y, x, weight, mean, rstd, grad_x, bad_grad_b, nullptr), Error);
  EXPECT_NO_THROW(ops::layernorm_backward(y, x, weight, mean, rstd, grad_x, grad_w, nullptr));
}

TEST(RowwiseArguments, RmsNorm) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f16), y = ctx.zeros(Shape{4, 5}, DType::f16);
  Tensor weight = ctx.full(Shape{5}, DType::f16, 1.0), rstd = ctx.zeros(Shape{4}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_forward(x, ctx.full(Shape{5}, DType::f32, 1.0), y, rstd), Error);
  Tensor f16_rstd = ctx.zeros(Shape{4}, DType::f16);
  EXPECT_THROW(ops::rmsnorm_forward(x, weight, y, f16_rstd), Error);
  EXPECT_NO_THROW(ops::rmsnorm_forward(x, weight, y, rstd));
  Tensor grad_x = ctx.zeros(Shape{4, 5}, DType::f16), grad_w = ctx.zeros(Shape{5}, DType::f16);
  Tensor f32_grad_w = ctx.zeros(Shape{5}, DType::f32), transposed_grad_x = ctx.zeros(Shape{5, 4}, DType::f16);
  EXPECT_THROW(ops::rmsnorm_backward(y, x, weight, rstd, grad_x, f32_grad_w), Error);
  EXPECT_THROW(ops::rmsnorm_backward(y, x, weight, rstd, transposed_grad_x, grad_w), Error);
  EXPECT_NO_THROW(ops::rmsnorm_backward(y, x, weight, rstd, grad_x, grad_w));
}

}  // namespace
}  // namespace tessera::testing
