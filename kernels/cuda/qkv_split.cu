// CudaBackend: split_qkv / join_qkv (functors in kernels/functors/qkv_split.h),
// a thread per element of q and kv.
#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/qkv_split.h"

namespace tessera {

void CudaBackend::split_qkv(const Tensor& qkv, bool grouped, Tensor& q, Tensor& kv) {
  const QkvSplitIndex index{qkv_layout_of(qkv.size(2), qkv.size(3), qkv.size(4), grouped)};
  const cudaStream_t stream = cuda::device_stream(qkv);
  dispatch_float(qkv.dtype(), "split_qkv", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(q.numel() + kv.numel(), QkvSplit<T>{index, qkv.data<T>(), q.data<T>(), kv.data<T>()},
                         stream);
  });
}

void CudaBackend::join_qkv(const Tensor& grad_q, const Tensor& grad_kv, bool grouped, Tensor& grad_qkv) {
  const QkvSplitIndex index{qkv_layout_of(grad_qkv.size(2), grad_qkv.size(3), grad_qkv.size(4), grouped)};
  const cudaStream_t stream = cuda::device_stream(grad_qkv);
  dispatch_float(grad_qkv.dtype(), "join_qkv", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = grad_q.numel() + grad_kv.numel();
    if (grad_q.dtype() == DType::f32)
      cuda::for_each_index(
          n, QkvJoin<float, T>{index, grad_q.data<float>(), grad_kv.data<float>(), grad_qkv.data<T>()}, stream);
    else
      cuda::for_each_index(n, QkvJoin<T, T>{index, grad_q.data<T>(), grad_kv.data<T>(), grad_qkv.data<T>()},
                           stream);
  });
}

}  // namespace tessera
