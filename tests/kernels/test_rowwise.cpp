// Softmax, cross-entropy (whole and vocabulary-parallel), LayerNorm and
// RMSNorm: forward against double references, backward against central
// differences of those references, GPU against CPU, and argument checks. Every dtype; rows of length 1, 3, 129,
// 1000 (and a GPT-sized vocabulary), enough rows to cross the CPU's threading
// grain, and logits of magnitude 100 for stability (exp(100) overflows f32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

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
// VocabParallelCrossEntropy: logits [N, V] split by columns into shards, the
// three steps run on every shard with the all-reduces done here on the host
// (in f32, as a communicator would), against the double reference of the
// whole cross-entropy
// ---------------------------------------------------------------------------
struct VocabSplit {
  int64_t rows;
  std::vector<int64_t> widths;  // of the shards, in vocabulary order; V is their sum

  int64_t vocab() const {
    int64_t v = 0;
    for (const int64_t w : widths) v += w;
    return v;
  }
  std::vector<int64_t> begins() const {
    std::vector<int64_t> out;
    int64_t begin = 0;
    for (const int64_t w : widths) out.push_back(std::exchange(begin, begin + w));
    return out;
  }
};

// Columns [begin, begin + width) of the row-major [rows, v] `values`.
std::vector<double> column_slice(const std::vector<double>& values, int64_t v, int64_t begin, int64_t width) {
  std::vector<double> out;
  for (size_t r = 0; r < values.size() / size_t(v); ++r) {
    const auto row = values.begin() + ptrdiff_t(r * v + begin);
    out.insert(out.end(), row, row + width);
  }
  return out;
}

// The shards of the [rows, V] `values` (already rounded to `dtype`, so stored exactly).
std::vector<Tensor> split_columns(Context& ctx, const std::vector<double>& values, const VocabSplit& split, DType dtype,
                                  Device device) {
  std::vector<Tensor> shards;
  const std::vector<int64_t> begins = split.begins();
  for (size_t k = 0; k < begins.size(); ++k)
    shards.push_back(ctx.from_doubles(Shape{split.rows, split.widths[k]}, dtype,
                                      column_slice(values, split.vocab(), begins[k], split.widths[k]), device));
  return shards;
}

struct ShardedForward {
  Tensor row_max;                         // the all-reduced maxima [N] f32
  std::vector<std::vector<double>> sums;  // every shard's own sums [2, N], before the all-reduce
  Tensor losses, logsumexp;               // [N] f32, from cross_entropy_shard_finish
};

// Steps 1–3 on every shard (on the shards' device), outputs poisoned first;
// max and sum all-reduced on the host in f32, the sums added in shard order.
ShardedForward sharded_forward(Context& ctx, const std::vector<Tensor>& shards, const VocabSplit& split,
                               const Tensor& targets, int64_t ignore_index) {
  const Device device = targets.device();
  const int64_t n = split.rows;
  const std::vector<int64_t> begins = split.begins();
  std::vector<double> global_max(size_t(n), -INFINITY);
  for (const Tensor& shard : shards) {
    Tensor row_max = poisoned(ctx, Shape{n}, DType::f32, device);
    ops::cross_entropy_shard_max(shard, row_max);
    const std::vector<double> m = row_max.to_doubles();
    for (size_t r = 0; r < size_t(n); ++r) global_max[r] = std::max(global_max[r], m[r]);
  }
  ShardedForward out;
  out.row_max = ctx.from_doubles(Shape{n}, DType::f32, global_max, device);
  std::vector<float> total(size_t(2 * n), 0.0f);
  for (size_t k = 0; k < shards.size(); ++k) {
    Tensor sums = poisoned(ctx, Shape{2, n}, DType::f32, device);
    ops::cross_entropy_shard_sums(shards[k], targets, out.row_max, begins[k], sums, ignore_index);
    out.sums.push_back(sums.to_doubles());
    for (size_t i = 0; i < total.size(); ++i) total[i] += float(out.sums.back()[i]);
  }
  const Tensor total_sums =
      ctx.from_doubles(Shape{2, n}, DType::f32, std::vector<double>(total.begin(), total.end()), device);
  out.losses = poisoned(ctx, Shape{n}, DType::f32, device);
  out.logsumexp = poisoned(ctx, Shape{n}, DType::f32, device);
  ops::cross_entropy_shard_finish(out.row_max, total_sums, targets, split.vocab(), out.losses, out.logsumexp,
                                  ignore_index);
  return out;
}

