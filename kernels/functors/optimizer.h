// Fused optimizer steps as index functors, shared by the CPU and CUDA
// backends: one pass reads the gradient once and updates the f32 master
// parameter, the optimizer state and (optionally) a low-precision copy of the
// parameter. The rules are PyTorch's (torch.optim.AdamW and torch.optim.SGD),
// AdamW's scalars computed in double as its Python code does.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "core/half.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tessera {

// Per-step constants, as torch.optim.AdamW (its single-tensor and foreach
// paths) computes them in Python: in double, from the double
// hyper-parameters and the step, so beta^step carries no f32 rounding of beta
// (bias_correction = 1 − beta**step); each is rounded to f32 once, where
// torch's f32 tensor operation takes it as a scalar (named after the operation).
struct AdamWConstants {
  float decay;  // 1 − lr·weight_decay        param.mul_(1 - lr * weight_decay)
  // exp_avg.lerp_(grad, w = 1 − β1): fma(w, g − m, m), ATen's CPU kernel for
  // w < ½ (β1 > ½; for β1 ≤ ½ ATen starts from g, the same up to rounding).
  float lerp_weight;
  float beta2;            // β2                         exp_avg_sq.mul_(beta2)
  float one_minus_beta2;  // 1 − β2                     .addcmul_(grad, grad, value=1 - beta2)
  float bias2_sqrt;       // (1 − β2^step)^½            exp_avg_sq.sqrt() / bias_correction2_sqrt
  float eps;              // ε                          .add_(eps)
  float neg_step_size;    // −lr / (1 − β1^step)        param.addcdiv_(exp_avg, denom, value=-step_size)
  float grad_scale;
};

inline AdamWConstants adamw_constants(const ops::AdamWParams& p) {
  const double step = double(p.step);
  const double bias_correction1 = 1.0 - std::pow(p.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(p.beta2, step);
  const double step_size = p.lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);  // Python's bias_correction2**0.5
  return {float(1.0 - p.lr * p.weight_decay), float(1.0 - p.beta1), float(p.beta2),    float(1.0 - p.beta2),
          float(bias_correction2_sqrt),       float(p.eps),         float(-step_size), p.grad_scale};
}

// G: the gradient's storage type; C: param_copy's, or void for no copy (decided
// at compile time, so the CPU loop has no branch and vectorises). In f32, in
// torch.optim.AdamW's order (decoupled weight decay first), each operation
// rounded as torch's CPU tensor operations round it: the fma written here
// where ATen's kernel has one (lerp_, addcmul_), and no other (the CPU file
// is compiled with -ffp-contract=off; nvcc fuses more, the last bits differ):
//   g = grad·grad_scale;  param ·= 1 − lr·wd;  m = lerp(m, g, 1 − β1);  v = v·β2 + (1 − β2)·g·g;
//   param += −step_size · m / (√v / √(1 − β2^t) + eps);  copy = round(param).
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
    const float decayed = param[i] * k.decay;
    const float m_new = fmaf(k.lerp_weight, g - m[i], m[i]);
    const float v_new = fmaf(k.one_minus_beta2 * g, g, v[i] * k.beta2);
    const float denom = sqrtf(v_new) / k.bias2_sqrt + k.eps;
    const float p = decayed + k.neg_step_size * m_new / denom;
    m[i] = m_new;
    v[i] = v_new;
    param[i] = p;
    if constexpr (!std::is_void_v<C>) copy[i] = from_float<C>(p);
  }
};

// G, C as above; buffer is null when momentum == 0. Each `a + α·b` one fma,
// as torch.optim.SGD's add_(b, alpha=α) is on the CPU:
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
    float g = fmaf(weight_decay, p, to_float(grad[i]) * grad_scale);
    if (buffer != nullptr) {
      const float b = first_step ? g : fmaf(1.0f - dampening, g, momentum * buffer[i]);
      buffer[i] = b;
      g = nesterov ? fmaf(momentum, b, g) : b;
    }
    const float p_new = fmaf(-lr, g, p);
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
