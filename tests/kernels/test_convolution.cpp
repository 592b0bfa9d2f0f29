// Conv2d and MaxPool2d: forward against double references (stride, padding,
// odd sizes, sizes that drop trailing input rows, first layers with one input
// channel), backward against central differences of those references and
// against a direct double computation on a larger case, accumulation, GPU
// against CPU, and argument checks. Every dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "core/parallel_for.h"
#include "kernels/functors/convolution.h"
#include "kernels/functors/pooling.h"
#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

// ---------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------

struct ConvCase {
  int64_t n, c, h, w, k, r, s;
  ops::Conv2dParams params;
  bool bias;

  Shape x_shape() const { return {n, c, h, w}; }
  Shape weight_shape() const { return {k, c, r, s}; }
  Shape y_shape() const { return ops::conv2d_output_shape(x_shape(), weight_shape(), params); }
};

// y[n,k,p,q] = bias[k] + Σ_{c,r,s} x[n, c, p·sh − ph + r, q·sw − pw + s]·w[k,c,r,s] (zero outside x).
// `magnitude`, if given, receives the largest Σ|terms| of any output (what f32 rounding scales with).
std::vector<double> conv_reference(const ConvCase& cc, const std::vector<double>& x, const std::vector<double>& w,
                                   const std::vector<double>& bias, double* magnitude = nullptr) {
  if (magnitude) *magnitude = 0;
  const Shape ys = cc.y_shape();
  const int64_t P = ys[2], Q = ys[3];
  std::vector<double> y(size_t(ys.numel()));
  for (int64_t n = 0; n < cc.n; ++n)
    for (int64_t k = 0; k < cc.k; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          double sum = bias.empty() ? 0.0 : bias[size_t(k)];
          double terms = std::abs(sum);
          for (int64_t c = 0; c < cc.c; ++c)
            for (int64_t r = 0; r < cc.r; ++r) {
              const int64_t h = p * cc.params.stride_h - cc.params.pad_h + r;
              if (h < 0 || h >= cc.h) continue;
              for (int64_t s = 0; s < cc.s; ++s) {
                const int64_t iw = q * cc.params.stride_w - cc.params.pad_w + s;
                if (iw < 0 || iw >= cc.w) continue;
                const double term = x[size_t(((n * cc.c + c) * cc.h + h) * cc.w + iw)] *
                                    w[size_t(((k * cc.c + c) * cc.r + r) * cc.s + s)];
                sum += term;
                terms += std::abs(term);
              }
            }
          y[size_t(((n * cc.k + k) * P + p) * Q + q)] = sum;
          if (magnitude) *magnitude = std::max(*magnitude, terms);
        }
  return y;
}

struct ConvGradients {
  std::vector<double> x, w, bias;
  double x_magnitude = 0, w_magnitude = 0, bias_magnitude = 0;  // the largest Σ|terms| of each
};

// The exact gradients, computed directly (for cases too large for central differences), and
// the magnitudes their f32 rounding scales with.
ConvGradients conv_gradients_reference(const ConvCase& cc, const std::vector<double>& x, const std::vector<double>& w,
                                       const std::vector<double>& grad_y) {
  const Shape ys = cc.y_shape();
  const int64_t P = ys[2], Q = ys[3];
  ConvGradients g{std::vector<double>(x.size()), std::vector<double>(w.size()), std::vector<double>(size_t(cc.k))};
  std::vector<double> x_terms(x.size()), w_terms(w.size()), bias_terms(size_t(cc.k));
  for (int64_t n = 0; n < cc.n; ++n)
    for (int64_t k = 0; k < cc.k; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          const double gy = grad_y[size_t(((n * cc.k + k) * P + p) * Q + q)];
          g.bias[size_t(k)] += gy;
          bias_terms[size_t(k)] += std::abs(gy);
          for (int64_t c = 0; c < cc.c; ++c)
            for (int64_t r = 0; r < cc.r; ++r) {
              const int64_t h = p * cc.params.stride_h - cc.params.pad_h + r;
              if (h < 0 || h >= cc.h) continue;
              for (int64_t s = 0; s < cc.s; ++s) {
                const int64_t iw = q * cc.params.stride_w - cc.params.pad_w + s;
                if (iw < 0 || iw >= cc.w) continue;
                const size_t xi = size_t(((n * cc.c + c) * cc.h + h) * cc.w + iw);
                const size_t wi = size_t(((k * cc.c + c) * cc.r + r) * cc.s + s);
                g.x[xi] += gy * w[wi];
                g.w[wi] += gy * x[xi];
                x_terms[xi] += std::abs(gy * w[wi]);
                w_terms[wi] += std::abs(gy * x[xi]);
              }
            }
        }
  g.x_magnitude = *std::max_element(x_terms.begin(), x_terms.end());
  g.w_magnitude = *std::max_element(w_terms.begin(), w_terms.end());
  g.bias_magnitude = *std::max_element(bias_terms.begin(), bias_terms.end());
  return g;
}