// The double reference gradient of the whole cross-entropy: grad_losses·(softmax − one-hot),
// 0 on ignored rows, NaN on rows whose target is outside [0, v).
std::vector<double> cross_entropy_gradient_reference(const std::vector<double>& logits,
                                                     const std::vector<double>& targets,
                                                     const std::vector<double>& grad_losses, int64_t v,
                                                     int64_t ignore_index) {
  std::vector<double> grad = softmax_reference(logits, v);
  for (size_t r = 0; r < targets.size(); ++r) {
    const auto t = int64_t(targets[r]);
    for (int64_t i = 0; i < v; ++i) {
      double& g = grad[r * v + i];
      if (t == ignore_index)
        g = 0;
      else if (t < 0 || t >= v)
        g = kNan;
      else
        g = grad_losses[r] * (g - (i == t ? 1.0 : 0.0));
    }
  }
  return grad;
}

struct VocabCase {
  VocabSplit split;
  double magnitude;
  int64_t ignore_index;
};
// Uneven shards, a shard of one column, one shard (the whole vocabulary), an
// ignore_index inside the vocabulary, logits large enough that a shard's own
// sums underflow against the global maximum, and a GPT-sized vocabulary.
const VocabCase kVocabCases[] = {{{37, {13, 20, 17}}, 4, kIgnore},
                                 {{37, {50}}, 4, kIgnore},
                                 {{301, {1, 64, 64}}, kLargeLogit, 5},
                                 {{41, {333, 1, 666}}, kLargeLogit, kIgnore},
                                 {{6, {25129, 25128}}, 8, kIgnore}};

class VocabParallelCrossEntropy : public DtypeTest {};

TEST_P(VocabParallelCrossEntropy, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    for (const VocabCase& c : kVocabCases) {
      const VocabSplit& split = c.split;
      const int64_t n = split.rows, v = split.vocab();
      auto logits = random_tensor(ctx, Shape{n, v}, dtype, rng, -c.magnitude, c.magnitude);
      const Targets targets = make_targets(ctx, n, v, index_dtype, rng, c.ignore_index, /*invalid=*/true);
      const std::vector<Tensor> shards = split_columns(ctx, logits.values, split, dtype, Device::cpu());
      const ShardedForward out = sharded_forward(ctx, shards, split, targets.tensor, c.ignore_index);
      const std::string where = std::string(dtype_name(index_dtype)) + " targets, v " + std::to_string(v) + ", " +
                                std::to_string(split.widths.size()) + " shards";

      // Each step's own contract: the maxima, then every shard's sums.
      const auto reference = cross_entropy_reference(logits.values, targets.values, v, c.ignore_index);
      const Tolerance tolerance = f32_tolerance(c.magnitude + std::log(double(v)));
      // sums[0] is exp(logsumexp − max) summed over the shards: the logsumexp's tolerance, an absolute error
      // in log sums, is this relative error in sums (f32 sums of up to 25k terms lose ~3e-5 here).
      double largest_lse = 0;
      for (const double lse : reference.logsumexp) largest_lse = std::max(largest_lse, std::abs(lse));
      const Tolerance sum_tolerance{tolerance.rel * largest_lse + tolerance.abs, 1e-7};
      std::vector<double> expected_max;
      for (int64_t r = 0; r < n; ++r) {
        const double* xr = &logits.values[r * v];
        expected_max.push_back(*std::max_element(xr, xr + v));
      }
      EXPECT_TRUE(all_close(out.row_max, expected_max, Tolerance{0, 0})) << "all-reduced row_max, " << where;
      const std::vector<int64_t> begins = split.begins();
      for (size_t k = 0; k < begins.size(); ++k) {
        std::vector<double> expected_sums(size_t(2 * n));
        for (int64_t r = 0; r < n; ++r) {
          const double* xr = &logits.values[r * v];
          for (int64_t i = begins[k]; i < begins[k] + split.widths[k]; ++i)
            expected_sums[r] += std::exp(xr[i] - expected_max[r]);
          const auto t = int64_t(targets.values[r]);
          const bool here = t != c.ignore_index && t >= begins[k] && t < begins[k] + split.widths[k];
          expected_sums[n + r] = here ? xr[t] : 0.0;
        }
        const std::vector<double> sum_exp(out.sums[k].begin(), out.sums[k].begin() + n);
        const std::vector<double> picked(out.sums[k].begin() + n, out.sums[k].end());
        EXPECT_TRUE(
            all_close(sum_exp, std::vector<double>(expected_sums.begin(), expected_sums.begin() + n), sum_tolerance))
            << "sums[0] of shard " << k << ", " << where;
        // The target's logit is copied, not computed: exact.
        EXPECT_TRUE(
            all_close(picked, std::vector<double>(expected_sums.begin() + n, expected_sums.end()), Tolerance{0, 0}))
            << "sums[1] of shard " << k << ", " << where;
      }

      // The finished losses and logsumexp against the whole cross-entropy.
      EXPECT_TRUE(close_or_both_nan(out.losses, reference.losses, tolerance)) << "losses, " << where;
      EXPECT_TRUE(all_close(out.logsumexp, reference.logsumexp, tolerance)) << "logsumexp, " << where;
      const std::vector<double> loss_values = out.losses.to_doubles();
      EXPECT_TRUE(std::isnan(loss_values[1]) && std::isnan(loss_values[3]))
          << "targets v and -1 give NaN losses, " << where;
      for (size_t r = 0; r < targets.values.size(); ++r) {
        if (targets.values[r] == double(c.ignore_index)) {
          EXPECT_EQ(loss_values[r], 0.0) << "ignored row " << r << ", " << where;
        }
      }
    }
  }
}

