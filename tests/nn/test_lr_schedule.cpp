// nn::LrSchedule against Megatron-LM's OptimizerParamScheduler.get_lr(),
// transcribed here in its own units (samples): every update of the warm-up
// and the steps around its end, for each decay style, bit for bit with one
// sample per step and to double rounding with a random global batch; the
// key steps of the cosine decay; validation names the flag.
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

// megatron/core/optimizer_param_scheduler.py, get_lr(), as Megatron builds it
// for iteration-based training (megatron/training/training.py,
// get_optimizer_param_scheduler): the schedule counts samples, num_steps =
// successful updates × global batch, lr_warmup_steps = --lr-warmup-iters ×
// global batch, lr_decay_steps = --lr-decay-iters (= --train-iters) × global
// batch, init_lr = --lr-warmup-init = 0.
double megatron_lr(const LrScheduleConfig& c, int64_t updates, int64_t global_batch) {
  const double init_lr = 0.0, max_lr = c.lr, min_lr = c.min_lr;
  const int64_t num_steps = updates * global_batch;
  const int64_t lr_warmup_steps = c.warmup_steps * global_batch;
  const int64_t lr_decay_steps = c.total_steps * global_batch;
  if (lr_warmup_steps > 0 && num_steps <= lr_warmup_steps)
    return init_lr + ((max_lr - init_lr) * double(num_steps) / double(lr_warmup_steps));
  if (c.style == LrStyle::constant) return max_lr;
  if (num_steps > lr_decay_steps) return min_lr;
  const double decay_ratio = double(num_steps - lr_warmup_steps) / double(lr_decay_steps - lr_warmup_steps);
  const double delta_lr = max_lr - min_lr;
  const double coeff = 0.5 * (std::cos(std::numbers::pi * decay_ratio) + 1.0);
  return min_lr + coeff * delta_lr;
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

// Megatron in samples with a global batch other than one: the same ratios, up
// to the rounding of lr·n (a few units in the last place of a double).
constexpr double kRel = 1e-15;

// The first update has learning rate 0, update `warmup` the peak, and the
// decay starts after it: update n reads the schedule at n, as Megatron's
// first iteration reads it at num_steps 0.
TEST(LrSchedule, WarmUpAndItsEndMatchMegatron) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  for (const LrStyle style : {LrStyle::constant, LrStyle::cosine}) {
    SCOPED_TRACE(nn::lr_style_name(style));
    const LrScheduleConfig c = random_config(rng, style);
    const nn::LrSchedule schedule(c);
    const int64_t w = c.warmup_steps;
    for (int64_t n = 0; n <= w + 2; ++n) EXPECT_EQ(schedule.lr(n), megatron_lr(c, n, 1)) << "update " << n;
    EXPECT_EQ(schedule.lr(0), 0.0);  // Megatron's first update: --lr-warmup-init, 0
    EXPECT_EQ(schedule.lr(1), c.lr / double(w));
    // The peak at the end of the warm-up, not one update earlier: lr·w/w, as
    // Megatron computes it, is lr to the last place or one unit off it.
    EXPECT_DOUBLE_EQ(schedule.lr(w), c.lr);
    EXPECT_LT(schedule.lr(w - 1), c.lr);
    if (style == LrStyle::cosine && w + 1 < c.total_steps) {
      EXPECT_LT(schedule.lr(w + 1), c.lr);
    } else if (style == LrStyle::constant) {
      EXPECT_EQ(schedule.lr(w + 1), c.lr);
    }
    const int64_t global_batch = std::uniform_int_distribution<int64_t>(2, 1024)(rng);
    for (int64_t n = 0; n <= w + 2; ++n)
      EXPECT_NEAR(schedule.lr(n), megatron_lr(c, n, global_batch), kRel * c.lr) << "update " << n;
  }
}

TEST(LrSchedule, CosineKeySteps) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const LrScheduleConfig c = random_config(rng, LrStyle::cosine);
  const nn::LrSchedule schedule(c);
  const int64_t w = c.warmup_steps, t = c.total_steps;
  EXPECT_EQ(schedule.lr(t), c.min_lr);      // reaches min_lr at total
  EXPECT_EQ(schedule.lr(t + 1), c.min_lr);  // and stays there
  EXPECT_EQ(schedule.lr(10 * t), c.min_lr);
  if ((t - w) % 2 == 0) {  // half-way: the mean
    EXPECT_NEAR(schedule.lr(w + (t - w) / 2), 0.5 * (c.lr + c.min_lr), 1e-12 * c.lr);
  }
  // Warm-up is linear, decay is monotone.
  for (int64_t s = 1; s <= w; ++s) EXPECT_NEAR(schedule.lr(s) - schedule.lr(s - 1), c.lr / double(w), 1e-12 * c.lr);
  for (int64_t s = w + 1; s <= t; ++s) ASSERT_LE(schedule.lr(s), schedule.lr(s - 1)) << s;
  const int64_t global_batch = std::uniform_int_distribution<int64_t>(1, 1024)(rng);
  for (int i = 0; i < 200; ++i) {
    const int64_t s = std::uniform_int_distribution<int64_t>(0, 2 * t)(rng);
    EXPECT_NEAR(schedule.lr(s), megatron_lr(c, s, global_batch), kRel * c.lr) << "update " << s;
    EXPECT_EQ(schedule.lr(s), megatron_lr(c, s, 1)) << "update " << s;
  }
}

TEST(LrSchedule, ConstantStyle) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const LrScheduleConfig c = random_config(rng, LrStyle::constant);
  const nn::LrSchedule schedule(c);
  for (int64_t s = 0; s <= c.warmup_steps; ++s) EXPECT_EQ(schedule.lr(s), megatron_lr(c, s, 1));
  EXPECT_DOUBLE_EQ(schedule.lr(c.warmup_steps), c.lr);  // lr·w/w, as Megatron computes it
  EXPECT_EQ(schedule.lr(c.total_steps + 100), c.lr);  // no decay
  // No warm-up at all: the peak from the first update.
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
  for (int64_t s = 0; s <= 6; ++s) EXPECT_EQ(no_warmup.lr(s), megatron_lr(c, s, 1)) << s;
  EXPECT_EQ(no_warmup.lr(0), 1.0);
  c.warmup_steps = 4;  // warm-up over the whole run: the peak at its end, min_lr after
  const nn::LrSchedule all_warmup(c);
  EXPECT_EQ(all_warmup.lr(3), 0.75);
  EXPECT_EQ(all_warmup.lr(4), 1.0);
  EXPECT_EQ(all_warmup.lr(5), 0.1);
  c.min_lr = c.lr;  // min_lr == lr: flat after warm-up
  c.warmup_steps = 2;
  EXPECT_EQ(nn::LrSchedule(c).lr(1), 0.5);
  EXPECT_EQ(nn::LrSchedule(c).lr(3), 1.0);
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
  expect_error_naming([&] { nn::LrSchedule(good).lr(-1); }, "updates");
}

}  // namespace
}  // namespace tessera::testing