ops::Conv2dParams conv_params(int stride_h, int stride_w, int pad_h, int pad_w) {
  ops::Conv2dParams p;
  p.stride_h = stride_h, p.stride_w = stride_w, p.pad_h = pad_h, p.pad_w = pad_w;
  return p;
}

// Forward cases: 'same' padding; strides that drop trailing input rows and columns (oneDNN sees a
// negative right padding); a wide layer crossing oneDNN's 16-channel blocks and the threading
// grain; a first layer with one input channel; a 1×1 kernel.
const std::vector<ConvCase> kForwardCases = {
    {3, 5, 13, 11, 7, 3, 3, conv_params(1, 1, 1, 1), true},  {2, 3, 12, 15, 4, 3, 2, conv_params(2, 3, 0, 1), false},
    {4, 17, 9, 10, 33, 5, 5, conv_params(1, 1, 2, 2), true}, {5, 1, 14, 13, 8, 5, 5, conv_params(1, 1, 2, 2), true},
    {2, 6, 7, 9, 5, 1, 1, conv_params(2, 2, 0, 0), false},
};

// Small cases for central differences: input channels below and above the point where f32
// backward data switches from plain to blocked layouts, strides that drop rows, asymmetric padding.
const std::vector<ConvCase> kBackwardCases = {
    {2, 5, 7, 6, 4, 3, 3, conv_params(1, 1, 1, 1), true},
    {2, 2, 8, 9, 3, 3, 2, conv_params(2, 3, 1, 0), true},
    {2, 1, 6, 7, 5, 5, 5, conv_params(1, 1, 2, 2), true},
};

// A LeNet-like second layer, checked against conv_gradients_reference.
const ConvCase kLargeBackwardCase{3, 19, 11, 12, 34, 5, 5, conv_params(1, 1, 2, 2), true};

// f32 sums of n products round at every step: the error grows with Σ|terms| (observed up to
// 1.4·2^-24 times it for oneDNN, more for a naive loop) while the result may cancel to near zero,
// so every tolerance gets an absolute term of 4·2^-24·Σ|terms| (the largest over the tensor) on
// top of dtype_params' bounds; f32 also gets rel 1e-5. bf16/f16 results are rounded once.
double accumulation_slack(double magnitude) {
  return 4 * std::ldexp(1.0, -24) * magnitude;
}

Tolerance conv_tolerance(DType dtype, bool backward, double magnitude) {
  Tolerance t = dtype == DType::f32 ? Tolerance{1e-5, 1e-6}
                : backward          ? backward_tolerance(dtype)
                                    : forward_tolerance(dtype);
  t.abs += accumulation_slack(magnitude);
  return t;
}

void run_conv_backward(const ConvCase& cc, const Tensor& grad_y, const Tensor& x, const Tensor& w, Tensor* grad_x,
                       Tensor* grad_w, Tensor* grad_b, bool accumulate = false) {
  ops::conv2d_backward(grad_y, x, w, grad_x, grad_w, grad_b, cc.params, accumulate);
}

class Conv2d : public DtypeTest {};

TEST_P(Conv2d, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const ConvCase& cc : kForwardCases) {
    SCOPED_TRACE("x " + cc.x_shape().to_string() + " weight " + cc.weight_shape().to_string());
    auto x = random_tensor(ctx, cc.x_shape(), dtype, rng);
    auto w = random_tensor(ctx, cc.weight_shape(), dtype, rng);
    auto b = random_tensor(ctx, Shape{cc.k}, dtype, rng);
    Tensor y = poisoned(ctx, cc.y_shape(), dtype);
    const Tensor bias = cc.bias ? b.tensor : Tensor();
    ops::conv2d_forward(x.tensor, w.tensor, bias, y, cc.params);
    double magnitude = 0;
    const auto expected =
        conv_reference(cc, x.values, w.values, cc.bias ? b.values : std::vector<double>{}, &magnitude);
    EXPECT_TRUE(all_close(y, expected, conv_tolerance(dtype, false, magnitude)));
  }
}

