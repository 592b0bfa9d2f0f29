// Matrix multiply, its fused epilogue, matmul_backward, bias_add and its
// backward: forward against a naive double-precision triple loop, backward
// against central differences of it, GPU against CPU. Every dtype; odd sizes;
// every transpose combination; plain, batched and shared-B batched products.
// The key and bound of the cache of a GPU library's GEMM algorithms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/gemm_algorithm_cache.h"
#include "kernels/functors/matmul_plan.h"
#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using ops::Activation;

// Tolerances for products of inputs in [-1, 1] summed over k terms in f32.
//   Accumulation: each f32 addition errs by at most 2^-24 of a partial sum, and
//   partial sums stay around √k; the sum of k such errors is far below k·2^-22
//   (tens of standard deviations), which is the absolute slack used.
//   Rounding of the output: an f32 output is good to a few ulp (rel 1e-5); a
//   bf16 or f16 output is rounded once (half an ulp: 2^-9 ≈ 2e-3 for bf16,
//   2^-12 for f16) from the f32 result. The inputs are exactly representable in
//   their dtype, so there is no other error: a low-precision accumulation would
//   miss the f32-output tolerance by orders of magnitude.
Tolerance product_tolerance(DType out_dtype, int64_t k) {
  const Tolerance rounding = forward_tolerance(out_dtype);
  return {rounding.rel, rounding.abs + double(k) * 0x1p-22};
}
Tolerance device_product_tolerance(DType out_dtype, int64_t k) {
  const Tolerance rounding = device_tolerance(out_dtype);
  return {rounding.rel, rounding.abs + double(k) * 0x1p-22};
}

// Problem sizes: batch 0 means plain 2-D operands.
struct Dims {
  int64_t batch, m, k, n;
};

struct Layout {
  bool transpose_a = false, transpose_b = false;
  bool shared_b = false;  // batched A with a 2-D B
};

std::string describe(const Dims& d, const Layout& l) {
  return "batch " + std::to_string(d.batch) + " m " + std::to_string(d.m) + " k " + std::to_string(d.k) + " n " +
         std::to_string(d.n) + (l.transpose_a ? " Aᵀ" : "") + (l.transpose_b ? " Bᵀ" : "") +
         (l.shared_b ? " shared B" : "");
}

Shape a_shape(const Dims& d, const Layout& l) {
  const int64_t r = l.transpose_a ? d.k : d.m, c = l.transpose_a ? d.m : d.k;
  return d.batch ? Shape{d.batch, r, c} : Shape{r, c};
}
Shape b_shape(const Dims& d, const Layout& l) {
  const int64_t r = l.transpose_b ? d.n : d.k, c = l.transpose_b ? d.k : d.n;
  return d.batch && !l.shared_b ? Shape{d.batch, r, c} : Shape{r, c};
}
Shape c_shape(const Dims& d) {
  return d.batch ? Shape{d.batch, d.m, d.n} : Shape{d.m, d.n};
}

// op(A)·op(B) in double, [max(batch, 1), m, n] flattened.
std::vector<double> reference_product(const std::vector<double>& a, const std::vector<double>& b, const Dims& d,
                                      const Layout& l) {
  const int64_t batches = std::max<int64_t>(d.batch, 1);
  std::vector<double> c(size_t(batches * d.m * d.n), 0.0);
  for (int64_t bi = 0; bi < batches; ++bi) {
    const double* ab = a.data() + bi * d.m * d.k;
    const double* bb = b.data() + (l.shared_b ? 0 : bi * d.k * d.n);
    for (int64_t i = 0; i < d.m; ++i)
      for (int64_t j = 0; j < d.n; ++j) {
        double sum = 0;
        for (int64_t p = 0; p < d.k; ++p) {
          const double av = l.transpose_a ? ab[p * d.m + i] : ab[i * d.k + p];
          const double bv = l.transpose_b ? bb[j * d.k + p] : bb[p * d.n + j];
          sum += av * bv;
        }
        c[size_t((bi * d.m + i) * d.n + j)] = sum;
      }
  }
  return c;
}

double activate(Activation activation, double x) {
  switch (activation) {
    case Activation::relu:
      return x > 0 ? x : 0;
    case Activation::gelu:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    default:
      return x;
  }
}

struct Epilogue {
  float alpha = 1.0f, beta = 0.0f;
  bool bias = false;
  Activation activation = Activation::none;
  bool pre_activation = false;
};

