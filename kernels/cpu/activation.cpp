// CpuBackend: ReLU, GELU and SwiGLU (functors in kernels/functors/activation.h).
#include "kernels/functors/activation.h"

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
    cpu_for_each_index(y.numel(), SwigluForward<T>{x.data<T>(), y.data<T>(), y.size(-1)});
  });
}

void CpuBackend::swiglu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  dispatch_float(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(grad_y.numel(),
                       SwigluBackward<T>{x.data<T>(), grad_y.data<T>(), grad_x.data<T>(), grad_y.size(-1)});
  });
}

}  // namespace tessera