TEST_P(VocabParallelCrossEntropy, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    for (const VocabCase& c : kVocabCases) {
      const VocabSplit& split = c.split;
      const int64_t n = split.rows, v = split.vocab();
      auto logits = random_tensor(ctx, Shape{n, v}, dtype, rng, -c.magnitude, c.magnitude);
      const Targets targets = make_targets(ctx, n, v, index_dtype, rng, c.ignore_index, /*invalid=*/true);
      auto grad_losses = random_tensor(ctx, Shape{n}, DType::f32, rng, -2, 2);
      const std::vector<Tensor> shards = split_columns(ctx, logits.values, split, dtype, Device::cpu());
      // The global logsumexp, as every rank has it after the forward.
      const Tensor lse = sharded_forward(ctx, shards, split, targets.tensor, c.ignore_index).logsumexp;
      const std::vector<double> expected =
          cross_entropy_gradient_reference(logits.values, targets.values, grad_losses.values, v, c.ignore_index);
      Tolerance tolerance = backward_tolerance(dtype);
      // exp(x − lse) with |lse| up to magnitude + log v (see f32_tolerance).
      tolerance.abs = std::max(tolerance.abs, 2 * 8 * kF32Epsilon * (c.magnitude + std::log(double(v))));
      const std::vector<int64_t> begins = split.begins();
      for (size_t k = 0; k < shards.size(); ++k) {
        Tensor grad = poisoned(ctx, Shape{n, split.widths[k]}, dtype);
        ops::cross_entropy_backward(shards[k], lse, targets.tensor, grad_losses.tensor, grad, c.ignore_index, begins[k],
                                    v);
        EXPECT_TRUE(close_or_both_nan(grad, column_slice(expected, v, begins[k], split.widths[k]), tolerance))
            << "shard " << k << " [" << begins[k] << ", " << begins[k] + split.widths[k] << ") of v " << v << ", "
            << index_dtype << " targets";
      }
      // The whole vocabulary spelled out is the default, bit for bit.
      Tensor grad_default = poisoned(ctx, Shape{n, v}, dtype), grad_explicit = poisoned(ctx, Shape{n, v}, dtype);
      ops::cross_entropy_backward(logits.tensor, lse, targets.tensor, grad_losses.tensor, grad_default, c.ignore_index);
      ops::cross_entropy_backward(logits.tensor, lse, targets.tensor, grad_losses.tensor, grad_explicit, c.ignore_index,
                                  0, v);
      EXPECT_TRUE(close_or_both_nan(grad_explicit, grad_default.to_doubles(), Tolerance{0, 0}))
          << "vocab_begin 0, vocab_size v against the defaults, v " << v;
    }
  }
}