std::string describe(const Epilogue& e) {
  static const char* const names[] = {"none", "relu", "gelu"};
  return "alpha " + std::to_string(e.alpha) + " beta " + std::to_string(e.beta) + (e.bias ? " bias" : "") + " act " +
         names[int(e.activation)] + (e.pre_activation ? " pre" : "");
}

// Runs ops::matmul on fresh random inputs and checks C (and pre_activation)
// against the double reference. `c_dtype` may differ from `dtype` (f32 output).
void check_matmul(DType dtype, DType c_dtype, const Dims& d, const Layout& l, const Epilogue& e) {
  SCOPED_TRACE(describe(d, l) + " " + describe(e) + " " + std::string(dtype_name(dtype)) + "->" +
               std::string(dtype_name(c_dtype)));
  Context ctx;
  auto rng = make_rng();
  auto a = random_tensor(ctx, a_shape(d, l), dtype, rng);
  auto b = random_tensor(ctx, b_shape(d, l), dtype, rng);
  auto bias = random_tensor(ctx, Shape{d.n}, c_dtype, rng);
  // With beta ≠ 0 C is an input; otherwise every element must be written.
  auto c_old = random_tensor(ctx, c_shape(d), c_dtype, rng);
  Tensor c = e.beta != 0.0f ? c_old.tensor : poisoned(ctx, c_shape(d), c_dtype);
  Tensor pre = poisoned(ctx, c_shape(d), c_dtype);

  ops::MatmulOptions options;
  options.transpose_a = l.transpose_a;
  options.transpose_b = l.transpose_b;
  options.alpha = e.alpha;
  options.beta = e.beta;
  options.bias = e.bias ? &bias.tensor : nullptr;
  options.activation = e.activation;
  options.pre_activation = e.pre_activation ? &pre : nullptr;
  ops::matmul(a.tensor, b.tensor, c, options);

  std::vector<double> expected = reference_product(a.values, b.values, d, l), expected_pre(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    double v = e.alpha * expected[i] + (e.beta != 0.0f ? e.beta * c_old.values[i] : 0.0);
    if (e.bias) v += bias.values[i % size_t(d.n)];
    expected_pre[i] = v;
    expected[i] = activate(e.activation, v);
  }
  EXPECT_TRUE(all_close(c, expected, product_tolerance(c_dtype, d.k)));
  if (e.pre_activation) {
    EXPECT_TRUE(all_close(pre, expected_pre, product_tolerance(c_dtype, d.k))) << "pre_activation";
  }
}

const Layout kAllTransposes[] = {{false, false}, {false, true}, {true, false}, {true, true}};

// Output dtypes to test for input dtype `dtype`: its own, and f32.
std::vector<DType> output_dtypes(DType dtype) {
  return dtype == DType::f32 ? std::vector<DType>{DType::f32} : std::vector<DType>{dtype, DType::f32};
}

void check_forward(DType dtype) {
  TESSERA_SEED_TRACE();
  for (const DType c_dtype : output_dtypes(dtype))
    for (Layout l : kAllTransposes) {
      check_matmul(dtype, c_dtype, {0, 37, 53, 29}, l, {});
      check_matmul(dtype, c_dtype, {3, 37, 53, 29}, l, {});
      check_matmul(dtype, c_dtype, {0, 37, 53, 29}, l, {0.75f, -0.5f});
      check_matmul(dtype, c_dtype, {3, 37, 53, 29}, l, {1.25f, 1.0f});
      l.shared_b = true;
      check_matmul(dtype, c_dtype, {3, 37, 53, 29}, l, {});
      check_matmul(dtype, c_dtype, {3, 37, 53, 29}, l, {0.5f, 2.0f});
    }
  // Larger: multi-threaded GEMMs, many small batches (one per thread), and
  // batches large enough to be threaded one at a time.
  check_matmul(dtype, dtype, {0, 301, 67, 131}, {false, true}, {});
  check_matmul(dtype, dtype, {9, 20, 31, 25}, {true, false}, {1.0f, 0.5f});
  check_matmul(dtype, dtype, {2, 203, 151, 161}, {false, false}, {});
  // An empty inner dimension: C = beta·C.
  check_matmul(dtype, dtype, {0, 7, 0, 5}, {}, {1.0f, 0.5f});
  check_matmul(dtype, dtype, {2, 7, 0, 5}, {}, {1.0f, 0.0f});
}

