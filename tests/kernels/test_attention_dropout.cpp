// The mask of dropout on the attention probabilities
// (attention_dropout_multiplier, kernels/functors/attention.h), which the
// attention kernels draw on the spot and the kernel tests' reference takes
// from here: it keeps 1 − p of the probabilities, multiplies the kept ones by
// exactly 1/(1 − p), and its draws are independent across keys (within one
// Philox call and across calls), queries, heads, sequences, seeds and
// offsets; a head_offset or an offset renumbers heads or sequences and
// nothing else (what lets tensor-parallel ranks draw the whole model's mask).
// The statistical checks allow five standard deviations of the binomial count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "kernels/functors/attention.h"
#include "kernels/ops.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

constexpr int64_t kBatch = 2, kHeads = 4, kQueries = 96, kKeys = 96;  // 73728 draws

bool kept(const ops::AttentionDropout& d, int64_t b, int64_t h, int64_t t, int64_t s) {
  return attention_dropout_multiplier(d, b, h, t, s) != 0.0f;
}

// The fraction of (b, h, t, s) over the whole grid for which `event` holds, and
// five standard deviations of it when each holds with probability `chance`.
struct Fraction {
  double value, tolerance;
};
Fraction fraction(const std::function<bool(int64_t, int64_t, int64_t, int64_t)>& event, double chance) {
  int64_t count = 0, total = 0;
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t t = 0; t < kQueries; ++t)
        for (int64_t s = 0; s < kKeys; ++s, ++total) count += event(b, h, t, s);
  return Fraction{double(count) / double(total), 5.0 * std::sqrt(chance * (1.0 - chance) / double(total))};
}

TEST(AttentionDropoutMask, KeepsOneMinusPAndScalesTheKeptByOneOverOneMinusP) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  for (const float p : {0.1f, 0.5f, 0.9f}) {
    SCOPED_TRACE("p=" + std::to_string(p));
    const ops::AttentionDropout d{p, rng(), 0, 0};
    const Fraction rate =
        fraction([&](int64_t b, int64_t h, int64_t t, int64_t s) { return kept(d, b, h, t, s); }, 1.0 - p);
    EXPECT_NEAR(rate.value, 1.0 - p, rate.tolerance);
    for (int64_t s = 0; s < 16; ++s) {
      const float m = attention_dropout_multiplier(d, 1, 2, 20, s);
      EXPECT_TRUE(m == 0.0f || m == 1.0f / (1.0f - p)) << m;
    }
  }
  // p = 0 keeps everything with multiplier 1.
  const ops::AttentionDropout none{0.0f, rng(), 0, 0};
  for (int64_t s = 0; s < 64; ++s) EXPECT_EQ(attention_dropout_multiplier(none, 0, 1, 70, s), 1.0f);
}

// Two masks agree on a draw with probability p² + (1 − p)² when independent
// (1/2 at p = 1/2), and always when they are the same mask.
TEST(AttentionDropoutMask, IndependentAcrossKeysQueriesHeadsSequencesSeedsAndOffsets) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const ops::AttentionDropout d{0.5f, rng(), 0, 0};
  ops::AttentionDropout other_seed = d, other_offset = d, other_head_offset = d;
  other_seed.seed ^= 0x9e3779b97f4a7c15ull;
  other_offset.offset = 7;
  other_head_offset.head_offset = 5;
  using Key = std::function<bool(int64_t, int64_t, int64_t, int64_t)>;
  const std::vector<std::pair<std::string, Key>> others = {
      {"the next key (same Philox call or the next)",
       [&](auto b, auto h, auto t, auto s) { return kept(d, b, h, t, s + 1); }},
      {"the key four on (the next Philox call)",
       [&](auto b, auto h, auto t, auto s) { return kept(d, b, h, t, s + 4); }},
      {"the next query", [&](auto b, auto h, auto t, auto s) { return kept(d, b, h, t + 1, s); }},
      {"the next head", [&](auto b, auto h, auto t, auto s) { return kept(d, b, h + 1, t, s); }},
      {"the next sequence", [&](auto b, auto h, auto t, auto s) { return kept(d, b + 1, h, t, s); }},
      {"another seed", [&](auto b, auto h, auto t, auto s) { return kept(other_seed, b, h, t, s); }},
      {"another offset", [&](auto b, auto h, auto t, auto s) { return kept(other_offset, b, h, t, s); }},
      {"another head offset", [&](auto b, auto h, auto t, auto s) { return kept(other_head_offset, b, h, t, s); }},
  };
  for (const auto& [what, other] : others) {
    SCOPED_TRACE(what);
    const Fraction agree = fraction(
        [&](int64_t b, int64_t h, int64_t t, int64_t s) { return kept(d, b, h, t, s) == other(b, h, t, s); }, 0.5);
    EXPECT_NEAR(agree.value, 0.5, agree.tolerance);
  }
}

// head_offset renumbers heads and offset sequences, nothing else: the rank
// holding heads from k draws for its head h what the whole model draws for k + h.
TEST(AttentionDropoutMask, HeadAndBatchOffsetsRenumberHeadsAndSequences) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const ops::AttentionDropout whole{0.3f, rng(), 0, 0};
  ops::AttentionDropout rank = whole;
  rank.head_offset = 6;
  rank.offset = 3;
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t t = 0; t < 40; ++t)
        for (int64_t s = 0; s <= t; ++s)
          ASSERT_EQ(attention_dropout_multiplier(rank, b, h, t, s),
                    attention_dropout_multiplier(whole, b + 3, h + 6, t, s))
              << "b " << b << " h " << h << " t " << t << " s " << s;
}

}  // namespace
}  // namespace tessera::testing
