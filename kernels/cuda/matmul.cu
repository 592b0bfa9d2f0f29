// CudaBackend: bias_add and bias_add_backward, and the launchers of the
// matmul epilogue and helper passes (kernels/cuda/matmul_launch.h); all thin
// launches of the functors in kernels/functors/matmul.h. The GEMMs themselves
// are cuBLASLt calls in kernels/cuda/matmul.cpp.
#include <algorithm>
#include <type_traits>

#include "core/context.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/matmul_launch.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/matmul.h"

namespace tessera {
namespace cuda {

void launch_matmul_epilogue(const float* x, void* y, DType y_dtype, const void* bias, void* pre,
                            ops::Activation activation, float beta, int64_t rows, int64_t cols, cudaStream_t stream) {
  dispatch_float(y_dtype, "matmul epilogue", [&](auto tag) {
    using T = decltype(tag);
    const T* b = static_cast<const T*>(bias);
    T* out = static_cast<T*>(y);
    T* p = static_cast<T*>(pre);
    switch (activation) {
      case ops::Activation::none:
        for_each_row(rows, BiasActivationRows<float, T, identity_activation>{x, b, out, p, cols, beta}, stream);
        break;
      case ops::Activation::relu:
        for_each_row(rows, BiasActivationRows<float, T, relu>{x, b, out, p, cols, beta}, stream);
        break;
      case ops::Activation::gelu:
        for_each_row(rows, BiasActivationRows<float, T, gelu>{x, b, out, p, cols, beta}, stream);
        break;
    }
  });
}

void launch_narrow_f32(const float* x, void* y, DType dtype, int64_t numel, cudaStream_t stream) {
  dispatch_float(dtype, "matmul", [&](auto tag) {
    using T = decltype(tag);
    for_each_index(numel, Convert<float, T>{x, static_cast<T*>(y)}, stream);
  });
}

void launch_scale(void* y, DType dtype, int64_t numel, float beta, cudaStream_t stream) {
  dispatch_float(dtype, "matmul", [&](auto tag) {
    using T = decltype(tag);
    for_each_index(numel, ScaleInPlace<T>{static_cast<T*>(y), beta}, stream);
  });
}

}  // namespace cuda

void CudaBackend::bias_add(const Tensor& x, const Tensor& bias, Tensor& y) {
  const cudaStream_t stream = cuda::device_stream(x);
  const int64_t cols = x.shape()[-1], rows = cols == 0 ? 0 : x.numel() / cols;
  dispatch_float(x.dtype(), "bias_add", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_row(
        rows,
        BiasActivationRows<T, T, identity_activation>{x.data<T>(), bias.data<T>(), y.data<T>(), nullptr, cols, 0.0f},
        stream);
  });
}

// Column sums in a fixed order: with few rows, one thread per column; with
// many, a first pass sums chunks of rows per (chunk, column) into f32 scratch
// and a second sums the chunks. The chunking depends only on the shape, so the
// result is the same on every run and every GPU.
void CudaBackend::bias_add_backward(const Tensor& grad_y, Tensor& grad_bias, bool accumulate) {
  constexpr int64_t kTargetThreads = int64_t(1) << 16, kMinRowsPerChunk = 32;
  const cudaStream_t stream = cuda::device_stream(grad_y);
  const int64_t cols = grad_y.shape()[-1], rows = cols == 0 ? 0 : grad_y.numel() / cols;
  if (cols == 0) return;
  const int64_t chunks =
      std::clamp<int64_t>((kTargetThreads + cols - 1) / cols, 1, std::max<int64_t>(1, rows / kMinRowsPerChunk));
  dispatch_float(grad_y.dtype(), "bias_add_backward", [&](auto tag) {
    using T = decltype(tag);
    const auto finish = [&](const auto* x, int64_t x_rows) {
      using X = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
      if (grad_bias.dtype() == DType::f32)
        cuda::for_each_index(cols, ColumnSums<X, float>{x, grad_bias.data<float>(), x_rows, cols, accumulate}, stream);
      else
        cuda::for_each_index(cols, ColumnSums<X, T>{x, grad_bias.data<T>(), x_rows, cols, accumulate}, stream);
    };
    if (chunks == 1) {
      finish(grad_y.data<T>(), rows);
      return;
    }
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    const int64_t used_chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    Tensor partial = grad_y.context().empty(Shape{used_chunks, cols}, DType::f32, grad_y.device());
    cuda::for_each_index(used_chunks * cols,
                         ColumnPartialSums<T>{grad_y.data<T>(), partial.data<float>(), rows, cols, rows_per_chunk},
                         stream);
    finish(static_cast<const float*>(partial.data<float>()), used_chunks);
  });
}

}  // namespace tessera
