// Optimizer (AdamW / SGD over Parameters, f32 state and masters), the global
// gradient norm and the clipping coefficient. The update math is the fused
// operators' (kernels/functors/optimizer.h); this file owns the state, the
// step count, the weight-decay rule per parameter and the checks.
#include "nn/optimizer.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/allocator.h"
#include "core/context.h"
#include "kernels/ops.h"

namespace tessera::nn {
namespace {

bool finite(double value) {
  return std::isfinite(value);
}

}  // namespace

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adamw") return OptimizerKind::adamw;
  TESSERA_THROW("--optimizer: unknown optimizer '", name, "'; use 'sgd' or 'adamw'");
}

const char* optimizer_kind_name(OptimizerKind kind) {
  return kind == OptimizerKind::sgd ? "sgd" : "adamw";
}

void validate(const OptimizerConfig& c) {
  TESSERA_CHECK(finite(c.lr) && c.lr > 0.0, "--lr must be a finite number > 0, got ", c.lr);
  TESSERA_CHECK(finite(c.weight_decay) && c.weight_decay >= 0.0, "--weight-decay must be a finite number >= 0, got ",
                c.weight_decay);
  if (c.kind == OptimizerKind::adamw) {
    TESSERA_CHECK(c.beta1 >= 0.0 && c.beta1 < 1.0, "--adam-beta1 must be in [0, 1), got ", c.beta1);
    TESSERA_CHECK(c.beta2 >= 0.0 && c.beta2 < 1.0, "--adam-beta2 must be in [0, 1), got ", c.beta2);
    TESSERA_CHECK(finite(c.eps) && c.eps > 0.0, "--adam-eps must be a finite number > 0, got ", c.eps);
    TESSERA_CHECK(c.lr * c.weight_decay < 1.0, "--lr × --weight-decay must be < 1 (AdamW multiplies ",
                  "weights by 1 − lr·weight_decay each step), got ", c.lr, " × ", c.weight_decay);
  } else {
    TESSERA_CHECK(finite(c.momentum) && c.momentum >= 0.0f && c.momentum < 1.0f,
                  "--sgd-momentum must be in [0, 1), got ", c.momentum);
    TESSERA_CHECK(c.dampening >= 0.0f && c.dampening <= 1.0f, "--dampening must be in [0, 1], got ", c.dampening);
    TESSERA_CHECK(!c.nesterov || (c.momentum > 0.0f && c.dampening == 0.0f),
                  "--nesterov needs --sgd-momentum > 0 and --dampening 0, got momentum ", c.momentum, " and dampening ",
                  c.dampening);
  }
}

Optimizer::Optimizer(std::vector<Parameter*> parameters, const OptimizerConfig& config)
    : parameters_(std::move(parameters)), config_(config) {
  validate(config_);
  std::set<std::string> names;
  states_.reserve(parameters_.size());
  for (Parameter* p : parameters_) {
    TESSERA_CHECK(p != nullptr, "optimizer: a null parameter pointer was passed");
    TESSERA_CHECK(p->value.defined(), "optimizer: parameter '", p->name, "' has no value");
    TESSERA_CHECK(is_floating(p->value.dtype()), "optimizer: parameter '", p->name, "' holds ",
                  dtype_name(p->value.dtype()), "; trainable parameters must be f32, bf16 or f16");
    TESSERA_CHECK(p->grad.defined() && p->grad.dtype() == DType::f32 && p->grad.numel() == p->value.numel(),
                  "optimizer: parameter '", p->name, "' needs an f32 gradient of ", p->value.numel(),
                  " elements (Parameter::grad), got ",
                  p->grad.defined() ? dtype_name(p->grad.dtype()) : std::string_view("none"), " with ",
                  p->grad.defined() ? p->grad.numel() : 0, " elements");
    TESSERA_CHECK(p->grad.device() == p->value.device(), "optimizer: parameter '", p->name, "' has its value on ",
                  p->value.device().to_string(), " but its gradient on ", p->grad.device().to_string());
    TESSERA_CHECK(names.insert(p->name).second, "optimizer: parameter name '", p->name,
                  "' appears twice; each parameter may be passed once and names must be unique");

    Context& ctx = p->value.context();
    const Device device = p->value.device();
    const Shape& shape = p->value.shape();
    const MemoryUseScope use(MemoryUse::optimizer);  // moments, momentum and f32 masters
    State state;
    if (config_.kind == OptimizerKind::adamw) {
      state.exp_avg = ctx.zeros(shape, DType::f32, device);
      state.exp_avg_sq = ctx.zeros(shape, DType::f32, device);
    } else if (config_.momentum > 0.0f) {
      state.momentum_buffer = ctx.zeros(shape, DType::f32, device);
    }
    if (p->value.dtype() != DType::f32) {
      state.master = ctx.empty(shape, DType::f32, device);
      ops::cast(p->value, state.master);
    }
    states_.push_back(std::move(state));
  }
}