TEST_P(Conv2d, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const ConvCase& cc : kBackwardCases) {
    SCOPED_TRACE("x " + cc.x_shape().to_string() + " weight " + cc.weight_shape().to_string());
    auto x = random_tensor(ctx, cc.x_shape(), dtype, rng);
    auto w = random_tensor(ctx, cc.weight_shape(), dtype, rng);
    auto b = random_tensor(ctx, Shape{cc.k}, dtype, rng);
    auto gy = random_tensor(ctx, cc.y_shape(), dtype, rng);
    const auto f = [&](const Inputs& in) { return conv_reference(cc, in[0], in[1], in[2]); };
    const Inputs inputs{x.values, w.values, b.values};
    const auto expected_x = numeric_gradient(f, inputs, 0, gy.values);
    const auto expected_w = numeric_gradient(f, inputs, 1, gy.values);
    const auto expected_b = numeric_gradient(f, inputs, 2, gy.values);
    const ConvGradients exact = conv_gradients_reference(cc, x.values, w.values, gy.values);
    const Tolerance tol_x = conv_tolerance(dtype, true, exact.x_magnitude);
    const Tolerance tol_w = conv_tolerance(dtype, true, exact.w_magnitude);
    const Tolerance tol_b = conv_tolerance(dtype, true, exact.bias_magnitude);

    // All three gradients (the bias gradient fused with the weight gradient where the backend can).
    Tensor gx = poisoned(ctx, cc.x_shape(), dtype), gw = poisoned(ctx, cc.weight_shape(), dtype),
           gb = poisoned(ctx, Shape{cc.k}, dtype);
    run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, &gx, &gw, &gb);
    EXPECT_TRUE(all_close(gx, expected_x, tol_x)) << "grad_x";
    EXPECT_TRUE(all_close(gw, expected_w, tol_w)) << "grad_weight";
    EXPECT_TRUE(all_close(gb, expected_b, tol_b)) << "grad_bias";

    // Each gradient alone.
    Tensor gx_only = poisoned(ctx, cc.x_shape(), dtype), gw_only = poisoned(ctx, cc.weight_shape(), dtype),
           gb_only = poisoned(ctx, Shape{cc.k}, dtype);
    run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, &gx_only, nullptr, nullptr);
    run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, nullptr, &gw_only, nullptr);
    run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, nullptr, nullptr, &gb_only);
    EXPECT_TRUE(all_close(gx_only, expected_x, tol_x)) << "grad_x alone";
    EXPECT_TRUE(all_close(gw_only, expected_w, tol_w)) << "grad_weight alone";
    EXPECT_TRUE(all_close(gb_only, expected_b, tol_b)) << "grad_bias alone";

    // accumulate = true adds to what the outputs hold: with all three, and the bias alone.
    auto gx0 = random_tensor(ctx, cc.x_shape(), dtype, rng);
    auto gw0 = random_tensor(ctx, cc.weight_shape(), dtype, rng);
    auto gb0 = random_tensor(ctx, Shape{cc.k}, dtype, rng);
    auto gb1 = random_tensor(ctx, Shape{cc.k}, dtype, rng);
    run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, &gx0.tensor, &gw0.tensor, &gb0.tensor, true);
    run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, nullptr, nullptr, &gb1.tensor, true);
    const auto plus = [](std::vector<double> base, const std::vector<double>& addend) {
      for (size_t i = 0; i < base.size(); ++i) base[i] += addend[i];
      return base;
    };
    EXPECT_TRUE(all_close(gx0.tensor, plus(gx0.values, expected_x), tol_x)) << "grad_x accumulated";
    EXPECT_TRUE(all_close(gw0.tensor, plus(gw0.values, expected_w), tol_w)) << "grad_weight accumulated";
    EXPECT_TRUE(all_close(gb0.tensor, plus(gb0.values, expected_b), tol_b)) << "grad_bias accumulated";
    EXPECT_TRUE(all_close(gb1.tensor, plus(gb1.values, expected_b), tol_b)) << "grad_bias alone accumulated";
  }

  // A larger case (blocked layouts, channel tails, several threads) against the exact gradients.
  const ConvCase& cc = kLargeBackwardCase;
  auto x = random_tensor(ctx, cc.x_shape(), dtype, rng);
  auto w = random_tensor(ctx, cc.weight_shape(), dtype, rng);
  auto gy = random_tensor(ctx, cc.y_shape(), dtype, rng);
  Tensor gx = poisoned(ctx, cc.x_shape(), dtype), gw = poisoned(ctx, cc.weight_shape(), dtype),
         gb = poisoned(ctx, Shape{cc.k}, dtype);
  run_conv_backward(cc, gy.tensor, x.tensor, w.tensor, &gx, &gw, &gb);
  const ConvGradients expected = conv_gradients_reference(cc, x.values, w.values, gy.values);
  EXPECT_TRUE(all_close(gx, expected.x, conv_tolerance(dtype, true, expected.x_magnitude))) << "large grad_x";
  EXPECT_TRUE(all_close(gw, expected.w, conv_tolerance(dtype, true, expected.w_magnitude))) << "large grad_weight";
  EXPECT_TRUE(all_close(gb, expected.bias, conv_tolerance(dtype, true, expected.bias_magnitude))) << "large grad_bias";
}

