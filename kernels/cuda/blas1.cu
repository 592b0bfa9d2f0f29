// CudaBackend: cast, scale_, axpy, add (functors in kernels/functors/blas1.h).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/blas1.h"

namespace tessera {

void CudaBackend::cast(const Tensor& x, Tensor& y) {
  if (x.dtype() == y.dtype() && x.data_ptr() == y.data_ptr()) return;  // casting a tensor onto itself
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "cast", [&](auto source) {
    dispatch_float(y.dtype(), "cast", [&](auto target) {
      using S = decltype(source);
      using D = decltype(target);
      cuda::for_each_index(x.numel(), Cast<S, D>{x.data<S>(), y.data<D>()}, stream);
    });
  });
}

void CudaBackend::scale_(Tensor& x, float alpha) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "scale_", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(x.numel(), Scale<T>{x.data<T>(), alpha}, stream);
  });
}

void CudaBackend::axpy(float alpha, const Tensor& x, Tensor& y) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "axpy", [&](auto tag) {
    using T = decltype(tag);
    if (y.dtype() == x.dtype())
      cuda::for_each_index(x.numel(), Axpy<T>{x.data<T>(), y.data<T>(), alpha}, stream);
    else  // a low-precision x into an f32 y (checked by ops::axpy)
      cuda::for_each_index(x.numel(), Axpy<T, float>{x.data<T>(), y.data<float>(), alpha}, stream);
  });
}

void CudaBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  const cudaStream_t stream = cuda::device_stream(a);
  dispatch_float(a.dtype(), "add", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(a.numel(), Add<T>{a.data<T>(), b.data<T>(), out.data<T>()}, stream);
  });
}

}  // namespace tessera
