// LrSchedule: the learning rate as Megatron-LM's OptimizerParamScheduler gives
// it, read at the number of successful optimizer updates made so far (a step
// skipped for non-finite gradients does not count, as in Megatron, whose
// scheduler steps only when the update succeeded): linear warm-up from 0 to
// the peak over `warmup_steps` (update n uses lr·n/warmup while n ≤ warmup, so
// the first update, n = 0, has learning rate 0 and update `warmup` the peak),
// then either constant or a cosine decay reaching min_lr at `total_steps`, and
// min_lr after that.
#pragma once

#include <cstdint>
#include <string>

namespace tessera::nn {

enum class LrStyle { constant, cosine };

// Parses "constant" / "cosine" (the --lr-decay-style flag); throws naming the flag otherwise.
LrStyle parse_lr_style(const std::string& name);
const char* lr_style_name(LrStyle style);

struct LrScheduleConfig {
  LrStyle style = LrStyle::cosine;
  double lr = 1e-3;          // peak, reached at the end of warm-up (--lr)
  double min_lr = 0.0;       // cosine: the final value (--min-lr)
  int64_t warmup_steps = 0;  // --warmup-steps (Megatron's --lr-warmup-iters; the warm-up starts at 0)
  int64_t total_steps = 0;   // cosine: the step at which min_lr is reached (--train-steps: Megatron's --lr-decay-iters)
};

// Throws tessera::Error naming the flag (--lr, --min-lr, --warmup-steps, --train-steps) and the value.
void validate(const LrScheduleConfig& config);

class LrSchedule {
 public:
  explicit LrSchedule(const LrScheduleConfig& config);  // validates

  // The learning rate of the update made after `updates` (≥ 0) successful
  // ones: Megatron's get_lr() at num_steps = updates × global batch (Megatron
  // counts samples; with a fixed global batch the ratios are the same), with
  // its default --lr-warmup-init 0, in its order of operations:
  //   warmup > 0, n ≤ warmup:     lr·n/warmup
  //   constant:                   lr
  //   n > total:                  min_lr
  //   cosine:                     min_lr + ½(cos(π·(n − warmup)/(total − warmup)) + 1)·(lr − min_lr)
  double lr(int64_t updates) const;

  const LrScheduleConfig& config() const { return config_; }

 private:
  LrScheduleConfig config_;
};

}  // namespace tessera::nn