// matmul_backward against central differences of the reference product.
void check_backward_case(DType dtype, DType grad_dtype, DType grad_c_dtype, const Dims& d, const Layout& l,
                         bool accumulate) {
  SCOPED_TRACE(describe(d, l) + (accumulate ? " accumulate" : "") + " grads " + std::string(dtype_name(grad_dtype)) +
               " grad_c " + std::string(dtype_name(grad_c_dtype)));
  Context ctx;
  auto rng = make_rng();
  auto a = random_tensor(ctx, a_shape(d, l), dtype, rng);
  auto b = random_tensor(ctx, b_shape(d, l), dtype, rng);
  auto grad_c = random_tensor(ctx, c_shape(d), grad_c_dtype, rng);
  auto old_a = random_tensor(ctx, a_shape(d, l), grad_dtype, rng);
  auto old_b = random_tensor(ctx, b_shape(d, l), grad_dtype, rng);
  Tensor grad_a = accumulate ? old_a.tensor : poisoned(ctx, a_shape(d, l), grad_dtype);
  Tensor grad_b = accumulate ? old_b.tensor : poisoned(ctx, b_shape(d, l), grad_dtype);
  ops::matmul_backward(grad_c.tensor, a.tensor, b.tensor, &grad_a, &grad_b, l.transpose_a, l.transpose_b, accumulate);

  // An f32 grad_c of low-precision operands is first rounded to their dtype.
  const std::vector<double> upstream = round_to(dtype, grad_c.values);
  const auto f = [&](const Inputs& in) { return reference_product(in[0], in[1], d, l); };
  std::vector<double> expected_a = numeric_gradient(f, Inputs{a.values, b.values}, 0, upstream);
  std::vector<double> expected_b = numeric_gradient(f, Inputs{a.values, b.values}, 1, upstream);
  if (accumulate) {
    for (size_t i = 0; i < expected_a.size(); ++i) expected_a[i] += old_a.values[i];
    for (size_t i = 0; i < expected_b.size(); ++i) expected_b[i] += old_b.values[i];
  }
  const int64_t reduced_for_b = std::max<int64_t>(d.batch, 1) * d.m;  // terms summed into grad_b
  EXPECT_TRUE(all_close(grad_a, expected_a, product_tolerance(grad_dtype, d.n))) << "grad_a";
  EXPECT_TRUE(all_close(grad_b, expected_b, product_tolerance(grad_dtype, reduced_for_b))) << "grad_b";

  // Either output may be omitted.
  Tensor only_b = poisoned(ctx, b_shape(d, l), grad_dtype);
  ops::matmul_backward(grad_c.tensor, a.tensor, b.tensor, nullptr, &only_b, l.transpose_a, l.transpose_b, false);
  std::vector<double> fresh_b = numeric_gradient(f, Inputs{a.values, b.values}, 1, upstream);
  EXPECT_TRUE(all_close(only_b, fresh_b, product_tolerance(grad_dtype, reduced_for_b))) << "grad_b alone";
}

void check_backward(DType dtype) {
  TESSERA_SEED_TRACE();
  for (const bool accumulate : {false, true})
    for (Layout l : kAllTransposes) {
      check_backward_case(dtype, dtype, dtype, {0, 5, 7, 3}, l, accumulate);
      check_backward_case(dtype, dtype, dtype, {3, 5, 7, 3}, l, accumulate);
      l.shared_b = true;
      check_backward_case(dtype, dtype, dtype, {3, 5, 7, 3}, l, accumulate);
      if (dtype != DType::f32) {  // f32 gradients, and an f32 grad_c, of low-precision operands
        check_backward_case(dtype, DType::f32, dtype, {3, 5, 7, 3}, l, accumulate);
        check_backward_case(dtype, dtype, DType::f32, {3, 5, 7, 3}, l, accumulate);
      }
    }
}

