// shortest_text (core/number_text.h), what settings, checkpoint metadata and
// JSON numbers are written with: random floats and doubles of every magnitude
// read back bit for bit (strtof/strtod), in no more characters than printf's
// %.*g with the fewest significant digits that read back the same value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "core/number_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

float parse(const std::string& text, float) {
  return std::strtof(text.c_str(), nullptr);
}
double parse(const std::string& text, double) {
  return std::strtod(text.c_str(), nullptr);
}

template <typename Float>
bool same_bits(Float a, Float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// printf's %.*g with the fewest significant digits that read back as `value`.
template <typename Float>
std::string fewest_digits_text(Float value) {
  for (int digits = 1;; ++digits) {
    char text[64];
    std::snprintf(text, sizeof text, "%.*g", digits, double(value));
    if (same_bits(parse(text, Float{}), value)) return text;
  }
}

// `text` reads back as `value` and is no longer than printf's shortest form of it.
template <typename Float>
::testing::AssertionResult exact_and_short(const std::string& text, Float value) {
  if (!same_bits(parse(text, Float{}), value)) return ::testing::AssertionFailure() << text << " reads back otherwise";
  const std::string reference = fewest_digits_text(value);
  if (text.size() > reference.size()) return ::testing::AssertionFailure() << text << " is longer than " << reference;
  return ::testing::AssertionSuccess();
}

template <typename Float, typename Bits>
void check_random_values(int count) {
  auto rng = make_rng();
  std::uniform_int_distribution<Bits> bits;
  for (int i = 0; i < count; ++i) {
    const Bits pattern = bits(rng);
    Float value;
    std::memcpy(&value, &pattern, sizeof value);
    if (!std::isfinite(value)) continue;
    const std::string text = shortest_text(value);
    ASSERT_TRUE(exact_and_short(text, value));
  }
}

TEST(ShortestText, DoublesReadBackExactlyInTheShortestText) {
  TESSERA_SEED_TRACE();
  check_random_values<double, uint64_t>(20000);
  for (const double value : {0.0, -0.0, 0.1, 1e-5, 12.0, 3e-4, 1e16, 1e21, std::numeric_limits<double>::denorm_min(),
                             std::numeric_limits<double>::max()}) {
    const std::string text = shortest_text(value);
    EXPECT_TRUE(exact_and_short(text, value));
  }
}

// A float is written as a float: 0.1f is "0.1", not the 17 digits of the double nearest it.
TEST(ShortestText, FloatsReadBackExactlyInTheShortestText) {
  TESSERA_SEED_TRACE();
  check_random_values<float, uint32_t>(20000);
  for (const float value : {0.1f, 3e-4f, 0.9f, 1e-8f, std::numeric_limits<float>::max()}) {
    const std::string text = shortest_text(value);
    EXPECT_TRUE(exact_and_short(text, value));
    EXPECT_LT(text.size(), shortest_text(double(value)).size()) << text;
  }
}

TEST(ShortestText, NonFiniteValues) {
  EXPECT_EQ(shortest_text(std::numeric_limits<double>::quiet_NaN()), "nan");
  EXPECT_EQ(shortest_text(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(shortest_text(-std::numeric_limits<float>::infinity()), "-inf");
}

}  // namespace
}  // namespace tessera::testing
