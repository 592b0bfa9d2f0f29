// sample_token (nn/sampling.h): greedy, or temperature → top-k → top-p → one
// uniform draw over the kept tokens' probabilities (double precision, the
// kept tokens in order of decreasing probability, ties by token id).
#include "nn/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace tessera::nn {
namespace {

constexpr uint64_t kSamplingStream = 0x5a3d'1e00'0000'0001ull;  // a Philox stream no initialiser or dropout uses

// Uniform in [0, 1) with 53 random bits.
double uniform_draw(uint64_t seed, uint64_t draw) {
  const PhiloxOutput bits = philox_bits(seed, kSamplingStream, draw);
  const uint64_t word = (uint64_t(bits.v[0]) << 32) | bits.v[1];
  return double(word >> 11) * 0x1.0p-53;
}

int64_t greedy(std::span<const float> logits) {
  return std::max_element(logits.begin(), logits.end()) - logits.begin();  // the first largest
}

// Token ids by decreasing logit (ties: the smaller id first), the first `keep` of them.
std::vector<int64_t> most_likely(std::span<const float> logits, int64_t keep) {
  std::vector<int64_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), int64_t{0});
  const auto more_likely = [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), more_likely);
  ids.resize(size_t(keep));
  return ids;
}

}  // namespace

void SamplingOptions::validate() const {
  TESSERA_CHECK(std::isfinite(temperature) && temperature >= 0.0f, "--temperature must be 0 (greedy) or positive, got ",
                temperature);
  TESSERA_CHECK(top_k >= 0, "--top-k must be 0 (every token) or positive, got ", top_k);
  TESSERA_CHECK(top_p > 0.0f && top_p <= 1.0f, "--top-p must be in (0, 1], got ", top_p);
}

int64_t sample_token(std::span<const float> logits, const SamplingOptions& options, uint64_t draw) {
  options.validate();
  TESSERA_CHECK(!logits.empty(), "sample_token: no logits");
  for (size_t i = 0; i < logits.size(); ++i)
    TESSERA_CHECK(!std::isnan(logits[i]), "sample_token: the logit of token ", i,
                  " is NaN; the model's weights are broken (check the checkpoint)");
  if (options.temperature == 0.0f) return greedy(logits);

  const int64_t vocab = int64_t(logits.size());
  const int64_t keep = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
  const std::vector<int64_t> ids = most_likely(logits, keep);
  std::vector<double> weights(ids.size());
  const double top = logits[size_t(ids[0])];
  for (size_t i = 0; i < ids.size(); ++i)
    weights[i] = std::exp((double(logits[size_t(ids[i])]) - top) / double(options.temperature));
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);

  // Nucleus: the fewest most likely tokens whose probability reaches top_p.
  size_t kept = weights.size();
  if (options.top_p < 1.0f) {
    double mass = 0.0;
    for (size_t i = 0; i < weights.size(); ++i) {
      mass += weights[i] / total;
      if (mass >= double(options.top_p)) {
        kept = i + 1;
        break;
      }
    }
  }
  const double kept_total = std::accumulate(weights.begin(), weights.begin() + kept, 0.0);
  const double target = uniform_draw(options.seed, draw) * kept_total;
  double cumulative = 0.0;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += weights[i];
    if (target < cumulative) return ids[i];
  }
  return ids[kept - 1];  // rounding at the very end of the range
}

}  // namespace tessera::nn