// The same calls on the CPU and on the GPU.
void check_gpu(DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  const Dims shapes[] = {{0, 37, 53, 29}, {3, 37, 53, 29}, {0, 301, 67, 131}};
  for (const Dims& d : shapes)
    for (Layout l : kAllTransposes)
      for (const bool shared : {false, true}) {
        if (shared && d.batch == 0) continue;
        l.shared_b = shared;
        SCOPED_TRACE(describe(d, l));
        auto a = random_tensor(ctx, a_shape(d, l), dtype, rng);
        auto b = random_tensor(ctx, b_shape(d, l), dtype, rng);
        auto c0 = random_tensor(ctx, c_shape(d), dtype, rng);
        ops::MatmulOptions options;
        options.transpose_a = l.transpose_a;
        options.transpose_b = l.transpose_b;
        options.alpha = 0.75f;
        options.beta = 0.5f;
        Tensor c_cpu = c0.tensor.clone(), c_gpu = c0.tensor.to(gpu);
        ops::matmul(a.tensor, b.tensor, c_cpu, options);
        ops::matmul(a.tensor.to(gpu), b.tensor.to(gpu), c_gpu, options);
        EXPECT_TRUE(all_close(c_gpu, c_cpu, device_product_tolerance(dtype, d.k))) << "forward";

        auto grad_c = random_tensor(ctx, c_shape(d), dtype, rng);
        Tensor ga_cpu = poisoned(ctx, a_shape(d, l), dtype), gb_cpu = poisoned(ctx, b_shape(d, l), dtype);
        Tensor ga_gpu = poisoned(ctx, a_shape(d, l), dtype, gpu), gb_gpu = poisoned(ctx, b_shape(d, l), dtype, gpu);
        ops::matmul_backward(grad_c.tensor, a.tensor, b.tensor, &ga_cpu, &gb_cpu, l.transpose_a, l.transpose_b);
        ops::matmul_backward(grad_c.tensor.to(gpu), a.tensor.to(gpu), b.tensor.to(gpu), &ga_gpu, &gb_gpu, l.transpose_a,
                             l.transpose_b);
        EXPECT_TRUE(all_close(ga_gpu, ga_cpu, device_product_tolerance(dtype, d.n))) << "grad_a";
        EXPECT_TRUE(all_close(gb_gpu, gb_cpu, device_product_tolerance(dtype, std::max<int64_t>(d.batch, 1) * d.m)))
            << "grad_b";
      }
}

class Matmul : public DtypeTest {};
TEST_P(Matmul, Forward) {
  check_forward(GetParam());
}
TEST_P(Matmul, Backward) {
  check_backward(GetParam());
}
TEST_P(Matmul, GpuMatchesCpu) {
  check_gpu(GetParam());
}
INSTANTIATE_FLOAT_DTYPES(Matmul);

// ---------------------------------------------------------------------------
// The fused epilogue: C = act(alpha·op(A)·op(B) + beta·C + bias), pre_activation.
// ---------------------------------------------------------------------------
void check_epilogue_forward(DType dtype) {
  TESSERA_SEED_TRACE();
  for (const DType c_dtype : output_dtypes(dtype))
    for (const Activation act : {Activation::none, Activation::relu, Activation::gelu})
      for (const bool pre : {false, true}) {
        // A linear layer (y = x·Wᵀ + b), a batched one with shared weights, and beta ≠ 0.
        check_matmul(dtype, c_dtype, {0, 37, 53, 29}, {false, true}, {1.0f, 0.0f, true, act, pre});
        check_matmul(dtype, c_dtype, {3, 37, 53, 29}, {false, true, true}, {1.0f, 0.0f, true, act, pre});
        check_matmul(dtype, c_dtype, {3, 37, 53, 29}, {true, false}, {0.5f, 0.75f, true, act, pre});
        if (act != Activation::none)  // no bias, activation only
          check_matmul(dtype, c_dtype, {0, 37, 53, 29}, {false, false}, {1.0f, 0.0f, false, act, pre});
      }
  // Enough rows to spread the epilogue over threads.
  check_matmul(dtype, dtype, {0, 1201, 40, 131}, {false, true}, {1.0f, 0.0f, true, Activation::gelu, true});
}

// cuBLASLt's fused GELU epilogue may evaluate tanh with the hardware
// approximation (tanh.approx.f32: relative error up to about 2^-11, PTX ISA),
// not the exact formula the CPU's functor uses. gelu(x) = x/2 (1 + tanh u),
// so an error ε in tanh moves the result by at most |x|/2 · ε: absolute, in
// units of the largest pre-activation |x| (relative bounds fail for negative
// x, where gelu(x) goes to 0). On top of the f32 (or 16-bit) product bound.
void widen_for_fused_gelu(Tolerance& tolerance, const Tensor& a, const Tensor& b, const Tensor& c0, const Tensor& bias,
                          float beta) {
  Tensor pre = c0.clone();
  ops::MatmulOptions plain;
  plain.transpose_b = true;
  plain.beta = beta;
  plain.bias = &bias;
  ops::matmul(a, b, pre, plain);
  double largest = 0;
  for (const double v : pre.to_doubles()) largest = std::max(largest, std::abs(v));
  tolerance.abs += 0.5 * largest * 0x1p-11;
}

