// LrSchedule: the learning rate as a function of the 0-based step, like
// Megatron-LM's: linear warm-up from 0 to the peak over `warmup_steps`
// (lr(s) = lr·(s+1)/warmup for s < warmup), then either constant or a cosine
// decay reaching min_lr at `total_steps`, and min_lr after that.
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
  int64_t warmup_steps = 0;  // --warmup-steps
  int64_t total_steps = 0;   // cosine: the step at which min_lr is reached (--train-steps)
};

// Throws tessera::Error naming the flag (--lr, --min-lr, --warmup-steps, --train-steps) and the value.
void validate(const LrScheduleConfig& config);

class LrSchedule {
 public:
  explicit LrSchedule(const LrScheduleConfig& config);  // validates

  // The learning rate of 0-based step `step` (≥ 0):
  //   s < warmup:                 lr·(s+1)/warmup
  //   constant, s ≥ warmup:       lr
  //   cosine, warmup ≤ s < total: min_lr + (lr − min_lr)·½(1 + cos(π·(s − warmup)/(total − warmup)))
  //   cosine, s ≥ total:          min_lr
  double lr(int64_t step) const;

  const LrScheduleConfig& config() const { return config_; }

 private:
  LrScheduleConfig config_;
};

}  // namespace tessera::nn
