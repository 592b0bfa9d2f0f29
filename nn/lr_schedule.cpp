// LrSchedule: linear warm-up from 0, then constant or cosine decay to min_lr,
// Megatron-LM's OptimizerParamScheduler.get_lr() step for step.
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

double LrSchedule::lr(int64_t updates) const {
  TESSERA_CHECK(updates >= 0, "lr schedule: the number of updates must be >= 0, got ", updates);
  const LrScheduleConfig& c = config_;
  if (c.warmup_steps > 0 && updates <= c.warmup_steps) return c.lr * double(updates) / double(c.warmup_steps);
  if (c.style == LrStyle::constant) return c.lr;
  if (updates > c.total_steps) return c.min_lr;
  const double decay_ratio = double(updates - c.warmup_steps) / double(c.total_steps - c.warmup_steps);
  const double coeff = 0.5 * (std::cos(std::numbers::pi * decay_ratio) + 1.0);
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

}  // namespace tessera::nn