// Both devices sum in f32 but in different orders: each is within
// accumulation_slack of the exact sum, so they are within twice that of each
// other; bf16/f16 results may then land one unit apart on their grid. And
// cuDNN's heuristics may choose an FFT or Winograd algorithm for f32 (FMA
// math, but through transforms): Winograd's transform constants cost about
// half of f32's significand (F(6,3) in f32 keeps about 12 bits), FFT's less,
// so an f32 result may differ by 2^-12 of its magnitude Σ|x·w|.
Tolerance conv_device_tolerance(DType dtype, double magnitude) {
  Tolerance t = dtype == DType::f32 ? Tolerance{1e-5, 1e-6} : device_tolerance(dtype);
  t.abs += 2 * accumulation_slack(magnitude);
  if (dtype == DType::f32) t.abs += magnitude * 0x1p-12;
  return t;
}

TEST_P(Conv2d, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const DType dtype = GetParam();
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const ConvCase& cc : kForwardCases) {
    SCOPED_TRACE("x " + cc.x_shape().to_string() + " weight " + cc.weight_shape().to_string());
    auto x = random_tensor(ctx, cc.x_shape(), dtype, rng);
    auto w = random_tensor(ctx, cc.weight_shape(), dtype, rng);
    auto b = random_tensor(ctx, Shape{cc.k}, dtype, rng);
    auto gy = random_tensor(ctx, cc.y_shape(), dtype, rng);
    const Tensor bias = cc.bias ? b.tensor : Tensor();
    double y_magnitude = 0;
    conv_reference(cc, x.values, w.values, cc.bias ? b.values : std::vector<double>{}, &y_magnitude);
    const ConvGradients exact = conv_gradients_reference(cc, x.values, w.values, gy.values);
    Tensor y_cpu = poisoned(ctx, cc.y_shape(), dtype), y_gpu = poisoned(ctx, cc.y_shape(), dtype, gpu);
    ops::conv2d_forward(x.tensor, w.tensor, bias, y_cpu, cc.params);
    ops::conv2d_forward(x.tensor.to(gpu), w.tensor.to(gpu), cc.bias ? b.tensor.to(gpu) : Tensor(), y_gpu, cc.params);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, conv_device_tolerance(dtype, y_magnitude))) << "forward";

    const Tensor x_gpu = x.tensor.to(gpu), w_gpu = w.tensor.to(gpu), gy_gpu = gy.tensor.to(gpu);
    for (const bool accumulate : {false, true}) {
      Tensor gx_cpu = random_tensor(ctx, cc.x_shape(), dtype, rng).tensor,
             gw_cpu = random_tensor(ctx, cc.weight_shape(), dtype, rng).tensor,
             gb_cpu = random_tensor(ctx, Shape{cc.k}, dtype, rng).tensor;
      Tensor gx_gpu = gx_cpu.to(gpu), gw_gpu = gw_cpu.to(gpu), gb_gpu = gb_cpu.to(gpu);
      ops::conv2d_backward(gy.tensor, x.tensor, w.tensor, &gx_cpu, &gw_cpu, &gb_cpu, cc.params, accumulate);
      ops::conv2d_backward(gy_gpu, x_gpu, w_gpu, &gx_gpu, &gw_gpu, &gb_gpu, cc.params, accumulate);
      EXPECT_TRUE(all_close(gx_gpu, gx_cpu, conv_device_tolerance(dtype, exact.x_magnitude)))
          << "grad_x, accumulate " << accumulate;
      EXPECT_TRUE(all_close(gw_gpu, gw_cpu, conv_device_tolerance(dtype, exact.w_magnitude)))
          << "grad_weight, accumulate " << accumulate;
      EXPECT_TRUE(all_close(gb_gpu, gb_cpu, conv_device_tolerance(dtype, exact.bias_magnitude)))
          << "grad_bias, accumulate " << accumulate;
    }
  }
}

