// CpuBackend: 2-D max pooling (functors in kernels/functors/pooling.h): the
// forward walks output rows (rows spread over the OpenMP threads, each row's
// index arithmetic hoisted out of the loop over its columns), the backward
// scatters one input plane per index.
#include <algorithm>

#include "core/context.h"
#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/functors/pooling.h"

namespace tessera {
namespace {

Pool2dGeometry pool_geometry(const Shape& x, const Shape& y, const ops::Pool2dParams& p) {
  return {int(x[2]), int(x[3]), int(y[2]), int(y[3]), p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w};
}

// Runs op.at(row, column) for every row in [0, rows) and column in [0, columns).
// Each index reads a window, so a few thousand of them are worth a thread.
template <typename Op>
void for_each_row_column(int64_t rows, int columns, const Op& op) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max(columns, 1));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    const Op local = op;  // a copy the compiler knows no store can alias
    for (int64_t row = begin; row < end; ++row) {
#pragma omp simd
      for (int column = 0; column < columns; ++column) local.at(row, column);
    }
  });
}

}  // namespace

void CpuBackend::maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& params) {
  const Pool2dGeometry geometry = pool_geometry(x.shape(), y.shape(), params);
  dispatch_float(x.dtype(), "maxpool2d_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_pool_window(params.kernel_h, params.kernel_w, [&](auto kernel_h, auto kernel_w) {
      for_each_row_column(
          y.numel() / geometry.out_width, geometry.out_width,
          MaxPool2dForward<T, kernel_h, kernel_w>{x.data<T>(), y.data<T>(), indices.data<int32_t>(), geometry});
    });
  });
}

// The scatter form of the gradient (see pooling.h), one input plane per index;
// 16-bit gradients are summed in an f32 copy and rounded once.
void CpuBackend::maxpool2d_backward(const Tensor& grad_y, const Tensor& indices, Tensor& grad_x,
                                    const ops::Pool2dParams&) {
  const int64_t in_plane = grad_x.size(2) * grad_x.size(3), out_plane = grad_y.size(2) * grad_y.size(3);
  const int64_t planes = grad_x.numel() / in_plane;
  Tensor sums = grad_x.dtype() == DType::f32 ? grad_x : grad_x.context().empty(grad_x.shape(), DType::f32);
  dispatch_float(grad_y.dtype(), "maxpool2d_backward", [&](auto tag) {
    using T = decltype(tag);
    const MaxPool2dBackwardScatter<T> op{grad_y.data<T>(), indices.data<int32_t>(), sums.data<float>(), in_plane,
                                         out_plane};
    parallel_for(planes, std::max<int64_t>(1, (int64_t(1) << 15) / in_plane), [&](int64_t begin, int64_t end) {
      for (int64_t plane = begin; plane < end; ++plane) op(plane);
    });
  });
  if (!sums.shares_storage_with(grad_x)) cast(sums, grad_x);
}

}  // namespace tessera