void check_epilogue_gpu(DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  // 29 columns: an aux leading dimension cuBLASLt cannot take (falls back); 64 columns: fused.
  const Dims shapes[] = {{0, 37, 53, 29}, {3, 37, 53, 64}, {0, 301, 67, 136}};
  for (const Dims& d : shapes)
    for (const DType c_dtype : output_dtypes(dtype))
      for (const Activation act : {Activation::none, Activation::relu, Activation::gelu})
        for (const bool with_pre : {false, true})
          for (const float beta : {0.0f, 0.5f}) {
            const Layout l{false, true, d.batch > 0};
            SCOPED_TRACE(describe(d, l) + " act " + std::to_string(int(act)) + (with_pre ? " pre" : "") + " beta " +
                         std::to_string(beta) + " c " + std::string(dtype_name(c_dtype)));
            auto a = random_tensor(ctx, a_shape(d, l), dtype, rng);
            auto b = random_tensor(ctx, b_shape(d, l), dtype, rng);
            auto bias = random_tensor(ctx, Shape{d.n}, c_dtype, rng);
            auto c0 = random_tensor(ctx, c_shape(d), c_dtype, rng);
            Tensor c_cpu = c0.tensor.clone(), c_gpu = c0.tensor.to(gpu);
            Tensor pre_cpu = poisoned(ctx, c_shape(d), c_dtype), pre_gpu = poisoned(ctx, c_shape(d), c_dtype, gpu);
            const Tensor bias_gpu = bias.tensor.to(gpu);
            ops::MatmulOptions options;
            options.transpose_b = true;
            options.beta = beta;
            options.activation = act;
            options.bias = &bias.tensor;
            options.pre_activation = with_pre ? &pre_cpu : nullptr;
            ops::matmul(a.tensor, b.tensor, c_cpu, options);
            options.bias = &bias_gpu;
            options.pre_activation = with_pre ? &pre_gpu : nullptr;
            ops::matmul(a.tensor.to(gpu), b.tensor.to(gpu), c_gpu, options);
            Tolerance tolerance = device_product_tolerance(c_dtype, d.k);
            if (act == Activation::gelu)
              widen_for_fused_gelu(tolerance, a.tensor, b.tensor, c0.tensor, bias.tensor, beta);
            EXPECT_TRUE(all_close(c_gpu, c_cpu, tolerance));
            if (with_pre) {
              EXPECT_TRUE(all_close(pre_gpu, pre_cpu, device_product_tolerance(c_dtype, d.k))) << "pre";
            }
          }
}

class MatmulEpilogue : public DtypeTest {};
TEST_P(MatmulEpilogue, Forward) {
  check_epilogue_forward(GetParam());
}
TEST_P(MatmulEpilogue, GpuMatchesCpu) {
  check_epilogue_gpu(GetParam());
}
INSTANTIATE_FLOAT_DTYPES(MatmulEpilogue);

// ---------------------------------------------------------------------------
// bias_add and bias_add_backward
// ---------------------------------------------------------------------------
std::vector<double> reference_bias_add(const std::vector<double>& x, const std::vector<double>& bias) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] + bias[i % bias.size()];
  return y;
}

// Large enough to cross the threading grain (rows and columns), odd sizes.
const Shape kLargeBiasShape{3, 1031, 17};

void check_bias_add_forward(DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeBiasShape, dtype, rng, -4.0, 4.0);
  auto bias = random_tensor(ctx, Shape{kLargeBiasShape[-1]}, dtype, rng);
  Tensor y = poisoned(ctx, kLargeBiasShape, dtype);
  ops::bias_add(x.tensor, bias.tensor, y);
  const auto expected = reference_bias_add(x.values, bias.values);
  EXPECT_TRUE(all_close(y, expected, forward_tolerance(dtype)));
  ops::bias_add(x.tensor, bias.tensor, x.tensor);  // in place
  EXPECT_TRUE(all_close(x.tensor, expected, forward_tolerance(dtype))) << "in place";
}

