// CudaBackend: ReLU, GELU and SwiGLU (functors in kernels/functors/activation.h).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/activation.h"

namespace tessera {
namespace {

template <float (*F)(float)>
void run_forward(const Tensor& x, Tensor& y, std::string_view what) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), what, [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(x.numel(), ActivationForward<T, F>{x.data<T>(), y.data<T>()}, stream);
  });
}

template <float (*DF)(float)>
void run_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x, std::string_view what) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), what, [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(x.numel(), ActivationBackward<T, DF>{x.data<T>(), grad_y.data<T>(), grad_x.data<T>()}, stream);
  });
}

}  // namespace

void CudaBackend::relu_forward(const Tensor& x, Tensor& y) {
  run_forward<relu>(x, y, "relu_forward");
}
void CudaBackend::relu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  run_backward<relu_grad>(x, grad_y, grad_x, "relu_backward");
}
void CudaBackend::gelu_forward(const Tensor& x, Tensor& y) {
  run_forward<gelu>(x, y, "gelu_forward");
}
void CudaBackend::gelu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  run_backward<gelu_grad>(x, grad_y, grad_x, "gelu_backward");
}

// y [R, F] from x [R, 2F].
void CudaBackend::swiglu_forward(const Tensor& x, Tensor& y) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(y.numel(), SwigluForward<T>{x.data<T>(), y.data<T>(), y.size(-1)}, stream);
  });
}

void CudaBackend::swiglu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(grad_y.numel(),
                         SwigluBackward<T>{x.data<T>(), grad_y.data<T>(), grad_x.data<T>(), grad_y.size(-1)}, stream);
  });
}

}  // namespace tessera
