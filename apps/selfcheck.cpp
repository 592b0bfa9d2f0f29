// `tessera selfcheck`: a quick health check of every operator on this
// machine. For each operator with a backward it draws random inputs and an
// upstream gradient g, and checks the backward against a directional
// derivative of the forward: (L(x + εv) − L(x − εv)) / 2ε ≈ Σ v·∂L/∂x with
// L = Σ g·f(x). Where a GPU exists it also compares forward and backward on
// cuda:0 with the CPU. Prints one line per operator and exits non-zero if
// any check fails. (The unit tests check far more; this is for a user's
// first look at a new machine or build.)
#include "apps/selfcheck.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "core/context.h"
#include "kernels/ops.h"

namespace tessera::app {
namespace {

using Forward = std::function<Tensor(const Tensor& x)>;
using Backward = std::function<Tensor(const Tensor& x, const Tensor& grad_out)>;

struct Check {
  std::string name;
  Shape input_shape;
  Forward forward;
  Backward backward;
  // Step of the directional derivative, large enough for f32 forwards.
  float epsilon = 1e-2f;
  // Where a finite difference is not a derivative (ReLU at 0, ties in a
  // max-pool window), inputs are kept away from the kinks.
  enum class Inputs { uniform, away_from_zero, distinct } inputs = Inputs::uniform;
};

double dot(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

Tensor random_like(Context& ctx, const Shape& shape, uint64_t seed, Device device, float scale = 1.0f) {
  Tensor t = ctx.empty(shape, DType::f32, device);
  t.uniform_at_(seed, 0, 0, -scale, scale);
  return t;
}

Tensor check_input(Context& ctx, const Check& check, uint64_t seed, Device device) {
  Tensor u = random_like(ctx, check.input_shape, seed, Device::cpu());
  std::vector<double> values = u.to_doubles();
  const size_t n = values.size();
  switch (check.inputs) {
    case Check::Inputs::uniform:
      break;
    case Check::Inputs::away_from_zero:  // |x| in [0.1, 1)
      for (double& v : values) v = (v < 0 ? -0.1 : 0.1) + 0.9 * v;
      break;
    case Check::Inputs::distinct: {  // a shuffled grid over [-1, 1), neighbours 2/n apart
      size_t stride = 2 * (n / 3) + 1;
      while (std::gcd(stride, n) != 1) stride += 2;
      for (size_t i = 0; i < n; ++i) values[i] = -1.0 + 2.0 * double((i * stride) % n) / double(n);
      break;
    }
  }
  return ctx.from_doubles(check.input_shape, DType::f32, values, device);
}

double max_relative_difference(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  double worst = 0, scale = 1e-6;
  for (double v : y) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]) / scale);
  return worst;
}

Tensor targets_for(Context& ctx, int64_t rows, int64_t classes, Device device) {
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) t[size_t(i)] = int32_t((i * 7919) % classes);
  if (rows > 2) t[1] = -100;  // one ignored row
  return ctx.from_vector(Shape{rows}, t, device);
}