void check_bias_add_backward(DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const DType grad_dtype : output_dtypes(dtype))
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(std::string("grad_bias ") + std::string(dtype_name(grad_dtype)) + (accumulate ? " accumulate" : ""));
      // Small: against central differences of the reference.
      const Shape small{7, 13};
      auto x = random_tensor(ctx, small, dtype, rng);
      auto bias = random_tensor(ctx, Shape{13}, dtype, rng);
      auto grad_y = random_tensor(ctx, small, dtype, rng);
      auto old = random_tensor(ctx, Shape{13}, grad_dtype, rng);
      Tensor grad_bias = accumulate ? old.tensor : poisoned(ctx, Shape{13}, grad_dtype);
      ops::bias_add_backward(grad_y.tensor, grad_bias, accumulate);
      const auto f = [](const Inputs& in) { return reference_bias_add(in[0], in[1]); };
      std::vector<double> expected = numeric_gradient(f, Inputs{x.values, bias.values}, 1, grad_y.values);
      if (accumulate)
        for (size_t i = 0; i < expected.size(); ++i) expected[i] += old.values[i];
      EXPECT_TRUE(all_close(grad_bias, expected, product_tolerance(grad_dtype, 7)));

      // Large: column sums in double (the exact derivative), f32 accumulation
      // over thousands of rows; shapes crossing the CPU's row chunks (1024) and
      // column blocks (256).
      for (const Shape& large : {Shape{4099, 37}, Shape{3, 700, 301}}) {
        const int64_t c = large[-1], r = large.numel() / c;
        auto big = random_tensor(ctx, large, dtype, rng);
        auto big_old = random_tensor(ctx, Shape{c}, grad_dtype, rng);
        Tensor big_grad = accumulate ? big_old.tensor : poisoned(ctx, Shape{c}, grad_dtype);
        ops::bias_add_backward(big.tensor, big_grad, accumulate);
        std::vector<double> sums(size_t(c), 0.0);
        for (size_t i = 0; i < big.values.size(); ++i) sums[i % size_t(c)] += big.values[i];
        if (accumulate)
          for (size_t i = 0; i < sums.size(); ++i) sums[i] += big_old.values[i];
        EXPECT_TRUE(all_close(big_grad, sums, product_tolerance(grad_dtype, r))) << large.to_string();
      }
    }
}

void check_bias_add_gpu(DType dtype) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  auto x = random_tensor(ctx, kLargeBiasShape, dtype, rng, -4.0, 4.0);
  auto bias = random_tensor(ctx, Shape{kLargeBiasShape[-1]}, dtype, rng);
  Tensor y_cpu = poisoned(ctx, kLargeBiasShape, dtype), y_gpu = poisoned(ctx, kLargeBiasShape, dtype, gpu);
  ops::bias_add(x.tensor, bias.tensor, y_cpu);
  ops::bias_add(x.tensor.to(gpu), bias.tensor.to(gpu), y_gpu);
  EXPECT_TRUE(all_close(y_gpu, y_cpu, device_tolerance(dtype))) << "forward";
  // Many rows (the GPU sums them in two passes) and few.
  for (const Shape& shape : {Shape{4099, 37}, Shape{3, 1031}})
    for (const DType grad_dtype : output_dtypes(dtype))
      for (const bool accumulate : {false, true}) {
        auto grad_y = random_tensor(ctx, shape, dtype, rng);
        auto old = random_tensor(ctx, Shape{shape[-1]}, grad_dtype, rng);
        Tensor g_cpu = old.tensor.clone(), g_gpu = old.tensor.to(gpu);
        ops::bias_add_backward(grad_y.tensor, g_cpu, accumulate);
        ops::bias_add_backward(grad_y.tensor.to(gpu), g_gpu, accumulate);
        EXPECT_TRUE(all_close(g_gpu, g_cpu, device_product_tolerance(grad_dtype, shape[0])))
            << shape.to_string() << " backward";
      }
}

class BiasAdd : public DtypeTest {};
TEST_P(BiasAdd, Forward) {
  check_bias_add_forward(GetParam());
}
TEST_P(BiasAdd, Backward) {
  check_bias_add_backward(GetParam());
}
TEST_P(BiasAdd, GpuMatchesCpu) {
  check_bias_add_gpu(GetParam());
}
INSTANTIATE_FLOAT_DTYPES(BiasAdd);