INSTANTIATE_FLOAT_DTYPES(Conv2d);

TEST(Conv2d, OutputShape) {
  EXPECT_EQ(ops::conv2d_output_shape(Shape{128, 1, 28, 28}, Shape{32, 1, 5, 5}, conv_params(1, 1, 2, 2)),
            (Shape{128, 32, 28, 28}));
  EXPECT_EQ(ops::conv2d_output_shape(Shape{2, 3, 12, 15}, Shape{4, 3, 3, 2}, conv_params(2, 3, 0, 1)),
            (Shape{2, 4, 5, 6}));
  EXPECT_THROW(ops::conv2d_output_shape(Shape{2, 3, 2, 2}, Shape{4, 3, 3, 3}, conv_params(1, 1, 0, 0)), Error);
  EXPECT_THROW(ops::conv2d_output_shape(Shape{2, 3, 8, 8}, Shape{4, 3, 3, 3}, conv_params(0, 1, 0, 0)), Error);
}

// The CUDA backend adds the bias with Conv2dBiasAdd after cuDNN's convolution; run the functor
// here so its math is checked on machines without a GPU.
TEST(Conv2d, BiasAddFunctorMatchesFusedBias) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const ConvCase& cc = kForwardCases[0];
  auto x = random_tensor(ctx, cc.x_shape(), DType::f32, rng);
  auto w = random_tensor(ctx, cc.weight_shape(), DType::f32, rng);
  auto b = random_tensor(ctx, Shape{cc.k}, DType::f32, rng);
  Tensor fused = poisoned(ctx, cc.y_shape(), DType::f32), separate = poisoned(ctx, cc.y_shape(), DType::f32);
  ops::conv2d_forward(x.tensor, w.tensor, b.tensor, fused, cc.params);
  ops::conv2d_forward(x.tensor, w.tensor, Tensor(), separate, cc.params);
  cpu_for_each_index(separate.numel(), Conv2dBiasAdd<float>{separate.data<float>(), b.tensor.data<float>(), cc.k,
                                                            cc.y_shape()[2] * cc.y_shape()[3]});
  EXPECT_TRUE(all_close(separate, fused, {1e-6, 1e-6}));
}

TEST(Conv2d, RejectsBadArguments) {
  Context ctx;
  const auto p = conv_params(1, 1, 1, 1);
  Tensor x = ctx.zeros(Shape{2, 3, 8, 8}, DType::f32), w = ctx.zeros(Shape{4, 3, 3, 3}, DType::f32);
  Tensor y = ctx.zeros(Shape{2, 4, 8, 8}, DType::f32), b = ctx.zeros(Shape{4}, DType::f32);
  EXPECT_NO_THROW(ops::conv2d_forward(x, w, b, y, p));
  // Channel mismatch between x and weight.
  Tensor w5 = ctx.zeros(Shape{4, 5, 3, 3}, DType::f32);
  EXPECT_THROW(ops::conv2d_forward(x, w5, b, y, p), Error);
  // Output of the wrong shape.
  Tensor y_bad = ctx.zeros(Shape{2, 4, 7, 8}, DType::f32);
  EXPECT_THROW(ops::conv2d_forward(x, w, b, y_bad, p), Error);
  // Bias of the wrong size, weight of another dtype, x not 4-D.
  Tensor b5 = ctx.zeros(Shape{5}, DType::f32);
  EXPECT_THROW(ops::conv2d_forward(x, w, b5, y, p), Error);
  Tensor w_bf16 = ctx.zeros(Shape{4, 3, 3, 3}, DType::bf16);
  EXPECT_THROW(ops::conv2d_forward(x, w_bf16, b, y, p), Error);
  EXPECT_THROW(ops::conv2d_forward(x.view(Shape{6, 8, 8}), w, b, y, p), Error);
  // Backward: gradients of the wrong shape, grad_y of the wrong shape.
  Tensor gw_bad = ctx.zeros(Shape{4, 3, 3, 2}, DType::f32), gx = ctx.zeros(Shape{2, 3, 8, 8}, DType::f32);
  EXPECT_THROW(ops::conv2d_backward(y, x, w, &gx, &gw_bad, nullptr, p), Error);
  EXPECT_THROW(ops::conv2d_backward(y_bad, x, w, &gx, nullptr, nullptr, p), Error);
  EXPECT_THROW(ops::conv2d_backward(y, x, w, nullptr, nullptr, &b5, p), Error);
}

