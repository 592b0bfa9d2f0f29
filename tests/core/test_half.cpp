// bf16 and f16 conversions against references computed differently:
// f16's portable bit manipulation (what GPUs and nvcc-compiled host code run)
// against the compiler's _Float16 (hardware IEEE conversion, what the rest of
// the host runs), bf16 against rounding done in double arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/half.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

uint16_t bits_of(_Float16 h) {
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// bf16 rounding by arithmetic: the two bf16 neighbours of x and the nearer one
// (ties to the even mantissa).
float bf16_round_reference(float x) {
  if (std::isnan(x) || std::isinf(x) || x == 0.0f) return x;
  const int exponent = std::max(std::ilogb(x), -126);  // subnormals share the smallest exponent
  const double ulp = std::ldexp(1.0, exponent - 7);    // 8 significant bits
  const double down = std::floor(double(x) / ulp) * ulp, up = down + ulp;
  const double dx = double(x) - down, ux = up - double(x);
  if (dx < ux) return float(down);
  if (ux < dx) return float(up);
  const bool down_even = std::fmod(std::abs(down / ulp), 2.0) == 0.0;
  return float(down_even ? down : up);
}

TEST(Half, F16MatchesCompilerConversionOnRandomAndEdgeValues) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               65504.0f,
                               65519.99f,
                               65520.0f,
                               1e10f,
                               -1e10f,
                               5.96e-8f,
                               2.98e-8f,
                               2.99e-8f,
                               6.1e-5f,
                               6.103515625e-05f,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min()};
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = bits(rng);
    float f;
    std::memcpy(&f, &b, 4);
    if (!std::isnan(f)) values.push_back(f);
    values.push_back(std::ldexp(float(bits(rng) % 2048), int(bits(rng) % 40) - 35));  // dense near f16's range
  }
  size_t mismatches = 0;
  for (float v : values) {
    const uint16_t ours = f16::from_float_bits_portable(v), theirs = bits_of(static_cast<_Float16>(v));
    if (ours != theirs && ++mismatches < 5) ADD_FAILURE() << "f16(" << v << ") = " << ours << ", expected " << theirs;
    if (f16(v).bits != theirs && ++mismatches < 5) ADD_FAILURE() << "f16 constructor differs for " << v;
    const float back = f16::to_float_value_portable(ours);
    if (back != float(static_cast<_Float16>(v)) && ++mismatches < 5)
      ADD_FAILURE() << "f16 -> float of " << ours << " gave " << back;
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_TRUE(std::isnan(float(f16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Half, Bf16RoundsToNearestEven) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = bits(rng);
    float f;
    std::memcpy(&f, &b, 4);
    if (std::isnan(f) || std::abs(f) > 3.0e38f) continue;
    const float ours = float(bf16(f)), expected = bf16_round_reference(f);
    ASSERT_EQ(ours, expected) << "bf16(" << f << ")";
  }
  EXPECT_TRUE(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float(bf16(1.0f + 1.0f / 256.0f)), 1.0f);               // tie: down to even
  EXPECT_EQ(float(bf16(1.0f + 3.0f / 256.0f)), 1.0f + 4.0f / 256);  // tie: up to even
}

}  // namespace
}  // namespace tessera::testing
