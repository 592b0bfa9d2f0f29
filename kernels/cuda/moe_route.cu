// CudaBackend: mixture-of-experts routing (functors in kernels/functors/moe_route.h),
// a thread per token (each walks its E logits; E is tens to a few hundred).
#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/moe_route.h"

namespace tessera {

void CudaBackend::moe_route(const Tensor& logits, Tensor& probs, Tensor& experts, Tensor& weights, Tensor& logsumexp) {
  cuda::for_each_index(logits.size(0),
                       MoeRoute{logits.data<float>(), probs.data<float>(), experts.data<int32_t>(),
                                weights.data<float>(), logsumexp.data<float>(), logits.size(1), experts.size(1)},
                       cuda::device_stream(logits));
}

void CudaBackend::moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                                     const Tensor& grad_weights, const Tensor* grad_probs, const Tensor* grad_logsumexp,
                                     Tensor& grad_logits) {
  cuda::for_each_index(probs.size(0),
                       MoeRouteBackward{probs.data<float>(), experts.data<int32_t>(), weights.data<float>(),
                                        grad_weights.data<float>(), grad_probs ? grad_probs->data<float>() : nullptr,
                                        grad_logsumexp ? grad_logsumexp->data<float>() : nullptr,
                                        grad_logits.data<float>(), probs.size(1), experts.size(1)},
                       cuda::device_stream(probs));
}

}  // namespace tessera
