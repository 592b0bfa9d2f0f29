// GradScaler: dynamic loss scaling (backoff on overflow, growth after a run of
// finite steps), PyTorch's rules plus a floor (min_scale) and a ceiling at the
// largest finite float.
#include "nn/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace tessera::nn {

void validate(const GradScalerConfig& c) {
  if (!c.enabled) return;
  TESSERA_CHECK(std::isfinite(c.min_scale) && c.min_scale > 0.0f, "grad scaler: min_scale must be finite and > 0, got ",
                c.min_scale);
  TESSERA_CHECK(std::isfinite(c.init_scale) && c.init_scale >= c.min_scale,
                "grad scaler: init_scale must be finite and >= min_scale (", c.min_scale, "), got ", c.init_scale);
  TESSERA_CHECK(std::isfinite(c.growth_factor) && c.growth_factor > 1.0f,
                "grad scaler: growth_factor must be finite and > 1, got ", c.growth_factor);
  TESSERA_CHECK(c.backoff_factor > 0.0f && c.backoff_factor < 1.0f,
                "grad scaler: backoff_factor must be in (0, 1), got ", c.backoff_factor);
  TESSERA_CHECK(c.growth_interval > 0, "grad scaler: growth_interval must be > 0, got ", c.growth_interval);
}

GradScaler::GradScaler(const GradScalerConfig& config)
    : config_(config), scale_(config.enabled ? config.init_scale : 1.0f) {
  validate(config_);
}

GradScaler GradScaler::for_dtype(DType compute_dtype) {
  GradScalerConfig config;
  config.enabled = compute_dtype == DType::f16;
  return GradScaler(config);
}

bool GradScaler::update(bool found_non_finite) {
  if (!config_.enabled) return false;
  if (found_non_finite) {
    scale_ = std::max(scale_ * config_.backoff_factor, config_.min_scale);
    growth_tracker_ = 0;
    return true;
  }
  if (++growth_tracker_ >= config_.growth_interval) {
    const float grown = scale_ * config_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  return false;
}

void GradScaler::load_state(float scale, int64_t growth_tracker) {
  if (!config_.enabled) return;  // a bf16/f32 run resumed from an f16 checkpoint keeps scale 1
  TESSERA_CHECK(std::isfinite(scale) && scale >= config_.min_scale, "grad scaler: checkpoint loss scale must be ",
                "finite and >= ", config_.min_scale, ", got ", scale);
  TESSERA_CHECK(growth_tracker >= 0 && growth_tracker < config_.growth_interval,
                "grad scaler: checkpoint growth tracker must be in [0, ", config_.growth_interval, "), got ",
                growth_tracker);
  scale_ = scale;
  growth_tracker_ = growth_tracker;
}

}  // namespace tessera::nn
