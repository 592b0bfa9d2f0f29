// nn::sample_token: greedy is the first largest logit; top-k 1 is greedy at
// any temperature; the same (seed, draw) gives the same token; over many
// draws the frequencies follow softmax(logits / T) restricted to the top-k
// and nucleus sets, computed here in double by sorting independently
// (a chi-square bound); tokens outside those sets are never drawn; bad
// options are refused naming the flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "nn/sampling.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

std::vector<float> random_logits(std::mt19937_64& rng, size_t n, double spread) {
  std::normal_distribution<double> normal(0.0, spread);
  std::vector<float> logits(n);
  for (float& l : logits) l = float(normal(rng));
  return logits;
}

// The distribution sample_token should draw from, computed naively.
std::map<int64_t, double> expected_distribution(const std::vector<float>& logits, double temperature, int64_t top_k,
                                                double top_p) {
  std::vector<std::pair<double, int64_t>> ranked;
  for (size_t i = 0; i < logits.size(); ++i) ranked.emplace_back(-double(logits[i]), int64_t(i));
  std::sort(ranked.begin(), ranked.end());  // most likely first, ties by id
  if (top_k > 0 && size_t(top_k) < ranked.size()) ranked.resize(size_t(top_k));
  std::vector<double> p;
  for (const auto& [negative, id] : ranked) p.push_back(std::exp(-negative / temperature));
  const double total = std::accumulate(p.begin(), p.end(), 0.0);
  size_t keep = p.size();
  double mass = 0.0;
  for (size_t i = 0; i < p.size() && top_p < 1.0; ++i)
    if ((mass += p[i] / total) >= top_p) {
      keep = i + 1;
      break;
    }
  const double kept = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  std::map<int64_t, double> distribution;
  for (size_t i = 0; i < keep; ++i) distribution[ranked[i].second] = p[i] / kept;
  return distribution;
}

TEST(Sampling, GreedyIsTheFirstLargestLogit) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> logits = random_logits(rng, 50, 3.0);
    const int64_t best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    nn::SamplingOptions greedy;
    greedy.temperature = 0.0f;
    EXPECT_EQ(nn::sample_token(logits, greedy, uint64_t(trial)), best);
    nn::SamplingOptions top_one;
    top_one.temperature = 2.5f;
    top_one.top_k = 1;
    EXPECT_EQ(nn::sample_token(logits, top_one, uint64_t(trial)), best);
  }
  const std::vector<float> tied{1.0f, 3.0f, 3.0f, -2.0f};
  EXPECT_EQ(nn::sample_token(tied, nn::SamplingOptions{0.0f, 0, 1.0f, 0}, 0), 1);
}

TEST(Sampling, FrequenciesFollowTheRestrictedSoftmax) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  struct Case {
    float temperature;
    int64_t top_k;
    float top_p;
  };
  for (const Case& c : {Case{1.0f, 0, 1.0f}, Case{0.7f, 5, 1.0f}, Case{1.3f, 0, 0.8f}, Case{1.0f, 8, 0.6f}}) {
    SCOPED_TRACE("temperature " + std::to_string(c.temperature) + " top_k " + std::to_string(c.top_k) + " top_p " +
                 std::to_string(c.top_p));
    const std::vector<float> logits = random_logits(rng, 12, 1.0);
    const std::map<int64_t, double> expected = expected_distribution(logits, c.temperature, c.top_k, c.top_p);
    const nn::SamplingOptions options{c.temperature, c.top_k, c.top_p, rng()};
    const int draws = 40000;
    std::map<int64_t, int> counts;
    for (int n = 0; n < draws; ++n) ++counts[nn::sample_token(logits, options, uint64_t(n))];
    double chi_square = 0.0;
    for (const auto& [id, count] : counts) {
      ASSERT_TRUE(expected.count(id)) << "token " << id << " is outside the top-k/top-p set but was drawn";
      const double want = expected.at(id) * draws;
      chi_square += (count - want) * (count - want) / want;
    }
    for (const auto& [id, p] : expected)
      if (!counts.count(id)) chi_square += p * draws;
    // At most 11 degrees of freedom: P(chi2 > 45) < 1e-5.
    EXPECT_LT(chi_square, 45.0);
  }
}

TEST(Sampling, TheSameSeedAndDrawGiveTheSameTokenAndOtherSeedsDiffer) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const std::vector<float> logits = random_logits(rng, 100, 0.5);
  const uint64_t seed = rng();
  std::vector<int64_t> first, again, other;
  for (uint64_t n = 0; n < 64; ++n) {
    first.push_back(nn::sample_token(logits, nn::SamplingOptions{1.0f, 0, 1.0f, seed}, n));
    again.push_back(nn::sample_token(logits, nn::SamplingOptions{1.0f, 0, 1.0f, seed}, n));
    other.push_back(nn::sample_token(logits, nn::SamplingOptions{1.0f, 0, 1.0f, seed + 1}, n));
  }
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
}

TEST(Sampling, BadOptionsAreRefusedNamingTheFlag) {
  const std::vector<float> logits{0.0f, 1.0f};
  EXPECT_CONTAINS(error_of([&] {
                    nn::sample_token(logits, nn::SamplingOptions{-1.0f, 0, 1.0f, 0}, 0);
                  }),
                  "--temperature");
  EXPECT_CONTAINS(error_of([&] { nn::sample_token(logits, nn::SamplingOptions{1.0f, -3, 1.0f, 0}, 0); }), "--top-k");
  EXPECT_CONTAINS(error_of([&] { nn::sample_token(logits, nn::SamplingOptions{1.0f, 0, 0.0f, 0}, 0); }), "--top-p");
  EXPECT_CONTAINS(error_of([&] { nn::sample_token(logits, nn::SamplingOptions{1.0f, 0, 1.5f, 0}, 0); }), "--top-p");
  const std::vector<float> broken{0.0f, NAN};
  EXPECT_CONTAINS(error_of([&] { nn::sample_token(broken, nn::SamplingOptions{}, 0); }), "NaN");
}

}  // namespace
}  // namespace tessera::testing