// ---------------------------------------------------------------------------
// Argument validation
// ---------------------------------------------------------------------------
TEST(Matmul, RejectsBadArguments) {
  Context ctx;
  const auto f32 = [&](Shape s) { return ctx.zeros(s, DType::f32); };
  Tensor a = f32({4, 5}), b = f32({5, 6}), c = f32({4, 6});
  ops::matmul(a, b, c);  // valid
  Tensor wrong_c = f32({4, 7});
  EXPECT_THROW(ops::matmul(a, b, wrong_c), Error);
  Tensor b_bad_k = f32({4, 6});
  EXPECT_THROW(ops::matmul(a, b_bad_k, c), Error);
  ops::MatmulOptions transpose_b;
  transpose_b.transpose_b = true;
  EXPECT_THROW(ops::matmul(a, b, c, transpose_b), Error);  // bᵀ is 6×5
  Tensor b_bf16 = ctx.zeros(Shape{5, 6}, DType::bf16);
  EXPECT_THROW(ops::matmul(a, b_bf16, c), Error);
  Tensor c_i32 = ctx.zeros(Shape{4, 6}, DType::i32);
  EXPECT_THROW(ops::matmul(a, b, c_i32), Error);
  Tensor a_bf16 = ctx.zeros(Shape{4, 5}, DType::bf16), c_f16 = ctx.zeros(Shape{4, 6}, DType::f16);
  EXPECT_THROW(ops::matmul(a_bf16, b_bf16, c_f16), Error);  // c must be bf16 or f32
  Tensor b3 = f32({2, 5, 6}), c3 = f32({2, 4, 6});
  EXPECT_THROW(ops::matmul(a, b3, c3), Error);  // 2-D a with 3-D b
  Tensor a3 = f32({3, 4, 5}), c33 = f32({3, 4, 6});
  EXPECT_THROW(ops::matmul(a3, b3, c33), Error);  // batch sizes differ
  EXPECT_THROW(ops::matmul(a, b, a), Error);      // c overlaps a (and has the wrong shape)
  Tensor square = f32({4, 4});
  EXPECT_THROW(ops::matmul(square, square, square), Error);  // in place
  Tensor bias_bad = f32({5});
  ops::MatmulOptions with_bias;
  with_bias.bias = &bias_bad;
  EXPECT_THROW(ops::matmul(a, b, c, with_bias), Error);
  Tensor bias_bf16 = ctx.zeros(Shape{6}, DType::bf16);
  with_bias.bias = &bias_bf16;
  EXPECT_THROW(ops::matmul(a, b, c, with_bias), Error);
  Tensor pre_bad = f32({4, 5});
  ops::MatmulOptions with_pre;
  with_pre.pre_activation = &pre_bad;
  EXPECT_THROW(ops::matmul(a, b, c, with_pre), Error);
  with_pre.pre_activation = &c;
  EXPECT_THROW(ops::matmul(a, b, c, with_pre), Error);  // pre_activation is c

  Tensor grad_c = f32({4, 6}), grad_a = f32({4, 5}), grad_b_bad = f32({6, 5});
  ops::matmul_backward(grad_c, a, b, &grad_a, nullptr);  // valid
  EXPECT_THROW(ops::matmul_backward(grad_c, a, b, &grad_a, &grad_b_bad), Error);
  Tensor grad_c_bad = f32({4, 5});
  EXPECT_THROW(ops::matmul_backward(grad_c_bad, a, b, &grad_a, nullptr), Error);
  Tensor grad_a_f16 = ctx.zeros(Shape{4, 5}, DType::f16);
  EXPECT_THROW(ops::matmul_backward(grad_c, a, b, &grad_a_f16, nullptr), Error);
}

TEST(BiasAdd, RejectsBadArguments) {
  Context ctx;
  Tensor x = ctx.zeros(Shape{4, 5}, DType::f32), y = ctx.zeros(Shape{4, 5}, DType::f32);
  Tensor bias_bad = ctx.zeros(Shape{4}, DType::f32), bias_bf16 = ctx.zeros(Shape{5}, DType::bf16);
  EXPECT_THROW(ops::bias_add(x, bias_bad, y), Error);
  EXPECT_THROW(ops::bias_add(x, bias_bf16, y), Error);
  Tensor y_bad = ctx.zeros(Shape{5, 4}, DType::f32);
  Tensor bias = ctx.zeros(Shape{5}, DType::f32);
  EXPECT_THROW(ops::bias_add(x, bias, y_bad), Error);
  EXPECT_THROW(ops::bias_add_backward(x, bias_bad), Error);
  Tensor grad_i32 = ctx.zeros(Shape{5}, DType::i32);
  EXPECT_THROW(ops::bias_add_backward(x, grad_i32), Error);
}

// A batched GEMM over addresses 256-aligned plus `offset` bytes (never dereferenced).
Gemm gemm_at(uintptr_t offset) {
  Gemm g;
  g.batch = 3, g.m = 5, g.n = 7, g.k = 9;
  g.a = reinterpret_cast<const void*>(uintptr_t(1) << 20 | offset);
  g.b = reinterpret_cast<const void*>(uintptr_t(2) << 20 | offset);
  g.c = reinterpret_cast<void*>(uintptr_t(3) << 20 | offset);
  g.trans_a = true;
  g.lda = 5, g.ldb = 7, g.ldc = 7;
  g.stride_a = 45, g.stride_b = 63, g.stride_c = 35;
  g.ab_dtype = DType::bf16, g.c_dtype = DType::f32;
  return g;
}

