// GradScaler: dynamic loss scaling for f16 training, with PyTorch's rules
// (torch.amp.GradScaler): the loss is multiplied by scale() before backward;
// a step whose gradients hold an inf/NaN is skipped and the scale halves
// (never below min_scale); after growth_interval consecutive finite steps the
// scale doubles. For bf16 and f32 training the scaler is disabled: scale 1,
// never skips (bf16 has f32's range).
//
//   const float loss_scale = scaler.scale();
//   ... backward with the loss (gradient) multiplied by loss_scale ...
//   if (!scaler.update(!global_grad_norm(params).finite))
//     optimizer.step(lr, clip / loss_scale);
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tessera::nn {

struct GradScalerConfig {
  bool enabled = true;
  float init_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;  // consecutive finite steps before growing
  float min_scale = 1.0f;
};

// Throws tessera::Error naming the field and the value.
void validate(const GradScalerConfig& config);

class GradScaler {
 public:
  explicit GradScaler(const GradScalerConfig& config = {});  // validates
  // Enabled with the defaults for f16; disabled for bf16 and f32.
  static GradScaler for_dtype(DType compute_dtype);

  bool enabled() const { return config_.enabled; }
  // The factor the loss is multiplied by (1 when disabled).
  float scale() const { return scale_; }
  // Records one step's outcome and returns true when the step must be skipped
  // (gradients not finite, scaler enabled). Backs off on overflow, grows after
  // growth_interval consecutive finite steps. Disabled: returns false, no change.
  bool update(bool found_non_finite);

  // Checkpoint state: the scale and the count of consecutive finite steps.
  int64_t growth_tracker() const { return growth_tracker_; }
  void load_state(float scale, int64_t growth_tracker);  // validates both; ignored when disabled
  const GradScalerConfig& config() const { return config_; }

 private:
  GradScalerConfig config_;
  float scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace tessera::nn