// ---------------------------------------------------------------------------
// Max pooling
// ---------------------------------------------------------------------------

ops::Pool2dParams pool_params(int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w) {
  ops::Pool2dParams p;
  p.kernel_h = kernel_h, p.kernel_w = kernel_w, p.stride_h = stride_h, p.stride_w = stride_w;
  p.pad_h = pad_h, p.pad_w = pad_w;
  return p;
}

struct PoolCase {
  Shape x;
  ops::Pool2dParams params;
  Shape y() const { return ops::maxpool2d_output_shape(x, params); }
};

// Odd sizes (the last row and column dropped), overlapping windows with padding, an asymmetric
// window, and a case large enough to cross the threading grain.
const std::vector<PoolCase> kPoolCases = {
    {Shape{2, 3, 13, 11}, pool_params(2, 2, 2, 2, 0, 0)},
    {Shape{2, 3, 9, 10}, pool_params(3, 3, 2, 2, 1, 1)},
    {Shape{3, 2, 7, 9}, pool_params(3, 2, 1, 2, 1, 0)},
    {Shape{4, 33, 29, 31}, pool_params(3, 3, 2, 2, 1, 1)},
};

struct PoolResult {
  std::vector<double> y, indices;
};

// The maximum over each window (padding excluded), scanning rows then columns, the first maximum
// winning a tie; its index is h·W + w.
PoolResult maxpool_reference(const PoolCase& pc, const std::vector<double>& x) {
  const Shape ys = pc.y();
  const int64_t H = pc.x[2], W = pc.x[3], P = ys[2], Q = ys[3];
  const auto& pp = pc.params;
  PoolResult out{std::vector<double>(size_t(ys.numel())), std::vector<double>(size_t(ys.numel()))};
  for (int64_t plane = 0; plane < pc.x[0] * pc.x[1]; ++plane)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        double best = -INFINITY;
        int64_t arg = -1;
        for (int64_t h = p * pp.stride_h - pp.pad_h; h < p * pp.stride_h - pp.pad_h + pp.kernel_h; ++h)
          for (int64_t w = q * pp.stride_w - pp.pad_w; w < q * pp.stride_w - pp.pad_w + pp.kernel_w; ++w) {
            if (h < 0 || h >= H || w < 0 || w >= W) continue;
            const double v = x[size_t((plane * H + h) * W + w)];
            if (v > best) best = v, arg = h * W + w;
          }
        const size_t i = size_t((plane * P + p) * Q + q);
        out.y[i] = best;
        out.indices[i] = double(arg);
      }
  return out;
}

// grad_x routed by the indices: grad_x[plane, idx] += grad_y[plane, j].
std::vector<double> maxpool_backward_reference(const PoolCase& pc, const std::vector<double>& indices,
                                               const std::vector<double>& grad_y) {
  const Shape ys = pc.y();
  const int64_t plane_in = pc.x[2] * pc.x[3], plane_out = ys[2] * ys[3];
  std::vector<double> gx(size_t(pc.x.numel()));
  for (size_t j = 0; j < grad_y.size(); ++j)
    gx[size_t(int64_t(j) / plane_out * plane_in + int64_t(indices[j]))] += grad_y[j];
  return gx;
}

// Random values, distinct after rounding to `dtype`: no ties, so the maximum is differentiable
// (and the gaps between values dwarf the finite-difference step).
RandomTensor distinct_tensor(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> values;
  std::set<double> seen;
  while (values.size() < size_t(shape.numel())) {
    const double v = round_to(dtype, {dist(rng)})[0];
    if (seen.insert(v).second) values.push_back(v);
  }
  return {ctx.from_doubles(shape, dtype, values), values};
}

class MaxPool2d : public DtypeTest {};

