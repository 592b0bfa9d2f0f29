// ops::moe_route / moe_route_backward (the mixture of experts' router)
// against a double-precision reference written here: the softmax over every
// expert, the k most likely (ties: the lower index), the renormalised
// weights and the logsumexp; the backward against central differences of the
// reference's loss Σ g_w·w + Σ g_p·p + g_lse·lse (each part alone and all
// together), on fresh random logits with outputs poisoned before the call;
// tied logits choose the lower index; arguments that do not fit are refused
// naming the flag; the GPU's functors equal the CPU's where there is a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Routed {
  std::vector<double> probs, weights, lse;
  std::vector<int32_t> experts;
};

// The router in double for N tokens of E logits.
Routed reference_route(const std::vector<double>& logits, int64_t tokens, int64_t num_experts, int64_t top_k) {
  Routed r;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* l = logits.data() + t * num_experts;
    const double top = *std::max_element(l, l + num_experts);
    double sum = 0.0;
    for (int64_t e = 0; e < num_experts; ++e) sum += std::exp(l[e] - top);
    const double lse = top + std::log(sum);
    r.lse.push_back(lse);
    std::vector<double> p(static_cast<size_t>(num_experts));
    for (int64_t e = 0; e < num_experts; ++e) p[size_t(e)] = std::exp(l[e] - lse);
    r.probs.insert(r.probs.end(), p.begin(), p.end());
    std::vector<int32_t> order(static_cast<size_t>(num_experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; });
    double kept = 0.0;
    for (int64_t j = 0; j < top_k; ++j) kept += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < top_k; ++j) {
      r.experts.push_back(order[size_t(j)]);
      r.weights.push_back(p[size_t(order[size_t(j)])] / kept);
    }
  }
  return r;
}

struct RouteGrads {
  std::vector<double> weights, probs, lse;  // empty probs / lse: that term is left out
};

double reference_loss(const std::vector<double>& logits, int64_t tokens, int64_t num_experts, int64_t top_k,
                      const RouteGrads& g) {
  const Routed r = reference_route(logits, tokens, num_experts, top_k);
  double loss = 0.0;
  for (size_t i = 0; i < r.weights.size(); ++i) loss += g.weights[i] * r.weights[i];
  for (size_t i = 0; i < g.probs.size(); ++i) loss += g.probs[i] * r.probs[i];
  for (size_t i = 0; i < g.lse.size(); ++i) loss += g.lse[i] * r.lse[i];
  return loss;
}

// Central differences of reference_loss in every logit.
std::vector<double> numeric_gradient(std::vector<double> logits, int64_t tokens, int64_t num_experts, int64_t top_k,
                                     const RouteGrads& g) {
  constexpr double kStep = 1e-6;
  std::vector<double> grad(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    const double saved = logits[i];
    logits[i] = saved + kStep;
    const double up = reference_loss(logits, tokens, num_experts, top_k, g);
    logits[i] = saved - kStep;
    const double down = reference_loss(logits, tokens, num_experts, top_k, g);
    logits[i] = saved;
    grad[i] = (up - down) / (2.0 * kStep);
  }
  return grad;
}

struct Sizes {
  int64_t tokens, num_experts, top_k;
};
const Sizes kSizes[] = {{37, 8, 2}, {5, 4, 1}, {9, 16, 4}, {3, 6, 6}, {1, 64, 8}};

std::string describe(const Sizes& s) {
  return "N " + std::to_string(s.tokens) + " E " + std::to_string(s.num_experts) + " K " + std::to_string(s.top_k);
}

// Logits a few units apart, so no two probabilities are within the
// differences' step of each other (the chosen set is the same on both sides).
std::vector<double> spread_logits(const Sizes& s, std::mt19937_64& rng) {
  std::vector<double> logits;
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<double> row(static_cast<size_t>(s.num_experts));
    for (int64_t e = 0; e < s.num_experts; ++e) row[size_t(e)] = 0.25 * double(e);
    std::shuffle(row.begin(), row.end(), rng);
    const double shift = std::uniform_real_distribution<double>(-3.0, 3.0)(rng);
    for (double& v : row) v += shift + std::uniform_real_distribution<double>(-0.05, 0.05)(rng);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return round_to(DType::f32, logits);
}

