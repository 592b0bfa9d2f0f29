// parallel::MixtureOfExperts on one rank against a double-precision
// reference written here from the definitions (the router's softmax, top-k
// and renormalised weights, Switch's load-balancing loss over the choices
// before capacity, the z-loss, capacity in token order, SwiGLU experts
// fc = [w1; w3], proj = w2, the weighted sum): the output, the losses'
// values and the tokens per expert; the gradients of the input and of every
// parameter against central differences of the reference's
// Σ out·g + s·(aux + z), s the pass's loss-gradient scale; dropless and with
// a capacity that drops choices; moe_plan's grouping and dropping.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "parallel/moe.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using parallel::MoeConfig;

// The layer's parameters in double: router [E, C], fc[e] [2F, C], proj[e] [C, F].
struct Weights {
  std::vector<double> router;
  std::vector<std::vector<double>> fc, proj;
};

struct Reference {
  std::vector<double> out;
  double aux = 0, z = 0;
  std::vector<int64_t> kept;  // per expert
};

double silu(double v) {
  return v / (1.0 + std::exp(-v));
}

Reference reference_moe(const MoeConfig& c, int64_t hidden, const std::vector<double>& x, const Weights& w) {
  const int64_t n = int64_t(x.size()) / hidden, e = c.num_experts, k = c.top_k, f = c.ffn_hidden;
  Reference r;
  r.out.assign(x.size(), 0.0);
  r.kept.assign(size_t(e), 0);
  std::vector<double> probs(static_cast<size_t>(n * e));
  std::vector<std::vector<int64_t>> chosen(static_cast<size_t>(n));
  std::vector<std::vector<double>> weights(static_cast<size_t>(n));
  std::vector<int64_t> chosen_count(static_cast<size_t>(e), 0);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> logits(static_cast<size_t>(e), 0.0);
    for (int64_t q = 0; q < e; ++q)
      for (int64_t i = 0; i < hidden; ++i)
        logits[size_t(q)] += w.router[size_t(q * hidden + i)] * x[size_t(t * hidden + i)];
    const double top = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (const double l : logits) sum += std::exp(l - top);
    const double lse = top + std::log(sum);
    r.z += lse * lse;
    for (int64_t q = 0; q < e; ++q) probs[size_t(t * e + q)] = std::exp(logits[size_t(q)] - lse);
    std::vector<int64_t> order(static_cast<size_t>(e));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return probs[size_t(t * e + a)] > probs[size_t(t * e + b)]; });
    double kept = 0.0;
    for (int64_t j = 0; j < k; ++j) kept += probs[size_t(t * e + order[size_t(j)])];
    for (int64_t j = 0; j < k; ++j) {
      chosen[size_t(t)].push_back(order[size_t(j)]);
      weights[size_t(t)].push_back(probs[size_t(t * e + order[size_t(j)])] / kept);
      ++chosen_count[size_t(order[size_t(j)])];
    }
  }
  const int64_t capacity = c.capacity_factor > 0
                               ? std::max<int64_t>(1, int64_t(std::ceil(c.capacity_factor * double(n * k) / double(e))))
                               : 0;
  for (int64_t t = 0; t < n; ++t)  // token order, then choice order: the first ones are kept
    for (int64_t j = 0; j < k; ++j) {
      const int64_t q = chosen[size_t(t)][size_t(j)];
      if (capacity > 0 && r.kept[size_t(q)] >= capacity) continue;
      ++r.kept[size_t(q)];
      std::vector<double> act(static_cast<size_t>(f));
      for (int64_t a = 0; a < f; ++a) {
        double gate = 0.0, up = 0.0;
        for (int64_t i = 0; i < hidden; ++i) {
          gate += w.fc[size_t(q)][size_t(a * hidden + i)] * x[size_t(t * hidden + i)];
          up += w.fc[size_t(q)][size_t((f + a) * hidden + i)] * x[size_t(t * hidden + i)];
        }
        act[size_t(a)] = silu(gate) * up;
      }
      for (int64_t o = 0; o < hidden; ++o) {
        double y = 0.0;
        for (int64_t a = 0; a < f; ++a) y += w.proj[size_t(q)][size_t(o * f + a)] * act[size_t(a)];
        r.out[size_t(t * hidden + o)] += weights[size_t(t)][size_t(j)] * y;
      }
    }
  double balance = 0.0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t q = 0; q < e; ++q) balance += double(chosen_count[size_t(q)]) * probs[size_t(t * e + q)];
  r.aux = c.aux_loss_coeff * double(e) / (double(n) * double(n) * double(k)) * balance;
  r.z = c.z_loss_coeff * r.z / double(n);
  return r;
}

double reference_loss(const MoeConfig& c, int64_t hidden, const std::vector<double>& x, const Weights& w,
                      const std::vector<double>& g, double scale) {
  const Reference r = reference_moe(c, hidden, x, w);
  double loss = scale * (r.aux + r.z);
  for (size_t i = 0; i < g.size(); ++i) loss += g[i] * r.out[i];
  return loss;
}

// Central differences of reference_loss in every element of `values` (x or one weight tensor).
template <typename Loss>
std::vector<double> differences(std::vector<double>& values, Loss&& loss) {
  constexpr double kStep = 1e-6;
  std::vector<double> grad(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    values[i] = saved + kStep;
    const double up = loss();
    values[i] = saved - kStep;
    const double down = loss();
    values[i] = saved;
    grad[i] = (up - down) / (2.0 * kStep);
  }
  return grad;
}

struct Case {
  const char* name;
  MoeConfig config;
};

