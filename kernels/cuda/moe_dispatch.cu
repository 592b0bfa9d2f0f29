// CudaBackend: token dispatch of the mixture of experts (functors in
// kernels/functors/moe_dispatch.h), a thread per element (or per choice).
#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/moe_dispatch.h"

namespace tessera {

void CudaBackend::moe_permute(const Tensor& x, const Tensor& pairs, int64_t top_k, Tensor& out) {
  dispatch_float(x.dtype(), "moe_permute", [&](auto tag) {
    using T = decltype(tag);
    const cudaStream_t stream = cuda::device_stream(x);
    cuda::for_each_index(out.numel(),
                         MoePermute<T>{x.data<T>(), pairs.data<int32_t>(), out.data<T>(), x.size(1), top_k}, stream);
  });
}

void CudaBackend::moe_permute_backward(const Tensor& grad_slots, const Tensor& slot_of, Tensor& grad_x) {
  dispatch_float(grad_x.dtype(), "moe_permute_backward", [&](auto tag) {
    using T = decltype(tag);
    const cudaStream_t stream = cuda::device_stream(grad_x);
    cuda::for_each_index(grad_x.numel(),
                         MoePermuteBackward<T>{grad_slots.data<T>(), slot_of.data<int32_t>(), grad_x.data<T>(),
                                               grad_x.size(1), slot_of.size(1)},
                         stream);
  });
}

void CudaBackend::moe_combine(const Tensor& ys, const Tensor& slot_of, const Tensor& weights, Tensor& out) {
  dispatch_float(out.dtype(), "moe_combine", [&](auto tag) {
    using T = decltype(tag);
    const cudaStream_t stream = cuda::device_stream(out);
    cuda::for_each_index(out.numel(),
                         MoeCombine<T>{ys.data<T>(), slot_of.data<int32_t>(), weights.data<float>(), out.data<T>(),
                                       out.size(1), slot_of.size(1)},
                         stream);
  });
}

void CudaBackend::moe_combine_backward(const Tensor& grad_out, const Tensor& ys, const Tensor& pairs,
                                       const Tensor& slot_of, const Tensor& weights, Tensor& grad_ys,
                                       Tensor& grad_weights) {
  dispatch_float(grad_out.dtype(), "moe_combine_backward", [&](auto tag) {
    using T = decltype(tag);
    const cudaStream_t stream = cuda::device_stream(grad_out);
    const int64_t width = grad_out.size(1), top_k = slot_of.size(1);
    cuda::for_each_index(grad_ys.numel(),
                         MoeCombineBackwardSlots<T>{grad_out.data<T>(), pairs.data<int32_t>(), weights.data<float>(),
                                                    grad_ys.data<T>(), width, top_k},
                         stream);
    cuda::for_each_index(grad_weights.numel(),
                         MoeCombineBackwardWeights<T>{grad_out.data<T>(), ys.data<T>(), slot_of.data<int32_t>(),
                                                      grad_weights.data<float>(), width, top_k},
                         stream);
  });
}

}  // namespace tessera