TEST(GemmAlgorithmCache, TheSameGemmHitsAndAnyDifferenceMisses) {
  GemmAlgorithmCache<int> cache;
  const Gemm g = gemm_at(0);
  cache.insert(gemm_algorithm_key(g, 1), 42);
  // Other buffers of the same alignments, other alpha and beta: the same choice.
  Gemm elsewhere = gemm_at(0);
  elsewhere.a = static_cast<const char*>(g.a) + 4096;
  elsewhere.c = static_cast<char*>(g.c) + 512;
  elsewhere.alpha = 2.0f, elsewhere.beta = 1.0f;
  ASSERT_EQ(cache.find(gemm_algorithm_key(elsewhere, 1)), std::optional<int>(42));
  EXPECT_EQ(GemmAlgorithmKeyHash{}(gemm_algorithm_key(elsewhere, 1)), GemmAlgorithmKeyHash{}(gemm_algorithm_key(g, 1)));

  // Each field that can change the library's choice, changed alone, misses.
  const std::vector<std::pair<std::string, std::function<void(Gemm&)>>> changes{
      {"batch", [](Gemm& x) { x.batch = 4; }},
      {"m", [](Gemm& x) { x.m = 6; }},
      {"n", [](Gemm& x) { x.n = 8; }},
      {"k", [](Gemm& x) { x.k = 10; }},
      {"lda", [](Gemm& x) { x.lda = 6; }},
      {"ldb", [](Gemm& x) { x.ldb = 8; }},
      {"ldc", [](Gemm& x) { x.ldc = 8; }},
      {"stride_a", [](Gemm& x) { x.stride_a = 50; }},
      {"stride_b", [](Gemm& x) { x.stride_b = 70; }},
      {"stride_c", [](Gemm& x) { x.stride_c = 0; }},
      {"trans_a", [](Gemm& x) { x.trans_a = false; }},
      {"trans_b", [](Gemm& x) { x.trans_b = true; }},
      {"ab_dtype", [](Gemm& x) { x.ab_dtype = DType::f16; }},
      {"c_dtype", [](Gemm& x) { x.c_dtype = DType::bf16; }},
      {"alignment of a", [](Gemm& x) { x.a = static_cast<const char*>(x.a) + 2; }},
      {"alignment of b", [](Gemm& x) { x.b = static_cast<const char*>(x.b) + 16; }},
      {"alignment of c", [](Gemm& x) { x.c = static_cast<char*>(x.c) + 128; }},
  };
  for (const auto& [field, change] : changes) {
    Gemm other = gemm_at(0);
    change(other);
    EXPECT_FALSE(cache.find(gemm_algorithm_key(other, 1))) << field;
  }
  EXPECT_FALSE(cache.find(gemm_algorithm_key(g, 2))) << "epilogue";
  EXPECT_EQ(cache.size(), 1u);
}

TEST(GemmAlgorithmCache, AlignmentIsTheLargestPowerOfTwoUpTo256) {
  for (uintptr_t offset = 1; offset <= 512; offset *= 2) {
    const uint32_t expected = uint32_t(std::min<uintptr_t>(offset, 256));
    EXPECT_EQ(pointer_alignment(reinterpret_cast<const void*>((uintptr_t(1) << 20) + offset)), expected) << offset;
  }
  EXPECT_EQ(pointer_alignment(reinterpret_cast<const void*>((uintptr_t(1) << 20) + 24)), 8u);
}

TEST(GemmAlgorithmCache, StaysWithinItsCapacityDroppingTheOldest) {
  GemmAlgorithmCache<int> cache(3);
  const auto key = [](int64_t m) {
    Gemm g = gemm_at(0);
    g.m = m;
    return gemm_algorithm_key(g, 0);
  };
  for (int64_t m = 1; m <= 3; ++m) cache.insert(key(m), int(10 * m));
  cache.insert(key(2), 21);  // known already: replaced, nothing dropped
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(cache.find(key(2)), std::optional<int>(21));
  cache.insert(key(4), 40);
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_FALSE(cache.find(key(1))) << "the oldest should have made room";
  for (int64_t m = 2; m <= 4; ++m) EXPECT_TRUE(cache.find(key(m))) << m;
}

}  // namespace
}  // namespace tessera::testing