// Targets outside [0, vocab_size), at the edges and far out (where
// target − vocab_begin would overflow), give NaN losses and NaN gradient rows
// on every shard; ignored rows give 0 and zero rows; the others are finite.
TEST_P(VocabParallelCrossEntropy, OutOfRangeTargets) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const VocabSplit split{8, {3, 4}};
  const int64_t n = split.rows, v = split.vocab();
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    const double far = index_dtype == DType::i32 ? 2147483647.0 : 1099511627776.0;  // INT32_MAX, 2^40
    const double lowest = index_dtype == DType::i32 ? -2147483648.0 : -9223372036854775808.0;
    const std::vector<double> target_values = {double(v), -1, far, lowest, 2, double(kIgnore), 6, 0};
    const std::vector<bool> out_of_range = {true, true, true, true, false, false, false, false};
    const Tensor targets = ctx.from_doubles(Shape{n}, index_dtype, target_values);
    auto logits = random_tensor(ctx, Shape{n, v}, dtype, rng, -4, 4);
    auto grad_losses = random_tensor(ctx, Shape{n}, DType::f32, rng, 0.5, 2);
    const std::vector<Tensor> shards = split_columns(ctx, logits.values, split, dtype, Device::cpu());
    const ShardedForward out = sharded_forward(ctx, shards, split, targets, kIgnore);
    const std::vector<double> losses = out.losses.to_doubles();
    for (int64_t r = 0; r < n; ++r) {
      const std::string what = "row " + std::to_string(r) + ", target " + std::to_string(int64_t(target_values[r])) +
                               ", " + std::string(dtype_name(index_dtype));
      if (out_of_range[r])
        EXPECT_TRUE(std::isnan(losses[r])) << what << ": loss " << losses[r];
      else if (target_values[r] == double(kIgnore))
        EXPECT_EQ(losses[r], 0.0) << what;
      else
        EXPECT_TRUE(std::isfinite(losses[r]) && losses[r] > 0) << what << ": loss " << losses[r];
    }
    const std::vector<int64_t> begins = split.begins();
    for (size_t k = 0; k < shards.size(); ++k) {
      Tensor grad = poisoned(ctx, Shape{n, split.widths[k]}, dtype);
      ops::cross_entropy_backward(shards[k], out.logsumexp, targets, grad_losses.tensor, grad, kIgnore, begins[k], v);
      const std::vector<double> g = grad.to_doubles();
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t i = 0; i < split.widths[k]; ++i) {
          const double value = g[r * split.widths[k] + i];
          const std::string what = "shard " + std::to_string(k) + ", row " + std::to_string(r) + ", column " +
                                   std::to_string(i) + ", " + std::string(dtype_name(index_dtype));
          if (out_of_range[r])
            EXPECT_TRUE(std::isnan(value)) << what << ": " << value;
          else if (target_values[r] == double(kIgnore))
            EXPECT_EQ(value, 0.0) << what;
          else
            EXPECT_TRUE(std::isfinite(value)) << what << ": " << value;
        }
      }
    }
  }
}

TEST_P(VocabParallelCrossEntropy, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const DType index_dtype : {DType::i32, DType::i64}) {
    for (const VocabCase& c : kVocabCases) {
      const VocabSplit& split = c.split;
      const int64_t n = split.rows, v = split.vocab();
      auto logits = random_tensor(ctx, Shape{n, v}, dtype, rng, -c.magnitude, c.magnitude);
      const Targets targets = make_targets(ctx, n, v, index_dtype, rng, c.ignore_index, /*invalid=*/true);
      auto grad_losses = random_tensor(ctx, Shape{n}, DType::f32, rng, -2, 2);
      const std::vector<Tensor> shards_cpu = split_columns(ctx, logits.values, split, dtype, Device::cpu());
      const std::vector<Tensor> shards_gpu = split_columns(ctx, logits.values, split, dtype, gpu);
      const Tensor targets_gpu = targets.tensor.to(gpu);
      const ShardedForward cpu = sharded_forward(ctx, shards_cpu, split, targets.tensor, c.ignore_index);
      const ShardedForward gpu_out = sharded_forward(ctx, shards_gpu, split, targets_gpu, c.ignore_index);
      const Tolerance tolerance = f32_tolerance(c.magnitude + std::log(double(v)));
      EXPECT_TRUE(close_or_both_nan(gpu_out.losses, cpu.losses.to_doubles(), tolerance)) << "losses, v " << v;
      EXPECT_TRUE(all_close(gpu_out.logsumexp, cpu.logsumexp, tolerance)) << "logsumexp, v " << v;
      Tolerance grad_tolerance = device_tolerance(dtype);
      grad_tolerance.abs = std::max(grad_tolerance.abs, 16 * kF32Epsilon * (c.magnitude + std::log(double(v))));
      const std::vector<int64_t> begins = split.begins();
      for (size_t k = 0; k < shards_cpu.size(); ++k) {
        Tensor grad_cpu = poisoned(ctx, Shape{n, split.widths[k]}, dtype);
        Tensor grad_gpu = shards_gpu[k];  // in place on the device
        ops::cross_entropy_backward(shards_cpu[k], cpu.logsumexp, targets.tensor, grad_losses.tensor, grad_cpu,
                                    c.ignore_index, begins[k], v);
        ops::cross_entropy_backward(grad_gpu, gpu_out.logsumexp, targets_gpu, grad_losses.tensor.to(gpu), grad_gpu,
                                    c.ignore_index, begins[k], v);
        EXPECT_TRUE(close_or_both_nan(grad_gpu, grad_cpu.to_doubles(), grad_tolerance))
            << "backward, shard " << k << " of v " << v;
      }
    }
  }
}