TEST_P(MaxPool2d, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const PoolCase& pc : kPoolCases) {
    SCOPED_TRACE("x " + pc.x.to_string());
    // Random values: bf16 rounding makes ties, which must resolve to the first maximum.
    auto x = random_tensor(ctx, pc.x, dtype, rng);
    Tensor y = poisoned(ctx, pc.y(), dtype), indices = poisoned(ctx, pc.y(), DType::i32);
    ops::maxpool2d_forward(x.tensor, y, indices, pc.params);
    const PoolResult expected = maxpool_reference(pc, x.values);
    EXPECT_TRUE(all_close(y, expected.y, {0, 0})) << "values";
    EXPECT_TRUE(all_close(indices, expected.indices, {0, 0})) << "indices";
  }
}

TEST_P(MaxPool2d, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const PoolCase& pc : kPoolCases) {
    SCOPED_TRACE("x " + pc.x.to_string());
    const bool small = pc.x.numel() < 1000;
    auto x = small ? distinct_tensor(ctx, pc.x, dtype, rng) : random_tensor(ctx, pc.x, dtype, rng);
    auto gy = random_tensor(ctx, pc.y(), dtype, rng);
    Tensor y = poisoned(ctx, pc.y(), dtype), indices = poisoned(ctx, pc.y(), DType::i32);
    ops::maxpool2d_forward(x.tensor, y, indices, pc.params);
    Tensor gx = poisoned(ctx, pc.x, dtype);
    ops::maxpool2d_backward(gy.tensor, indices, gx, pc.params);
    if (small) {
      const auto f = [&](const Inputs& in) { return maxpool_reference(pc, in[0]).y; };
      EXPECT_TRUE(all_close(gx, numeric_gradient(f, Inputs{x.values}, 0, gy.values), backward_tolerance(dtype)));
    } else {  // too large for central differences: route grad_y by the reference's indices
      const auto expected = maxpool_backward_reference(pc, maxpool_reference(pc, x.values).indices, gy.values);
      EXPECT_TRUE(all_close(gx, expected, backward_tolerance(dtype)));
    }
  }
}

TEST_P(MaxPool2d, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const DType dtype = GetParam();
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const PoolCase& pc : kPoolCases) {
    SCOPED_TRACE("x " + pc.x.to_string());
    auto x = random_tensor(ctx, pc.x, dtype, rng);
    auto gy = random_tensor(ctx, pc.y(), dtype, rng);
    Tensor y_cpu = poisoned(ctx, pc.y(), dtype), i_cpu = poisoned(ctx, pc.y(), DType::i32);
    Tensor y_gpu = poisoned(ctx, pc.y(), dtype, gpu), i_gpu = poisoned(ctx, pc.y(), DType::i32, gpu);
    ops::maxpool2d_forward(x.tensor, y_cpu, i_cpu, pc.params);
    ops::maxpool2d_forward(x.tensor.to(gpu), y_gpu, i_gpu, pc.params);
    EXPECT_TRUE(all_close(y_gpu, y_cpu, {0, 0})) << "values";
    EXPECT_TRUE(all_close(i_gpu, i_cpu, {0, 0})) << "indices";
    Tensor gx_cpu = poisoned(ctx, pc.x, dtype), gx_gpu = poisoned(ctx, pc.x, dtype, gpu);
    ops::maxpool2d_backward(gy.tensor, i_cpu, gx_cpu, pc.params);
    ops::maxpool2d_backward(gy.tensor.to(gpu), i_gpu, gx_gpu, pc.params);
    // The same f32 sums in the same order on both devices.
    EXPECT_TRUE(all_close(gx_gpu, gx_cpu, {0, 0})) << "backward";
  }
}

// The CPU computes the backward as a scatter, the CUDA backend as a gather (see pooling.h); run
// the gather here so its math is checked on machines without a GPU. Same sums, same order: equal.
TEST_P(MaxPool2d, GatherMatchesScatter) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const PoolCase& pc : kPoolCases) {
    SCOPED_TRACE("x " + pc.x.to_string());
    auto x = random_tensor(ctx, pc.x, dtype, rng);
    auto gy = random_tensor(ctx, pc.y(), dtype, rng);
    Tensor y = poisoned(ctx, pc.y(), dtype), indices = poisoned(ctx, pc.y(), DType::i32);
    ops::maxpool2d_forward(x.tensor, y, indices, pc.params);
    Tensor scatter = poisoned(ctx, pc.x, dtype), gather = poisoned(ctx, pc.x, dtype);
    ops::maxpool2d_backward(gy.tensor, indices, scatter, pc.params);
    const auto& p = pc.params;
    const Shape ys = pc.y();
    const Pool2dGeometry geometry{int(pc.x[2]), int(pc.x[3]), int(ys[2]), int(ys[3]), p.kernel_h,
                                  p.kernel_w,   p.stride_h,   p.stride_w, p.pad_h,    p.pad_w};
    dispatch_float(dtype, "test", [&](auto tag) {
      using T = decltype(tag);
      cpu_for_each_index(gather.numel(), MaxPool2dBackward<T>{gy.tensor.data<T>(), indices.data<int32_t>(),
                                                              gather.data<T>(), geometry});
    });
    EXPECT_TRUE(all_close(gather, scatter, {0, 0}));
  }
}