void Optimizer::set_step_count(int64_t step) {
  TESSERA_CHECK(step >= 0, "optimizer: the step count must be >= 0, got ", step, " (check the checkpoint)");
  step_ = step;
}

void Optimizer::step(double lr, float grad_scale) {
  TESSERA_CHECK(finite(lr) && lr >= 0.0, "optimizer: the learning rate for step ", step_ + 1,
                " must be finite and >= 0, got ", lr, "; check --lr, --min-lr and the schedule");
  TESSERA_CHECK(finite(grad_scale), "optimizer: grad_scale must be finite, got ", grad_scale,
                "; skip the step when gradients overflow (GradScaler::update)");
  ++step_;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    Parameter& p = *parameters_[i];
    State& s = states_[i];
    const double decay = p.weight_decay ? config_.weight_decay : 0.0;
    const bool has_master = s.master.defined();
    Tensor& target = has_master ? s.master : p.value;
    Tensor* copy = has_master ? &p.value : nullptr;
    if (config_.kind == OptimizerKind::adamw) {
      ops::AdamWParams params;
      params.lr = lr;
      params.beta1 = config_.beta1;
      params.beta2 = config_.beta2;
      params.eps = config_.eps;
      params.weight_decay = decay;
      params.step = step_;
      params.grad_scale = grad_scale;
      ops::adamw_step(target, p.grad, s.exp_avg, s.exp_avg_sq, params, copy);
    } else {
      ops::SgdParams params;
      params.lr = float(lr);
      params.momentum = config_.momentum;
      params.dampening = config_.dampening;
      params.weight_decay = float(decay);
      params.nesterov = config_.nesterov;
      params.first_step = step_ == 1;
      params.grad_scale = grad_scale;
      ops::sgd_step(target, p.grad, s.momentum_buffer, params, copy);
    }
  }
}

std::vector<std::pair<std::string, Tensor*>> Optimizer::state_tensors() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const std::string& name = parameters_[i]->name;
    State& s = states_[i];
    if (s.exp_avg.defined()) out.emplace_back(name + ".exp_avg", &s.exp_avg);
    if (s.exp_avg_sq.defined()) out.emplace_back(name + ".exp_avg_sq", &s.exp_avg_sq);
    if (s.momentum_buffer.defined()) out.emplace_back(name + ".momentum_buffer", &s.momentum_buffer);
    if (s.master.defined()) out.emplace_back(name + ".master", &s.master);
  }
  return out;
}

void Optimizer::values_from_masters() {
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (states_[i].master.defined()) ops::cast(states_[i].master, parameters_[i]->value);
}

void Optimizer::masters_from_values() {
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (states_[i].master.defined()) ops::cast(parameters_[i]->value, states_[i].master);
}

Tensor grad_sum_squares(const std::vector<Parameter*>& parameters) {
  TESSERA_CHECK(!parameters.empty(), "grad_sum_squares: no parameters were given");
  const Tensor& first = parameters.front()->grad;
  TESSERA_CHECK(first.defined(), "grad_sum_squares: parameter '", parameters.front()->name, "' has no gradient");
  Context& ctx = first.context();
  const Device device = first.device();
  // One partial per buffer, then one sum: no host round trip in between.
  Tensor partials = ctx.empty(Shape{int64_t(parameters.size())}, DType::f32, device);
  for (size_t i = 0; i < parameters.size(); ++i) {
    const Parameter& p = *parameters[i];
    TESSERA_CHECK(p.grad.defined(), "grad_sum_squares: parameter '", p.name, "' has no gradient");
    TESSERA_CHECK(p.grad.device() == device, "grad_sum_squares: parameter '", p.name, "' has its gradient on ",
                  p.grad.device().to_string(), " but '", parameters.front()->name, "' on ", device.to_string(),
                  "; norms are taken over one device's parameters");
    Tensor partial = partials.slice(int64_t(i), int64_t(i) + 1);
    if (p.grad.numel() == 0)
      partial.fill_(0.0);
    else
      ops::sum_squares(p.grad, partial);
  }
  Tensor total = ctx.empty(Shape{1}, DType::f32, device);
  ops::sum(partials, total);
  return total;
}

GradNorm global_grad_norm(const std::vector<Parameter*>& parameters) {
  if (parameters.empty()) return {};
  const double sum = grad_sum_squares(parameters).to_vector<float>()[0];
  // A sum that overflows f32 (norm ≳ 1.8e19) counts as non-finite too: with
  // fp16 loss scaling that is an overflow the scaler should back off from.
  return {std::sqrt(sum), finite(sum)};
}

float clip_coefficient(double norm, double max_norm) {
  if (!(max_norm > 0.0)) return 1.0f;
  if (!finite(norm)) return 1.0f;  // nothing sensible to clip to; the scaler skips such steps
  return float(std::min(1.0, max_norm / (norm + 1e-6)));
}

}  // namespace tessera::nn
