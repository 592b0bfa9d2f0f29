// CpuBackend: fused AdamW and SGD steps (functors in kernels/functors/optimizer.h),
// dispatched on the gradient's dtype and on param_copy's (if any).
#include "kernels/functors/optimizer.h"

#include <type_traits>

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
void CpuBackend::adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const ops::AdamWParams& params,
                            Tensor* param_copy) {
  const AdamWConstants constants = adamw_constants(params);
  dispatch_optimizer_types(grad, param_copy, "adamw_step", [&](auto g, auto* copy) {
    using G = decltype(g);
    using C = std::remove_pointer_t<decltype(copy)>;
    cpu_for_each_index(param.numel(), AdamWStep<G, C>{param.data<float>(), grad.data<G>(), m.data<float>(),
                                                      v.data<float>(), copy, constants});
  });
}

void CpuBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const ops::SgdParams& params,
                          Tensor* param_copy) {
  float* buffer = params.momentum != 0.0f ? momentum_buffer.data<float>() : nullptr;
  dispatch_optimizer_types(grad, param_copy, "sgd_step", [&](auto g, auto* copy) {
    using G = decltype(g);
    using C = std::remove_pointer_t<decltype(copy)>;
    cpu_for_each_index(param.numel(), SgdStep<G, C>{param.data<float>(), grad.data<G>(), buffer, copy, params.lr,
                                                    params.momentum, params.dampening, params.weight_decay,
                                                    params.grad_scale, params.nesterov, params.first_step});
  });
}

}  // namespace tessera