struct Outputs {
  Tensor probs, experts, weights, lse;
};
Outputs route(Context& ctx, const Tensor& logits, int64_t top_k, Device device = Device::cpu()) {
  const int64_t tokens = logits.size(0), num_experts = logits.size(1);
  Outputs o{poisoned(ctx, Shape{tokens, num_experts}, DType::f32, device),
            poisoned(ctx, Shape{tokens, top_k}, DType::i32, device),
            poisoned(ctx, Shape{tokens, top_k}, DType::f32, device), poisoned(ctx, Shape{tokens}, DType::f32, device)};
  ops::moe_route(logits, o.probs, o.experts, o.weights, o.lse);
  return o;
}

TEST(MoeRoute, ForwardMatchesTheReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const Sizes& s : kSizes) {
    SCOPED_TRACE(describe(s));
    const RandomTensor logits = random_tensor(ctx, Shape{s.tokens, s.num_experts}, DType::f32, rng, -4.0, 4.0);
    const Outputs o = route(ctx, logits.tensor, s.top_k);
    const Routed r = reference_route(logits.values, s.tokens, s.num_experts, s.top_k);
    EXPECT_EQ(o.experts.to_vector<int32_t>(), r.experts);
    EXPECT_TRUE(all_close(o.probs, r.probs, Tolerance{1e-6, 1e-7})) << "probs";
    EXPECT_TRUE(all_close(o.weights, r.weights, Tolerance{1e-6, 1e-7})) << "weights";
    EXPECT_TRUE(all_close(o.lse, r.lse, Tolerance{1e-6, 1e-6})) << "logsumexp";
  }
}

// Equal logits: the lower index wins, and equal weights.
TEST(MoeRoute, TiesChooseTheLowerIndex) {
  Context ctx;
  const Tensor logits = ctx.from_vector(Shape{2, 6}, std::vector<float>{0.5f, 2.0f, 0.5f, 2.0f, 2.0f, -1.0f,  //
                                                                        1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f});
  const Outputs o = route(ctx, logits, 2);
  EXPECT_EQ(o.experts.to_vector<int32_t>(), (std::vector<int32_t>{1, 3, 0, 1}));
  EXPECT_EQ(o.weights.to_vector<float>(), (std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f}));
}

TEST(MoeRoute, BackwardMatchesDifferencesOfTheReference) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const Sizes& s : kSizes) {
    const std::vector<double> values = spread_logits(s, rng);
    const Tensor logits = ctx.from_doubles(Shape{s.tokens, s.num_experts}, DType::f32, values);
    const Outputs o = route(ctx, logits, s.top_k);
    const RandomTensor grad_weights = random_tensor(ctx, Shape{s.tokens, s.top_k}, DType::f32, rng);
    const RandomTensor grad_probs = random_tensor(ctx, Shape{s.tokens, s.num_experts}, DType::f32, rng);
    const RandomTensor grad_lse = random_tensor(ctx, Shape{s.tokens}, DType::f32, rng);
    for (int terms = 0; terms < 4; ++terms) {  // weights only, + probs, + lse, all three
      const bool with_probs = terms == 1 || terms == 3, with_lse = terms >= 2;
      SCOPED_TRACE(describe(s) + (with_probs ? " +probs" : "") + (with_lse ? " +logsumexp" : ""));
      RouteGrads g{grad_weights.values, with_probs ? grad_probs.values : std::vector<double>{},
                   with_lse ? grad_lse.values : std::vector<double>{}};
      Tensor grad_logits = poisoned(ctx, Shape{s.tokens, s.num_experts}, DType::f32);
      ops::moe_route_backward(o.probs, o.experts, o.weights, grad_weights.tensor,
                              with_probs ? &grad_probs.tensor : nullptr, with_lse ? &grad_lse.tensor : nullptr,
                              grad_logits);
      EXPECT_TRUE(
          all_close(grad_logits, numeric_gradient(values, s.tokens, s.num_experts, s.top_k, g), Tolerance{1e-4, 1e-5}));
    }
  }
}

