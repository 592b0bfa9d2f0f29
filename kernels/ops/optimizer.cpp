// ops:: fused optimizer steps (AdamW, SGD): argument checks, then the device's backend.
#include <cmath>

#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

void check_state(std::string_view op, const detail::Arg& arg, int64_t n) {
  detail::check_dtype(op, arg, DType::f32);
  detail::check_numel(op, arg, n);
}

void check_grad_and_copy(std::string_view op, const Tensor& param, const Tensor& grad, const Tensor* param_copy) {
  detail::check_floating(op, {"grad", grad});
  detail::check_numel(op, {"grad", grad}, param.numel());
  if (param_copy != nullptr) {
    detail::check_floating(op, {"param_copy", *param_copy});
    detail::check_numel(op, {"param_copy", *param_copy}, param.numel());
    TESSERA_CHECK(!param_copy->shares_storage_with(param) && !param_copy->shares_storage_with(grad), op,
                  ": 'param_copy' must not share memory with 'param' or 'grad'");
  }
}

bool finite(double value) {
  return std::isfinite(value);
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& params,
                Tensor* param_copy) {
  constexpr std::string_view op = "adamw_step";
  check_state(op, {"param", param}, param.numel());
  check_state(op, {"m", m}, param.numel());
  check_state(op, {"v", v}, param.numel());
  check_grad_and_copy(op, param, grad, param_copy);
  const Tensor copy = param_copy != nullptr ? *param_copy : Tensor();
  detail::check_same_device(op, {{"param", param}, {"grad", grad}, {"m", m}, {"v", v}, {"param_copy", copy}});
  TESSERA_CHECK(params.step >= 1, op, ": 'step' is 1-based (the first step is 1), got ", params.step);
  TESSERA_CHECK(params.beta1 >= 0.0 && params.beta1 < 1.0 && params.beta2 >= 0.0 && params.beta2 < 1.0, op,
                ": betas must be in [0, 1), got beta1 = ", params.beta1, ", beta2 = ", params.beta2);
  TESSERA_CHECK(finite(params.lr) && finite(params.eps) && params.eps >= 0.0 && finite(params.weight_decay) &&
                    finite(params.grad_scale),
                op, ": lr, eps (≥ 0), weight_decay and grad_scale must be finite, got lr = ", params.lr,
                ", eps = ", params.eps, ", weight_decay = ", params.weight_decay, ", grad_scale = ", params.grad_scale);
  backend_for(param, "adamw_step").adamw_step(param, grad, m, v, params, param_copy);
}

void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const SgdParams& params, Tensor* param_copy) {
  constexpr std::string_view op = "sgd_step";
  check_state(op, {"param", param}, param.numel());
  check_grad_and_copy(op, param, grad, param_copy);
  if (params.momentum != 0.0f) check_state(op, {"momentum_buffer", momentum_buffer}, param.numel());
  const Tensor copy = param_copy != nullptr ? *param_copy : Tensor();
  const Tensor buffer = params.momentum != 0.0f ? momentum_buffer : Tensor();
  detail::check_same_device(op, {{"param", param}, {"grad", grad}, {"momentum_buffer", buffer}, {"param_copy", copy}});
  TESSERA_CHECK(finite(params.lr) && finite(params.momentum) && params.momentum >= 0.0f && finite(params.dampening) &&
                    finite(params.weight_decay) && finite(params.grad_scale),
                op, ": lr, momentum (≥ 0), dampening, weight_decay and grad_scale must be finite, got lr = ", params.lr,
                ", momentum = ", params.momentum, ", dampening = ", params.dampening,
                ", weight_decay = ", params.weight_decay, ", grad_scale = ", params.grad_scale);
  TESSERA_CHECK(!params.nesterov || (params.momentum > 0.0f && params.dampening == 0.0f), op,
                ": nesterov momentum requires momentum > 0 and dampening = 0 (got momentum = ", params.momentum,
                ", dampening = ", params.dampening, ")");
  backend_for(param, "sgd_step").sgd_step(param, grad, momentum_buffer, params, param_copy);
}

}  // namespace tessera::ops