std::vector<Check> make_checks(Context& ctx) {
  std::vector<Check> checks;
  auto same = [&ctx](const Tensor& x) { return ctx.empty(x.shape(), x.dtype(), x.device()); };

  checks.push_back({"relu", Shape{64, 257},
                    [=](const Tensor& x) {
                      Tensor y = same(x);
                      ops::relu_forward(x, y);
                      return y;
                    },
                    [=](const Tensor& x, const Tensor& g) {
                      Tensor d = same(x);
                      ops::relu_backward(x, g, d);
                      return d;
                    },
                    1e-2f, Check::Inputs::away_from_zero});
  checks.push_back({"gelu", Shape{64, 257},
                    [=](const Tensor& x) {
                      Tensor y = same(x);
                      ops::gelu_forward(x, y);
                      return y;
                    },
                    [=](const Tensor& x, const Tensor& g) {
                      Tensor d = same(x);
                      ops::gelu_backward(x, g, d);
                      return d;
                    }});
  checks.push_back({"softmax", Shape{33, 129},
                    [=](const Tensor& x) {
                      Tensor y = same(x);
                      ops::softmax_forward(x, y);
                      return y;
                    },
                    [=](const Tensor& x, const Tensor& g) {
                      Tensor y = same(x), d = same(x);
                      ops::softmax_forward(x, y);
                      ops::softmax_backward(y, g, d);
                      return d;
                    }});
  checks.push_back({"cross_entropy", Shape{37, 101},
                    [&ctx](const Tensor& x) {
                      Tensor losses = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      Tensor lse = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      ops::cross_entropy_forward(x, targets_for(ctx, x.size(0), x.size(1), x.device()), losses, lse);
                      return losses;
                    },
                    [&ctx](const Tensor& x, const Tensor& g) {
                      Tensor losses = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      Tensor lse = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      Tensor targets = targets_for(ctx, x.size(0), x.size(1), x.device());
                      ops::cross_entropy_forward(x, targets, losses, lse);
                      Tensor d = ctx.empty(x.shape(), x.dtype(), x.device());
                      ops::cross_entropy_backward(x, lse, targets, g, d);
                      return d;
                    }});
  auto norm_params = [&ctx](const Tensor& x, uint64_t seed) {
    return std::pair{random_like(ctx, Shape{x.size(-1)}, seed, x.device()),
                     random_like(ctx, Shape{x.size(-1)}, seed + 1, x.device())};
  };
  checks.push_back({"layernorm", Shape{29, 96},
                    [=, &ctx](const Tensor& x) {
                      auto [w, b] = norm_params(x, 11);
                      Tensor y = same(x), mean = ctx.empty(Shape{x.size(0)}, DType::f32, x.device()),
                             rstd = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      ops::layernorm_forward(x, w, b, y, mean, rstd);
                      return y;
                    },
                    [=, &ctx](const Tensor& x, const Tensor& g) {
                      auto [w, b] = norm_params(x, 11);
                      Tensor y = same(x), mean = ctx.empty(Shape{x.size(0)}, DType::f32, x.device()),
                             rstd = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      ops::layernorm_forward(x, w, b, y, mean, rstd);
                      Tensor d = same(x), dw = same(w), db = same(b);
                      ops::layernorm_backward(g, x, w, mean, rstd, d, dw, &db);
                      return d;
                    }});
  checks.push_back({"rmsnorm", Shape{29, 96},
                    [=, &ctx](const Tensor& x) {
                      Tensor w = norm_params(x, 13).first, y = same(x),
                             rstd = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      ops::rmsnorm_forward(x, w, y, rstd);
                      return y;
                    },
                    [=, &ctx](const Tensor& x, const Tensor& g) {
                      Tensor w = norm_params(x, 13).first, y = same(x),
                             rstd = ctx.empty(Shape{x.size(0)}, DType::f32, x.device());
                      ops::rmsnorm_forward(x, w, y, rstd);
                      Tensor d = same(x), dw = same(w);
                      ops::rmsnorm_backward(g, x, w, rstd, d, dw);
                      return d;
                    }});
  checks.push_back({"matmul", Shape{45, 67},
                    [&ctx](const Tensor& a) {
                      Tensor b = random_like(ctx, Shape{67, 39}, 21, a.device());
                      Tensor c = ctx.empty(Shape{45, 39}, DType::f32, a.device());
                      ops::matmul(a, b, c);
                      return c;
                    },
                    [&ctx](const Tensor& a, const Tensor& g) {
                      Tensor b = random_like(ctx, Shape{67, 39}, 21, a.device());
                      Tensor d = ctx.empty(a.shape(), DType::f32, a.device());
                      ops::matmul_backward(g, a, b, &d, nullptr);
                      return d;
                    }});
  checks.push_back({"linear+gelu", Shape{31, 48},
                    [&ctx](const Tensor& x) {
                      Tensor w = random_like(ctx, Shape{40, 48}, 31, x.device());
                      Tensor bias = random_like(ctx, Shape{40}, 32, x.device());
                      Tensor y = ctx.empty(Shape{31, 40}, DType::f32, x.device());
                      ops::MatmulOptions options;
                      options.transpose_b = true;
                      options.bias = &bias;
                      options.activation = ops::Activation::gelu;
                      ops::matmul(x, w, y, options);
                      return y;
                    },
                    [&ctx](const Tensor& x, const Tensor& g) {
                      Tensor w = random_like(ctx, Shape{40, 48}, 31, x.device());
                      Tensor bias = random_like(ctx, Shape{40}, 32, x.device());
                      Tensor y = ctx.empty(Shape{31, 40}, DType::f32, x.device()),
                             pre = ctx.empty(y.shape(), DType::f32, x.device());
                      ops::MatmulOptions options;
                      options.transpose_b = true;
                      options.bias = &bias;
                      options.activation = ops::Activation::gelu;
                      options.pre_activation = &pre;
                      ops::matmul(x, w, y, options);
                      Tensor dpre = ctx.empty(y.shape(), DType::f32, x.device());
                      ops::gelu_backward(pre, g, dpre);
                      Tensor d = ctx.empty(x.shape(), DType::f32, x.device());
                      ops::matmul_backward(dpre, x, w, &d, nullptr, false, true);
                      return d;
                    }});
  checks.push_back({"dropout", Shape{50, 77},
                    [=](const Tensor& x) {
                      Tensor y = same(x);
                      ops::dropout_forward(x, y, 0.25f, 5, 100);
                      return y;
                    },
                    [=](const Tensor& x, const Tensor& g) {
                      Tensor d = same(x);
                      ops::dropout_backward(g, d, 0.25f, 5, 100);
                      return d;
                    }});
  checks.push_back({"embedding", Shape{53, 24},
                    [&ctx](const Tensor& table) {
                      std::vector<int32_t> ids(40);
                      for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 31) % 53);
                      Tensor out = ctx.empty(Shape{40, 24}, DType::f32, table.device());
                      ops::embedding_forward(ctx.from_vector(Shape{40}, ids, table.device()), table, out);
                      return out;
                    },
                    [&ctx](const Tensor& table, const Tensor& g) {
                      std::vector<int32_t> ids(40);
                      for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 31) % 53);
                      Tensor d = ctx.zeros(table.shape(), DType::f32, table.device());
                      ops::embedding_backward(ctx.from_vector(Shape{40}, ids, table.device()), g, d);
                      return d;
                    }});
  checks.push_back({"attention", Shape{2, 19, 3, 3, 8},
                    [&ctx](const Tensor& qkv) {
                      Tensor out = ctx.empty(Shape{2, 19, 3, 8}, DType::f32, qkv.device());
                      Tensor lse = ctx.empty(Shape{2, 3, 19}, DType::f32, qkv.device());
                      ops::attention_forward(qkv, out, lse);
                      return out;
                    },
                    [&ctx](const Tensor& qkv, const Tensor& g) {
                      Tensor out = ctx.empty(Shape{2, 19, 3, 8}, DType::f32, qkv.device());
                      Tensor lse = ctx.empty(Shape{2, 3, 19}, DType::f32, qkv.device());
                      ops::attention_forward(qkv, out, lse);
                      Tensor d = ctx.empty(qkv.shape(), DType::f32, qkv.device());
                      ops::attention_backward(g, qkv, out, lse, d);
                      return d;
                    }});
  // Grouped-query attention: G = 2 groups of R = 2 query heads.
  checks.push_back({"grouped_attention", Shape{2, 19, 2, 4, 8},
                    [&ctx](const Tensor& qkv) {
                      Tensor out = ctx.empty(Shape{2, 19, 4, 8}, DType::f32, qkv.device());
                      Tensor lse = ctx.empty(Shape{2, 4, 19}, DType::f32, qkv.device());
                      ops::grouped_attention_forward(qkv, out, lse);
                      return out;
                    },
                    [&ctx](const Tensor& qkv, const Tensor& g) {
                      Tensor out = ctx.empty(Shape{2, 19, 4, 8}, DType::f32, qkv.device());
                      Tensor lse = ctx.empty(Shape{2, 4, 19}, DType::f32, qkv.device());
                      ops::grouped_attention_forward(qkv, out, lse);
                      Tensor d = ctx.empty(qkv.shape(), DType::f32, qkv.device());
                      ops::grouped_attention_backward(g, qkv, out, lse, d);
                      return d;
                    }});
  // The same with dropout on the probabilities: the device must draw the CPU's mask
  // (heads numbered from 2, as a tensor-parallel rank's; sequences from 3).
  const ops::AttentionDropout attention_dropout{0.2f, 7, 3, 2};
  checks.push_back({"grouped_attention_dropout", Shape{2, 19, 2, 4, 8},
                    [=, &ctx](const Tensor& qkv) {
                      Tensor out = ctx.empty(Shape{2, 19, 4, 8}, DType::f32, qkv.device());
                      Tensor lse = ctx.empty(Shape{2, 4, 19}, DType::f32, qkv.device());
                      ops::grouped_attention_forward(qkv, out, lse, 0.0f, attention_dropout);
                      return out;
                    },
                    [=, &ctx](const Tensor& qkv, const Tensor& g) {
                      Tensor out = ctx.empty(Shape{2, 19, 4, 8}, DType::f32, qkv.device());
                      Tensor lse = ctx.empty(Shape{2, 4, 19}, DType::f32, qkv.device());
                      ops::grouped_attention_forward(qkv, out, lse, 0.0f, attention_dropout);
                      Tensor d = ctx.empty(qkv.shape(), DType::f32, qkv.device());
                      ops::grouped_attention_backward(g, qkv, out, lse, d, 0.0f, attention_dropout);
                      return d;
                    }});
  // Positions of a later chunk of a sequence, not contiguous.
  auto rotary_positions = [&ctx](Device device) {
    return ctx.from_vector(Shape{7}, std::vector<int32_t>{40, 41, 42, 97, 98, 300, 301}, device);
  };
  checks.push_back({"rotary", Shape{2, 7, 2, 3, 16},
                    [=, &ctx](const Tensor& qkv) {
                      Tensor out = ctx.empty(qkv.shape(), DType::f32, qkv.device());
                      ops::rotary_forward(qkv, rotary_positions(qkv.device()), out, 10000.0f);
                      return out;
                    },
                    [=, &ctx](const Tensor& qkv, const Tensor& g) {
                      Tensor d = ctx.empty(qkv.shape(), DType::f32, qkv.device());
                      ops::rotary_backward(g, rotary_positions(qkv.device()), d, 10000.0f);
                      return d;
                    }});
  checks.push_back({"swiglu", Shape{37, 2 * 67},
                    [&ctx](const Tensor& x) {
                      Tensor y = ctx.empty(Shape{37, 67}, DType::f32, x.device());
                      ops::swiglu_forward(x, y);
                      return y;
                    },
                    [=](const Tensor& x, const Tensor& g) {
                      Tensor d = same(x);
                      ops::swiglu_backward(x, g, d);
                      return d;
                    }});
  const ops::Conv2dParams conv{1, 1, 2, 2};
  checks.push_back({"conv2d", Shape{2, 3, 12, 11},
                    [&ctx, conv](const Tensor& x) {
                      Tensor w = random_like(ctx, Shape{4, 3, 5, 5}, 41, x.device(), 0.3f);
                      Tensor b = random_like(ctx, Shape{4}, 42, x.device());
                      Tensor y =
                          ctx.empty(ops::conv2d_output_shape(x.shape(), w.shape(), conv), DType::f32, x.device());
                      ops::conv2d_forward(x, w, b, y, conv);
                      return y;
                    },
                    [&ctx, conv](const Tensor& x, const Tensor& g) {
                      Tensor w = random_like(ctx, Shape{4, 3, 5, 5}, 41, x.device(), 0.3f);
                      Tensor d = ctx.empty(x.shape(), DType::f32, x.device());
                      ops::conv2d_backward(g, x, w, &d, nullptr, nullptr, conv);
                      return d;
                    }});
  const ops::Pool2dParams pool{2, 2, 2, 2, 0, 0};
  checks.push_back({"maxpool2d", Shape{2, 3, 12, 11},
                    [&ctx, pool](const Tensor& x) {
                      const Shape out = ops::maxpool2d_output_shape(x.shape(), pool);
                      Tensor y = ctx.empty(out, DType::f32, x.device()), idx = ctx.empty(out, DType::i32, x.device());
                      ops::maxpool2d_forward(x, y, idx, pool);
                      return y;
                    },
                    [&ctx, pool](const Tensor& x, const Tensor& g) {
                      const Shape out = ops::maxpool2d_output_shape(x.shape(), pool);
                      Tensor y = ctx.empty(out, DType::f32, x.device()), idx = ctx.empty(out, DType::i32, x.device());
                      ops::maxpool2d_forward(x, y, idx, pool);
                      Tensor d = ctx.empty(x.shape(), DType::f32, x.device());
                      ops::maxpool2d_backward(g, idx, d, pool);
                      return d;
                    },
                    1e-4f, Check::Inputs::distinct});
  checks.push_back({"sum_squares", Shape{1001},
                    [&ctx](const Tensor& x) {
                      Tensor out = ctx.empty(Shape{1}, DType::f32, x.device());
                      ops::sum_squares(x, out);
                      return out;
                    },
                    [&ctx](const Tensor& x, const Tensor& g) {
                      Tensor d = ctx.empty(x.shape(), DType::f32, x.device());
                      ops::sum_squares_backward(x, g, d);
                      return d;
                    }});
  return checks;
}

