// CudaBackend: dropout (functor in kernels/functors/dropout.h, the same as the
// CPU's: the mask and the output are identical on both devices).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/dropout.h"

namespace tessera {
namespace {

void run_dropout(const Tensor& in, Tensor& out, float p, uint64_t seed, uint64_t offset, std::string_view what) {
  const cudaStream_t stream = cuda::device_stream(in);
  dispatch_float(in.dtype(), what, [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(in.numel(), DropoutApply<T>{in.data<T>(), out.data<T>(), p, dropout_scale(p), seed, offset},
                         stream);
  });
}

}  // namespace

void CudaBackend::dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset) {
  run_dropout(x, y, p, seed, offset, "dropout_forward");
}

void CudaBackend::dropout_backward(const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset) {
  run_dropout(grad_y, grad_x, p, seed, offset, "dropout_backward");
}

}  // namespace tessera
