// CpuBackend: mixture-of-experts routing (functors in kernels/functors/moe_route.h),
// a token per index.
#include "kernels/functors/moe_route.h"

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::moe_route(const Tensor& logits, Tensor& probs, Tensor& experts, Tensor& weights, Tensor& logsumexp) {
  cpu_for_each_index(logits.size(0),
                     MoeRoute{logits.data<float>(), probs.data<float>(), experts.data<int32_t>(), weights.data<float>(),
                              logsumexp.data<float>(), logits.size(1), experts.size(1)},
                     256);
}

void CpuBackend::moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                                    const Tensor& grad_weights, const Tensor* grad_probs, const Tensor* grad_logsumexp,
                                    Tensor& grad_logits) {
  cpu_for_each_index(probs.size(0),
                     MoeRouteBackward{probs.data<float>(), experts.data<int32_t>(), weights.data<float>(),
                                      grad_weights.data<float>(), grad_probs ? grad_probs->data<float>() : nullptr,
                                      grad_logsumexp ? grad_logsumexp->data<float>() : nullptr,
                                      grad_logits.data<float>(), probs.size(1), experts.size(1)},
                     256);
}

}  // namespace tessera