TEST(MoeRoute, ArgumentsThatDoNotFitAreRefused) {
  Context ctx;
  const Tensor logits = ctx.zeros(Shape{4, 3}, DType::f32);
  Tensor probs = ctx.zeros(Shape{4, 3}, DType::f32), lse = ctx.zeros(Shape{4}, DType::f32);
  Tensor four = ctx.zeros(Shape{4, 4}, DType::i32), weights4 = ctx.zeros(Shape{4, 4}, DType::f32);
  try {
    ops::moe_route(logits, probs, four, weights4, lse);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("top-k 4 must be from 1 to the 3 experts; check --moe-router-topk"),
              std::string::npos)
        << error.what();
  }
  Tensor experts = ctx.zeros(Shape{4, 2}, DType::i32), weights = ctx.zeros(Shape{4, 2}, DType::f32);
  EXPECT_THROW(ops::moe_route(ctx.zeros(Shape{4, 3}, DType::bf16), probs, experts, weights, lse), Error);
  EXPECT_THROW(ops::moe_route(logits, probs, experts, weights, probs), Error);
  Tensor grad = ctx.zeros(Shape{4, 3}, DType::f32);
  EXPECT_THROW(
      ops::moe_route_backward(probs, experts, weights, ctx.zeros(Shape{4, 3}, DType::f32), nullptr, nullptr, grad),
      Error);
}

TEST(MoeRoute, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  for (const Sizes& s : {Sizes{4000, 8, 2}, Sizes{300, 64, 6}, Sizes{17, 128, 1}}) {
    SCOPED_TRACE(describe(s));
    const Tensor logits = ctx.from_doubles(Shape{s.tokens, s.num_experts}, DType::f32, spread_logits(s, rng));
    const Outputs cpu = route(ctx, logits, s.top_k), device = route(ctx, logits.to(gpu), s.top_k, gpu);
    EXPECT_EQ(device.experts.to_vector<int32_t>(), cpu.experts.to_vector<int32_t>());
    EXPECT_TRUE(all_close(device.probs, cpu.probs, Tolerance{1e-6, 1e-7}));
    EXPECT_TRUE(all_close(device.weights, cpu.weights, Tolerance{1e-6, 1e-7}));
    EXPECT_TRUE(all_close(device.lse, cpu.lse, Tolerance{1e-6, 1e-6}));
    const Tensor grad_weights = random_tensor(ctx, Shape{s.tokens, s.top_k}, DType::f32, rng).tensor;
    const Tensor grad_probs = random_tensor(ctx, Shape{s.tokens, s.num_experts}, DType::f32, rng).tensor;
    const Tensor grad_lse = random_tensor(ctx, Shape{s.tokens}, DType::f32, rng).tensor;
    Tensor on_cpu = poisoned(ctx, logits.shape(), DType::f32), on_gpu = poisoned(ctx, logits.shape(), DType::f32, gpu);
    ops::moe_route_backward(cpu.probs, cpu.experts, cpu.weights, grad_weights, &grad_probs, &grad_lse, on_cpu);
    const Tensor grad_probs_gpu = grad_probs.to(gpu), grad_lse_gpu = grad_lse.to(gpu);
    ops::moe_route_backward(cpu.probs.to(gpu), cpu.experts.to(gpu), cpu.weights.to(gpu), grad_weights.to(gpu),
                            &grad_probs_gpu, &grad_lse_gpu, on_gpu);
    EXPECT_TRUE(all_close(on_gpu, on_cpu, Tolerance{1e-5, 1e-6}));
  }
}

}  // namespace
}  // namespace tessera::testing