struct Result {
  bool ok = true;
  std::string detail;
};

// The backward against a central directional derivative of the forward, in f32.
Result check_gradient(Context& ctx, const Check& check, Device device, uint64_t seed) {
  Tensor x = check_input(ctx, check, seed, device);
  Tensor y = check.forward(x);
  Tensor g = random_like(ctx, y.shape(), seed + 1, device);
  Tensor v = random_like(ctx, check.input_shape, seed + 2, device);
  Tensor grad = check.backward(x, g);
  const float eps = check.epsilon;
  Tensor plus = x.clone(), minus = x.clone();
  ops::axpy(eps, v, plus);
  ops::axpy(-eps, v, minus);
  const double numeric = (dot(g, check.forward(plus)) - dot(g, check.forward(minus))) / (2.0 * eps);
  const double analytic = dot(v, grad);
  const double error = std::abs(numeric - analytic) / std::max(1.0, std::abs(analytic));
  char text[160];
  std::snprintf(text, sizeof text, "directional derivative %.6g vs backward %.6g (rel %.1e)", numeric, analytic, error);
  return {error < 2e-2, text};
}

Result compare_devices(Context& ctx, const Check& check, Device gpu, uint64_t seed) {
  Tensor x = check_input(ctx, check, seed, Device::cpu());
  Tensor y_cpu = check.forward(x);
  Tensor g = random_like(ctx, y_cpu.shape(), seed + 1, Device::cpu());
  Tensor y_gpu = check.forward(x.to(gpu));
  Tensor d_cpu = check.backward(x, g), d_gpu = check.backward(x.to(gpu), g.to(gpu));
  const double fwd = max_relative_difference(y_gpu, y_cpu), bwd = max_relative_difference(d_gpu, d_cpu);
  char text[128];
  std::snprintf(text, sizeof text, "gpu vs cpu: forward %.1e, backward %.1e", fwd, bwd);
  return {fwd < 1e-4 && bwd < 1e-4, text};
}

}  // namespace

int run_selfcheck(const SelfcheckOptions& options) {
  Context ctx;
  std::printf("tessera selfcheck: %s\n", ctx.describe().c_str());
  const bool gpu = ctx.cuda_device_count() > 0;
  if (!gpu) std::printf("no CUDA device here: checking the CPU backend only\n");
  int failures = 0;
  uint64_t seed = options.seed;
  for (const Check& check : make_checks(ctx)) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<Result> results;
    try {
      results.push_back(check_gradient(ctx, check, Device::cpu(), seed));
      if (gpu) results.push_back(compare_devices(ctx, check, Device::cuda(0), seed));
    } catch (const std::exception& error) {
      results.push_back({false, std::string("error: ") + error.what()});
    }
    seed += 10;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    bool ok = true;
    std::string detail;
    for (const Result& r : results) ok = ok && r.ok, detail += (detail.empty() ? "" : "; ") + r.detail;
    failures += ok ? 0 : 1;
    std::printf("selfcheck op=%-17s status=%s ms=%.1f  %s\n", check.name.c_str(), ok ? "ok" : "FAIL", ms,
                detail.c_str());
  }
  std::printf("selfcheck failures=%d\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace tessera::app