INSTANTIATE_FLOAT_DTYPES(MaxPool2d);

TEST(MaxPool2d, OutputShape) {
  EXPECT_EQ(ops::maxpool2d_output_shape(Shape{128, 32, 28, 28}, pool_params(2, 2, 2, 2, 0, 0)),
            (Shape{128, 32, 14, 14}));
  EXPECT_EQ(ops::maxpool2d_output_shape(Shape{2, 3, 9, 10}, pool_params(3, 3, 2, 2, 1, 1)), (Shape{2, 3, 5, 5}));
  EXPECT_EQ(ops::maxpool2d_output_shape(Shape{2, 3, 13, 11}, pool_params(2, 2, 2, 2, 0, 0)), (Shape{2, 3, 6, 5}));
}

// A NaN wins its window (so divergence shows in the output), and its position is the index.
TEST(MaxPool2d, PropagatesNaN) {
  Context ctx;
  std::vector<double> values(2 * 4 * 4);
  for (size_t i = 0; i < values.size(); ++i) values[i] = double(i % 7) - 3.0;
  values[5] = NAN;  // plane 0, h 1, w 1: inside the window of output (0, 0)
  Tensor x = ctx.from_doubles(Shape{1, 2, 4, 4}, DType::f32, values);
  Tensor y = poisoned(ctx, Shape{1, 2, 2, 2}, DType::f32), indices = poisoned(ctx, Shape{1, 2, 2, 2}, DType::i32);
  ops::maxpool2d_forward(x, y, indices, pool_params(2, 2, 2, 2, 0, 0));
  const auto y_values = y.to_doubles();
  const auto index_values = indices.to_doubles();
  EXPECT_TRUE(std::isnan(y_values[0]));
  EXPECT_EQ(index_values[0], 5.0);
  for (size_t i = 1; i < y_values.size(); ++i) EXPECT_FALSE(std::isnan(y_values[i])) << i;
}

TEST(MaxPool2d, RejectsBadArguments) {
  Context ctx;
  const auto p = pool_params(2, 2, 2, 2, 0, 0);
  Tensor x = ctx.zeros(Shape{2, 3, 8, 8}, DType::f32), y = ctx.zeros(Shape{2, 3, 4, 4}, DType::f32);
  Tensor indices = ctx.zeros(Shape{2, 3, 4, 4}, DType::i32);
  EXPECT_NO_THROW(ops::maxpool2d_forward(x, y, indices, p));
  Tensor y_bad = ctx.zeros(Shape{2, 3, 4, 5}, DType::f32);
  EXPECT_THROW(ops::maxpool2d_forward(x, y_bad, indices, p), Error);
  Tensor indices_i64 = ctx.zeros(Shape{2, 3, 4, 4}, DType::i64);
  EXPECT_THROW(ops::maxpool2d_forward(x, y, indices_i64, p), Error);
  Tensor y_bf16 = ctx.zeros(Shape{2, 3, 4, 4}, DType::bf16);
  EXPECT_THROW(ops::maxpool2d_forward(x, y_bf16, indices, p), Error);
  // Padding beyond half the kernel would leave windows with no input element.
  EXPECT_THROW(ops::maxpool2d_output_shape(Shape{2, 3, 8, 8}, pool_params(2, 2, 2, 2, 2, 0)), Error);
  // Backward: grad_y not matching grad_x's pooled shape.
  Tensor gx = ctx.zeros(Shape{2, 3, 9, 8}, DType::f32);
  EXPECT_NO_THROW(ops::maxpool2d_backward(y, indices, gx, p));
  Tensor gx_bad = ctx.zeros(Shape{2, 3, 10, 8}, DType::f32);
  EXPECT_THROW(ops::maxpool2d_backward(y, indices, gx_bad, p), Error);
}

}  // namespace
}  // namespace tessera::testing
