// Fused optimizer steps as index functors, shared by the CPU and CUDA
// backends: one pass reads the gradient once and updates the f32 master
// parameter, the optimizer state and (optionally) a low-precision copy of the
// parameter. The rules are PyTorch's (torch.optim.AdamW and torch.optim.SGD).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "core/half.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tessera {

// Per-step constants, computed once on the host (in double) from the parameters.
struct AdamWConstants {
  float lr, beta1, beta2, eps;
  float decay;           // 1 − lr·weight_decay (decoupled weight decay)
  float step_size;       // lr / (1 − beta1^step)
  float inv_sqrt_bias2;  // 1 / √(1 − beta2^step)
  float grad_scale;
};

inline AdamWConstants adamw_constants(const ops::AdamWParams& p) {
  const double bias1 = 1.0 - std::pow(double(p.beta1), double(p.step));
  const double bias2 = 1.0 - std::pow(double(p.beta2), double(p.step));
  return {p.lr,
          p.beta1,
          p.beta2,
          p.eps,
          float(1.0 - double(p.lr) * double(p.weight_decay)),
          float(double(p.lr) / bias1),
          float(1.0 / std::sqrt(bias2)),
          p.grad_scale};
}

// G: the gradient's storage type; C: param_copy's, or void for no copy (decided
// at compile time, so the CPU loop has no branch and vectorises).
//   g = grad·grad_scale;  param ·= 1 − lr·wd;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²;
//   param −= step_size · m / (√v / √(1−β2^t) + eps);  copy = round(param).
template <typename G, typename C>
struct AdamWStep {
  float* param;
  const G* grad;
  float* m;
  float* v;
  C* copy;
  AdamWConstants k;
  TESSERA_HD void operator()(int64_t i) const {
    const float g = to_float(grad[i]) * k.grad_scale;
    const float m_new = k.beta1 * m[i] + (1.0f - k.beta1) * g;
    const float v_new = k.beta2 * v[i] + (1.0f - k.beta2) * g * g;
    const float denom = sqrtf(v_new) * k.inv_sqrt_bias2 + k.eps;
    const float p = param[i] * k.decay - k.step_size * m_new / denom;
    m[i] = m_new;
    v[i] = v_new;
    param[i] = p;
    if constexpr (!std::is_void_v<C>) copy[i] = from_float<C>(p);
  }
};

// G, C as above; buffer is null when momentum == 0.
//   g = grad·grad_scale + wd·param;
//   buf = first_step ? g : momentum·buf + (1 − dampening)·g;   (momentum ≠ 0)
//   g = nesterov ? g + momentum·buf : buf;                     (momentum ≠ 0)
//   param −= lr·g;  copy = round(param).
template <typename G, typename C>
struct SgdStep {
  float* param;
  const G* grad;
  float* buffer;
  C* copy;
  float lr, momentum, dampening, weight_decay, grad_scale;
  bool nesterov, first_step;
  TESSERA_HD void operator()(int64_t i) const {
    const float p = param[i];
    float g = to_float(grad[i]) * grad_scale + weight_decay * p;
    if (buffer != nullptr) {
      const float b = first_step ? g : momentum * buffer[i] + (1.0f - dampening) * g;
      buffer[i] = b;
      g = nesterov ? g + momentum * b : b;
    }
    const float p_new = p - lr * g;
    param[i] = p_new;
    if constexpr (!std::is_void_v<C>) copy[i] = from_float<C>(p_new);
  }
};

// Host-side dispatch for the launchers: calls fn(G{}, copy) with G the
// gradient's storage type and copy param_copy's data pointer (a null void*
// when there is no copy).
template <typename Fn>
void dispatch_optimizer_types(const Tensor& grad, Tensor* param_copy, std::string_view what, Fn&& fn) {
  dispatch_float(grad.dtype(), what, [&](auto g) {
    if (param_copy == nullptr) {
      fn(g, static_cast<void*>(nullptr));
      return;
    }
    dispatch_float(param_copy->dtype(), what, [&](auto c) {
      using C = decltype(c);
      fn(g, param_copy->data<C>());
    });
  });
}

}  // namespace tessera
