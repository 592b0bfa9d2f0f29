// CpuBackend: ReLU, GELU and SwiGLU (functors in kernels/functors/activation.h).
#include "kernels/functors/activation.h"

#include <algorithm>

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

template <float (*F)(float)>
void run_forward(const Tensor& x, Tensor& y, std::string_view what) {
  dispatch_float(x.dtype(), what, [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(x.numel(), ActivationForward<T, F>{x.data<T>(), y.data<T>()});
  });
}

template <float (*DF)(float)>
void run_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x, std::string_view what) {
  dispatch_float(x.dtype(), what, [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(x.numel(), ActivationBackward<T, DF>{x.data<T>(), grad_y.data<T>(), grad_x.data<T>()});
  });
}

// op.element(r·F + f, r·2F + f) for every element (r, f) of `elements` =
// [R, F], row by row: the loop over a row's contiguous f vectorises.
template <typename Op>
void for_each_gated_element(int64_t elements, int64_t width, const Op& op) {
  if (elements == 0) return;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / width);
  parallel_for(elements / width, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t out = row * width, gate = 2 * row * width;
#pragma omp simd
      for (int64_t f = 0; f < width; ++f) op.element(out + f, gate + f);
    }
  });
}

}  // namespace

void CpuBackend::relu_forward(const Tensor& x, Tensor& y) {
  run_forward<relu>(x, y, "relu_forward");
}
void CpuBackend::relu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  run_backward<relu_grad>(x, grad_y, grad_x, "relu_backward");
}
void CpuBackend::gelu_forward(const Tensor& x, Tensor& y) {
  run_forward<gelu>(x, y, "gelu_forward");
}
void CpuBackend::gelu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  run_backward<gelu_grad>(x, grad_y, grad_x, "gelu_backward");
}

// y [R, F] from x [R, 2F].
void CpuBackend::swiglu_forward(const Tensor& x, Tensor& y) {
  dispatch_float(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t width = y.size(-1);
    for_each_gated_element(y.numel(), width, SwigluForward<T>{x.data<T>(), y.data<T>(), width});
  });
}

void CpuBackend::swiglu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  dispatch_float(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t width = grad_y.size(-1);
    for_each_gated_element(grad_y.numel(), width,
                           SwigluBackward<T>{x.data<T>(), grad_y.data<T>(), grad_x.data<T>(), width});
  });
}

}  // namespace tessera
