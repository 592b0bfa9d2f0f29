// nn::LrSchedule: warm-up, cosine decay and constant styles at the key steps
// (first, end of warm-up, middle, end, after the end) and at random steps,
// against the formula written here in double; validation names the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>

#include "nn/lr_schedule.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using nn::LrScheduleConfig;
using nn::LrStyle;

// Megatron-LM's rule, written independently of the library.
double reference_lr(const LrScheduleConfig& c, int64_t s) {
  if (s < c.warmup_steps) return c.lr * double(s + 1) / double(c.warmup_steps);
  if (c.style == LrStyle::constant) return c.lr;
  if (s > c.total_steps) return c.min_lr;
  const double decay_steps = double(c.total_steps - c.warmup_steps);
  const double ratio = decay_steps > 0 ? double(s - c.warmup_steps) / decay_steps : 1.0;
  const double coeff = 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0);
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

LrScheduleConfig random_config(std::mt19937_64& rng, LrStyle style) {
  LrScheduleConfig c;
  c.style = style;
  c.lr = std::uniform_real_distribution<double>(1e-4, 1e-2)(rng);
  c.min_lr = c.lr * std::uniform_real_distribution<double>(0.0, 0.5)(rng);
  c.warmup_steps = std::uniform_int_distribution<int64_t>(1, 200)(rng);
  c.total_steps = c.warmup_steps + std::uniform_int_distribution<int64_t>(1, 5000)(rng);
  return c;
}

constexpr double kRel = 1e-12;

TEST(LrSchedule, CosineKeySteps) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const LrScheduleConfig c = random_config(rng, LrStyle::cosine);
  const nn::LrSchedule schedule(c);
  const int64_t w = c.warmup_steps, t = c.total_steps;
  EXPECT_NEAR(schedule.lr(0), c.lr / double(w), kRel * c.lr);  // first step: lr/warmup, not 0
  EXPECT_NEAR(schedule.lr(w - 1), c.lr, kRel * c.lr);          // last warm-up step: the peak
  EXPECT_NEAR(schedule.lr(w), c.lr, kRel * c.lr);              // decay starts at the peak
  EXPECT_NEAR(schedule.lr(t), c.min_lr, kRel * c.lr);          // reaches min_lr at total
  EXPECT_NEAR(schedule.lr(t + 1), c.min_lr, kRel * c.lr);      // and stays there
  EXPECT_NEAR(schedule.lr(10 * t), c.min_lr, kRel * c.lr);
  if ((t - w) % 2 == 0) {  // half-way: the mean
    EXPECT_NEAR(schedule.lr(w + (t - w) / 2), 0.5 * (c.lr + c.min_lr), kRel * c.lr);
  }
  // Warm-up is linear, decay is monotone.
  for (int64_t s = 1; s < w; ++s) EXPECT_NEAR(schedule.lr(s) - schedule.lr(s - 1), c.lr / double(w), kRel * c.lr);
  for (int64_t s = w + 1; s <= t; ++s) ASSERT_LE(schedule.lr(s), schedule.lr(s - 1)) << s;
  for (int i = 0; i < 200; ++i) {
    const int64_t s = std::uniform_int_distribution<int64_t>(0, 2 * t)(rng);
    EXPECT_NEAR(schedule.lr(s), reference_lr(c, s), kRel * c.lr) << "step " << s;
  }
}

TEST(LrSchedule, ConstantStyle) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const LrScheduleConfig c = random_config(rng, LrStyle::constant);
  const nn::LrSchedule schedule(c);
  for (int64_t s = 0; s < c.warmup_steps; ++s) EXPECT_NEAR(schedule.lr(s), reference_lr(c, s), kRel * c.lr);
  EXPECT_EQ(schedule.lr(c.warmup_steps), c.lr);
  EXPECT_EQ(schedule.lr(c.total_steps + 100), c.lr);  // no decay
  // No warm-up at all: the peak from step 0.
  LrScheduleConfig flat = c;
  flat.warmup_steps = 0;
  EXPECT_EQ(nn::LrSchedule(flat).lr(0), c.lr);
}

TEST(LrSchedule, EdgeCases) {
  LrScheduleConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 0;
  c.total_steps = 4;
  const nn::LrSchedule no_warmup(c);
  for (int64_t s = 0; s <= 6; ++s) EXPECT_NEAR(no_warmup.lr(s), reference_lr(c, s), 1e-15) << s;
  EXPECT_EQ(no_warmup.lr(0), 1.0);
  c.warmup_steps = 4;  // warm-up over the whole run: min_lr right after
  const nn::LrSchedule all_warmup(c);
  EXPECT_EQ(all_warmup.lr(3), 1.0);
  EXPECT_EQ(all_warmup.lr(4), 0.1);
  c.min_lr = c.lr;  // min_lr == lr: flat after warm-up
  EXPECT_EQ(nn::LrSchedule(c).lr(2), 0.75);
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

TEST(LrSchedule, InvalidConfigNamesTheFlag) {
  LrScheduleConfig good;
  good.lr = 1e-3;
  good.min_lr = 1e-5;
  good.warmup_steps = 10;
  good.total_steps = 100;
  EXPECT_NO_THROW(nn::LrSchedule{good});
  const auto with = [&](auto edit) {
    LrScheduleConfig c = good;
    edit(c);
    return [c] { nn::LrSchedule schedule(c); };
  };
  expect_error_naming(with([](auto& c) { c.lr = 0; }), "--lr");
  expect_error_naming(with([](auto& c) { c.lr = std::nan(""); }), "--lr");
  expect_error_naming(with([](auto& c) { c.min_lr = 2e-3; }), "--min-lr");
  expect_error_naming(with([](auto& c) { c.min_lr = -1e-3; }), "--min-lr");
  expect_error_naming(with([](auto& c) { c.warmup_steps = -1; }), "--warmup-steps");
  expect_error_naming(with([](auto& c) { c.warmup_steps = 101; }), "--warmup-steps");
  expect_error_naming(with([](auto& c) { c.total_steps = 0; }), "--train-steps");
  expect_error_naming([] { nn::parse_lr_style("linear"); }, "--lr-decay-style");
  EXPECT_EQ(nn::parse_lr_style("cosine"), LrStyle::cosine);
  EXPECT_EQ(nn::parse_lr_style("constant"), LrStyle::constant);
  expect_error_naming([&] { nn::LrSchedule(good).lr(-1); }, "step");
}

}  // namespace
}  // namespace tessera::testing
