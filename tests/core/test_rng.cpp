// Philox4x32-10 against the published known-answer vectors (Random123's
// kat_vectors), and the properties the framework relies on: order
// independence, sharded draws equal to whole draws, sane distributions.
#include <gtest/gtest.h>

#include <cmath>

#include "core/context.h"
#include "core/rng.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

TEST(Philox, KnownAnswerVectors) {
  const PhiloxOutput zero = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  const uint32_t f = 0xffffffffu;
  const PhiloxOutput ones = philox4x32_10(f, f, f, f, f, f);
  EXPECT_EQ(ones.v[0], 0x408f276du);
  EXPECT_EQ(ones.v[1], 0x41c83b0eu);
  EXPECT_EQ(ones.v[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.v[3], 0x6d5451fdu);
  const PhiloxOutput pi = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(pi.v[0], 0xd16cfe09u);
  EXPECT_EQ(pi.v[1], 0x94fdccebu);
  EXPECT_EQ(pi.v[2], 0x5001e420u);
  EXPECT_EQ(pi.v[3], 0x24126ea1u);
}

TEST(Philox, ShardedDrawEqualsWholeDraw) {
  TESSERA_SEED_TRACE();
  Context ctx;
  const uint64_t seed = test_seed();
  Tensor whole = ctx.empty(Shape{10, 77}, DType::f32);
  whole.normal_at_(seed, 3, 1000, 0.0f, 1.0f);
  // Draw rows 4..7 alone, as a shard holding that slice would.
  Tensor part = ctx.empty(Shape{3, 77}, DType::f32);
  part.normal_at_(seed, 3, 1000 + 4 * 77, 0.0f, 1.0f);
  EXPECT_EQ(part.to_vector<float>(), whole.slice(4, 7).to_vector<float>());
}

TEST(Philox, GeneratorAdvancesAndReplays) {
  Context ctx;
  Generator a{1234, 0};
  Tensor x = ctx.empty(Shape{100}, DType::f32), y = ctx.empty(Shape{100}, DType::f32);
  x.uniform_(a, -1, 1);
  y.uniform_(a, -1, 1);
  EXPECT_EQ(a.offset, 200u);
  EXPECT_NE(x.to_vector<float>(), y.to_vector<float>());
  Generator replay{1234, 100};
  Tensor z = ctx.empty(Shape{100}, DType::f32);
  z.uniform_(replay, -1, 1);
  EXPECT_EQ(z.to_vector<float>(), y.to_vector<float>());
}

TEST(Philox, DistributionsHaveTheRightMoments) {
  TESSERA_SEED_TRACE();
  Context ctx;
  const int64_t n = 1 << 20;
  Tensor u = ctx.empty(Shape{n}, DType::f32), g = ctx.empty(Shape{n}, DType::f32);
  u.uniform_at_(test_seed(), 0, 0, 2.0f, 5.0f);
  g.normal_at_(test_seed(), 1, 0, 1.0f, 3.0f);
  double su = 0, su2 = 0, sg = 0, sg2 = 0;
  double lo = 1e9, hi = -1e9;
  for (float v : u.to_vector<float>())
    su += v, su2 += v * v, lo = std::min(lo, double(v)), hi = std::max(hi, double(v));
  for (float v : g.to_vector<float>()) sg += v, sg2 += v * v;
  const double mu = su / n, vu = su2 / n - mu * mu, mg = sg / n, vg = sg2 / n - mg * mg;
  // Standard errors: uniform mean 0.87/sqrt(n) ≈ 8.5e-4, normal mean 3/sqrt(n) ≈ 3e-3; allow ~6 sigma.
  EXPECT_NEAR(mu, 3.5, 6e-3);
  EXPECT_NEAR(vu, 0.75, 1e-2);
  EXPECT_GE(lo, 2.0);
  EXPECT_LT(hi, 5.0);
  EXPECT_NEAR(mg, 1.0, 2e-2);
  EXPECT_NEAR(vg, 9.0, 0.1);
}

// How far a GPU normal draw may be from the CPU's. The bits (Philox) are
// identical; Box-Muller's sqrtf(-2 logf(u1)) cosf(2 pi u2) is not: CUDA's
// logf is within 1 ulp and cosf within 2 ulp (CUDA C Programming Guide,
// "Mathematical Functions"), glibc's within 1 ulp, so the f32 product can
// differ by about 5 ulp (3e-7 relative); mean + stddev·z then cancels near
// zero, so the bound is absolute there (stddev 2 × 3e-7 < 1e-6). In bf16 and
// f16 that f32 difference can straddle a rounding boundary and move the
// stored value by one unit in the last place of the 16-bit type: 2^-7
// relative for bf16 (8 significant bits), 2^-10 for f16 (11), plus f16's
// subnormal spacing 2^-24 in absolute.
Tolerance normal_draw_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return {0x1p-7, 1e-6};
    case DType::f16:
      return {0x1p-10, 1e-6};
    default:
      return {1e-6, 1e-6};
  }
}

TEST(Philox, GpuMatchesCpu) {
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    Tensor c = ctx.empty(Shape{1001}, dtype), g = ctx.empty(Shape{1001}, dtype, Device::cuda(0));
    c.normal_at_(99, 5, 123, 0.5f, 2.0f);
    g.normal_at_(99, 5, 123, 0.5f, 2.0f);
    EXPECT_TRUE(all_close(g, c, normal_draw_tolerance(dtype))) << dtype_name(dtype);
    c.uniform_at_(7, 0, 0, -1.0f, 1.0f);
    g.uniform_at_(7, 0, 0, -1.0f, 1.0f);
    EXPECT_EQ(g.to_doubles(), c.to_doubles()) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace tessera::testing
