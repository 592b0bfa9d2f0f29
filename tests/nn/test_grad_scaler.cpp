// nn::GradScaler: the dynamic loss-scale sequence (overflow → backoff and
// skip, growth after N consecutive finite steps, the floor), checked against
// a model of PyTorch's rules written here over a random outcome sequence;
// disabled scalers for bf16/f32; checkpoint state; invalid configs.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "nn/grad_scaler.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using nn::GradScaler;
using nn::GradScalerConfig;

TEST(GradScaler, DefaultsForF16) {
  GradScaler scaler = GradScaler::for_dtype(DType::f16);
  EXPECT_TRUE(scaler.enabled());
  EXPECT_EQ(scaler.scale(), 65536.0f);
  // 1999 finite steps: no growth; the 2000th doubles the scale.
  for (int i = 0; i < 1999; ++i) ASSERT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.growth_tracker(), 1999);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 131072.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // Overflow: skip, halve, and the run of finite steps starts again.
  for (int i = 0; i < 1500; ++i) ASSERT_FALSE(scaler.update(false));
  EXPECT_TRUE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  for (int i = 0; i < 1999; ++i) ASSERT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 65536.0f) << "growth must count finite steps since the last overflow";
}

TEST(GradScaler, MinScaleFloor) {
  GradScaler scaler = GradScaler::for_dtype(DType::f16);
  // 2^16 → 1 takes 16 overflows; more stay at 1 and still skip.
  for (int i = 1; i <= 16; ++i) {
    EXPECT_TRUE(scaler.update(true));
    EXPECT_EQ(scaler.scale(), std::ldexp(1.0f, 16 - i));
  }
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(scaler.update(true));
    EXPECT_EQ(scaler.scale(), 1.0f);
  }
}

TEST(GradScaler, RandomSequenceMatchesModel) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  GradScalerConfig config;
  config.init_scale = 1024.0f;
  config.growth_interval = 7;
  config.growth_factor = 4.0f;
  config.backoff_factor = 0.25f;
  config.min_scale = 2.0f;
  GradScaler scaler(config);
  double scale = 1024.0;  // the model
  int64_t good = 0;
  std::bernoulli_distribution overflow(0.15);
  for (int i = 0; i < 2000; ++i) {
    const bool bad = overflow(rng);
    const bool skip = scaler.update(bad);
    if (bad) {
      scale = std::max(scale * 0.25, 2.0);
      good = 0;
    } else if (++good == 7) {
      scale *= 4.0;
      good = 0;
    }
    ASSERT_EQ(skip, bad) << "step " << i;
    ASSERT_EQ(double(scaler.scale()), scale) << "step " << i;
    ASSERT_EQ(scaler.growth_tracker(), good) << "step " << i;
  }
}

TEST(GradScaler, NeverGrowsToInfinity) {
  GradScalerConfig config;
  config.init_scale = std::ldexp(1.0f, 126);
  config.growth_interval = 1;
  GradScaler scaler(config);
  for (int i = 0; i < 10; ++i) scaler.update(false);
  EXPECT_TRUE(std::isfinite(scaler.scale()));
  EXPECT_EQ(scaler.scale(), std::ldexp(1.0f, 127));
}

TEST(GradScaler, DisabledForBf16AndF32) {
  for (DType dtype : {DType::bf16, DType::f32}) {
    GradScaler scaler = GradScaler::for_dtype(dtype);
    EXPECT_FALSE(scaler.enabled()) << dtype_name(dtype);
    for (int i = 0; i < 3000; ++i) {
      ASSERT_FALSE(scaler.update(i % 3 == 0)) << dtype_name(dtype);
      ASSERT_EQ(scaler.scale(), 1.0f);
    }
    scaler.load_state(1024.0f, 5);  // an f16 checkpoint resumed in bf16/f32: ignored
    EXPECT_EQ(scaler.scale(), 1.0f);
  }
}

template <typename F>
void expect_error_naming(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(needle), std::string::npos) << "message: " << e.message();
  }
}

TEST(GradScaler, CheckpointStateAndValidation) {
  GradScaler scaler = GradScaler::for_dtype(DType::f16);
  scaler.load_state(512.0f, 1998);
  EXPECT_EQ(scaler.scale(), 512.0f);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  expect_error_naming([&] { scaler.load_state(0.5f, 0); }, "loss scale");
  expect_error_naming([&] { scaler.load_state(std::numeric_limits<float>::infinity(), 0); }, "loss scale");
  expect_error_naming([&] { scaler.load_state(8.0f, 2000); }, "growth tracker");

  const auto with = [](auto edit) {
    GradScalerConfig c;
    edit(c);
    return [c] { GradScaler s(c); };
  };
  expect_error_naming(with([](auto& c) { c.init_scale = 0.5f; }), "init_scale");
  expect_error_naming(with([](auto& c) { c.growth_factor = 1.0f; }), "growth_factor");
  expect_error_naming(with([](auto& c) { c.backoff_factor = 1.0f; }), "backoff_factor");
  expect_error_naming(with([](auto& c) { c.growth_interval = 0; }), "growth_interval");
  expect_error_naming(with([](auto& c) { c.min_scale = 0.0f; }), "min_scale");
}

}  // namespace
}  // namespace tessera::testing