MoeConfig config_of(int64_t experts, int64_t top_k, int64_t ffn, double capacity, double aux, double z) {
  MoeConfig c;
  c.num_experts = experts;
  c.top_k = top_k;
  c.ffn_hidden = ffn;
  c.capacity_factor = capacity;
  c.aux_loss_coeff = aux;
  c.z_loss_coeff = z;
  return c;
}

TEST(MixtureOfExperts, ForwardLossesAndEveryGradientMatchTheReference) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  constexpr int64_t kHidden = 6, kBatch = 2, kTokens = 5;
  for (const Case& test : {Case{"dropless, top-2 of 4", config_of(4, 2, 5, 0.0, 0.01, 0.001)},
                           Case{"capacity 0.6, top-2 of 4", config_of(4, 2, 5, 0.6, 0.02, 0.0)},
                           Case{"top-1 of 3", config_of(3, 1, 4, 0.0, 0.0, 0.01)}}) {
    SCOPED_TRACE(test.name);
    Context ctx;
    nn::ModelSpec spec;
    spec.context = &ctx;
    spec.seed = rng();
    parallel::MixtureOfExperts moe(spec, "moe", kHidden, test.config, 0.0f);
    std::map<std::string, nn::Parameter*> by_name;
    for (nn::Parameter* p : moe.parameters()) by_name[p->name] = p;
    ASSERT_EQ(by_name.size(), size_t(1 + 2 * test.config.num_experts));
    Weights w;
    w.router = by_name.at("moe.router.weight")->value.to_doubles();
    for (int64_t e = 0; e < test.config.num_experts; ++e) {
      const std::string prefix = "moe.experts." + std::to_string(e);
      w.fc.push_back(by_name.at(prefix + ".fc.weight")->value.to_doubles());
      w.proj.push_back(by_name.at(prefix + ".proj.weight")->value.to_doubles());
    }
    const RandomTensor x = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::f32, rng, -2.0, 2.0);
    const RandomTensor g = random_tensor(ctx, Shape{kBatch, kTokens, kHidden}, DType::f32, rng);
    const double scale = 0.75;

    nn::Saved saved;
    nn::Pass pass;
    pass.loss_gradient_scale = float(scale);
    const Tensor out = moe.forward(x.tensor, saved, pass);
    const Reference ref = reference_moe(test.config, kHidden, x.values, w);
    EXPECT_TRUE(all_close(out, ref.out, Tolerance{1e-5, 1e-6})) << "out";
    EXPECT_NEAR(moe.last_stats().aux_loss, ref.aux, 1e-6 * (1.0 + ref.aux));
    EXPECT_NEAR(moe.last_stats().z_loss, ref.z, 1e-5 * (1.0 + ref.z));
    EXPECT_EQ(moe.last_stats().tokens_per_expert, ref.kept);
    int64_t kept = 0;
    for (const int64_t count : ref.kept) kept += count;
    EXPECT_EQ(moe.last_stats().dropped, kBatch * kTokens * test.config.top_k - kept);
    if (test.config.capacity_factor > 0) {
      EXPECT_GT(moe.last_stats().dropped, 0) << "this capacity drops choices";
    }

    nn::zero_grads(moe.parameters());
    const Tensor dx = moe.backward(g.tensor, saved);
    std::vector<double> xs = x.values;
    const auto loss = [&] { return reference_loss(test.config, kHidden, xs, w, g.values, scale); };
    EXPECT_TRUE(all_close(dx, differences(xs, loss), Tolerance{1e-4, 1e-5})) << "grad x";
    EXPECT_TRUE(all_close(by_name.at("moe.router.weight")->grad, differences(w.router, loss), Tolerance{1e-4, 1e-5}))
        << "grad router";
    for (int64_t e = 0; e < test.config.num_experts; ++e) {
      const std::string prefix = "moe.experts." + std::to_string(e);
      EXPECT_TRUE(
          all_close(by_name.at(prefix + ".fc.weight")->grad, differences(w.fc[size_t(e)], loss), Tolerance{1e-4, 1e-5}))
          << prefix << " fc";
      EXPECT_TRUE(all_close(by_name.at(prefix + ".proj.weight")->grad, differences(w.proj[size_t(e)], loss),
                            Tolerance{1e-4, 1e-5}))
          << prefix << " proj";
    }
  }
}

// Choices grouped by expert in token order; over capacity the later ones drop.
TEST(MoePlan, GroupsByExpertInTokenOrderAndDropsTheLaterChoices) {
  // 4 tokens, K = 2, E = 3: choices (t·2 + j) → expert.
  const std::vector<int32_t> experts = {2, 0, 0, 1, 2, 0, 1, 2};
  const parallel::MoePlan dropless = parallel::moe_plan(experts, 3, 0);
  EXPECT_EQ(dropless.pairs, (std::vector<int32_t>{1, 2, 5, 3, 6, 0, 4, 7}));
  EXPECT_EQ(dropless.offsets, (std::vector<int64_t>{0, 3, 5, 8}));
  EXPECT_EQ(dropless.chosen, (std::vector<int64_t>{3, 2, 3}));
  EXPECT_EQ(dropless.slot_of, (std::vector<int32_t>{5, 0, 1, 3, 6, 2, 4, 7}));
  const parallel::MoePlan two = parallel::moe_plan(experts, 3, 2);
  EXPECT_EQ(two.pairs, (std::vector<int32_t>{1, 2, 3, 6, 0, 4}));
  EXPECT_EQ(two.offsets, (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(two.chosen, (std::vector<int64_t>{3, 2, 3}));  // before capacity
  EXPECT_EQ(two.slot_of, (std::vector<int32_t>{4, 0, 1, 2, 5, -1, 3, -1}));
  EXPECT_THROW(parallel::moe_plan({0, 3}, 3, 0), Error);
}

}  // namespace
}  // namespace tessera::testing
