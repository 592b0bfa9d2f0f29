// LrSchedule: linear warm-up, then constant or cosine decay to min_lr (Megatron-LM's rules).
#include "nn/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace tessera::nn {

LrStyle parse_lr_style(const std::string& name) {
  if (name == "constant") return LrStyle::constant;
  if (name == "cosine") return LrStyle::cosine;
  TESSERA_THROW("--lr-decay-style: unknown schedule '", name, "'; use 'constant' or 'cosine'");
}

const char* lr_style_name(LrStyle style) {
  return style == LrStyle::constant ? "constant" : "cosine";
}

void validate(const LrScheduleConfig& c) {
  TESSERA_CHECK(std::isfinite(c.lr) && c.lr > 0.0, "--lr must be a finite number > 0, got ", c.lr);
  TESSERA_CHECK(c.warmup_steps >= 0, "--warmup-steps must be >= 0, got ", c.warmup_steps);
  if (c.style == LrStyle::cosine) {
    TESSERA_CHECK(std::isfinite(c.min_lr) && c.min_lr >= 0.0 && c.min_lr <= c.lr,
                  "--min-lr must be in [0, --lr = ", c.lr, "], got ", c.min_lr);
    TESSERA_CHECK(c.total_steps > 0, "--train-steps must be > 0 for the cosine schedule, got ", c.total_steps);
    TESSERA_CHECK(c.warmup_steps <= c.total_steps, "--warmup-steps (", c.warmup_steps,
                  ") must not exceed --train-steps (", c.total_steps, ")");
  }
}

LrSchedule::LrSchedule(const LrScheduleConfig& config) : config_(config) {
  validate(config_);
}

double LrSchedule::lr(int64_t step) const {
  TESSERA_CHECK(step >= 0, "lr schedule: the step must be >= 0, got ", step);
  const LrScheduleConfig& c = config_;
  if (step < c.warmup_steps) return c.lr * double(step + 1) / double(c.warmup_steps);
  if (c.style == LrStyle::constant) return c.lr;
  if (step >= c.total_steps) return c.min_lr;
  const double progress = double(step - c.warmup_steps) / double(c.total_steps - c.warmup_steps);
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace tessera::nn