INSTANTIATE_FLOAT_DTYPES(VocabParallelCrossEntropy);

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

TEST(RowwiseArguments, VocabParallelCrossEntropy) {
  Context ctx;
  Tensor logits = ctx.zeros(Shape{4, 5}, DType::f32), targets = ctx.zeros(Shape{4}, DType::i64);
  Tensor row_max = ctx.zeros(Shape{4}, DType::f32), sums = ctx.zeros(Shape{2, 4}, DType::f32);
  Tensor losses = ctx.zeros(Shape{4}, DType::f32), lse = ctx.zeros(Shape{4}, DType::f32);
  Tensor long_row_max = ctx.zeros(Shape{5}, DType::f32), bf16_row_max = ctx.zeros(Shape{4}, DType::bf16);
  EXPECT_THROW(ops::cross_entropy_shard_max(logits, long_row_max), Error);
  EXPECT_THROW(ops::cross_entropy_shard_max(logits, bf16_row_max), Error);
  EXPECT_NO_THROW(ops::cross_entropy_shard_max(logits, row_max));
  Tensor flat_sums = ctx.zeros(Shape{8}, DType::f32), transposed_sums = ctx.zeros(Shape{4, 2}, DType::f32);
  EXPECT_THROW(ops::cross_entropy_shard_sums(logits, targets, row_max, 0, flat_sums), Error);
  EXPECT_THROW(ops::cross_entropy_shard_sums(logits, targets, row_max, 0, transposed_sums), Error);
  EXPECT_THROW(ops::cross_entropy_shard_sums(logits, targets, row_max, -1, sums), Error);
  EXPECT_THROW(ops::cross_entropy_shard_sums(logits, ctx.zeros(Shape{4}, DType::f32), row_max, 0, sums), Error);
  EXPECT_THROW(ops::cross_entropy_shard_sums(logits, targets, ctx.zeros(Shape{3}, DType::f32), 0, sums), Error);
  EXPECT_NO_THROW(ops::cross_entropy_shard_sums(logits, targets, row_max, 10, sums));
  EXPECT_THROW(ops::cross_entropy_shard_finish(row_max, sums, targets, 0, losses, lse), Error);
  EXPECT_THROW(ops::cross_entropy_shard_finish(row_max, transposed_sums, targets, 15, losses, lse), Error);
  EXPECT_THROW(ops::cross_entropy_shard_finish(row_max, sums, targets, 15, long_row_max, lse), Error);
  EXPECT_NO_THROW(ops::cross_entropy_shard_finish(row_max, sums, targets, 15, losses, lse));
  // The backward's shard must lie within the vocabulary.
  EXPECT_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, logits, kIgnore, -1, 15), Error);
  EXPECT_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, logits, kIgnore, 11, 15), Error);
  EXPECT_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, logits, kIgnore, 1, 0), Error);
  EXPECT_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, logits, kIgnore, 0, -5), Error);
  EXPECT_NO_THROW(ops::cross_entropy_backward(logits, lse, targets, losses, logits, kIgnore, 10, 15));
  try {
    ops::cross_entropy_backward(logits, lse, targets, losses, logits, kIgnore, 11, 15);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_backward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("vocab_size"), std::string::npos) << e.what();
  }
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
