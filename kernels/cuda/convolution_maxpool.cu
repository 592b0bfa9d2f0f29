// CudaBackend: 2-D max pooling (functors in kernels/functors/pooling.h), one
// thread per output element (forward) or input element (backward).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/pooling.h"

namespace tessera {
namespace {

Pool2dGeometry pool_geometry(const Shape& x, const Shape& y, const ops::Pool2dParams& p) {
  return {int(x[2]), int(x[3]), int(y[2]), int(y[3]), p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w};
}

}  // namespace

void CudaBackend::maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& params) {
  const cudaStream_t stream = cuda::device_stream(x);
  const Pool2dGeometry geometry = pool_geometry(x.shape(), y.shape(), params);
  dispatch_float(x.dtype(), "maxpool2d_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_pool_window(params.kernel_h, params.kernel_w, [&](auto kernel_h, auto kernel_w) {
      cuda::for_each_index(
          y.numel(),
          MaxPool2dForward<T, kernel_h, kernel_w>{x.data<T>(), y.data<T>(), indices.data<int32_t>(), geometry}, stream);
    });
  });
}

void CudaBackend::maxpool2d_backward(const Tensor& grad_y, const Tensor& indices, Tensor& grad_x,
                                     const ops::Pool2dParams& params) {
  const cudaStream_t stream = cuda::device_stream(grad_x);
  const Pool2dGeometry geometry = pool_geometry(grad_x.shape(), grad_y.shape(), params);
  dispatch_float(grad_x.dtype(), "maxpool2d_backward", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(grad_x.numel(),
                         MaxPool2dBackward<T>{grad_y.data<T>(), indices.data<int32_t>(), grad_x.data<T>(), geometry},
                         stream);
  });
}

}  // namespace tessera
