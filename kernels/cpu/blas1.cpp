// CpuBackend: cast, scale_, axpy, add (functors in kernels/functors/blas1.h).
#include "kernels/functors/blas1.h"

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::cast(const Tensor& x, Tensor& y) {
  if (x.dtype() == y.dtype() && x.data_ptr() == y.data_ptr()) return;  // casting a tensor onto itself
  dispatch_float(x.dtype(), "cast", [&](auto source) {
    dispatch_float(y.dtype(), "cast", [&](auto target) {
      using S = decltype(source);
      using D = decltype(target);
      cpu_for_each_index(x.numel(), Cast<S, D>{x.data<S>(), y.data<D>()});
    });
  });
}

void CpuBackend::scale_(Tensor& x, float alpha) {
  dispatch_float(x.dtype(), "scale_", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(x.numel(), Scale<T>{x.data<T>(), alpha});
  });
}

void CpuBackend::axpy(float alpha, const Tensor& x, Tensor& y) {
  dispatch_float(x.dtype(), "axpy", [&](auto tag) {
    using T = decltype(tag);
    if (y.dtype() == x.dtype())
      cpu_for_each_index(x.numel(), Axpy<T>{x.data<T>(), y.data<T>(), alpha});
    else  // a low-precision x into an f32 y (checked by ops::axpy)
      cpu_for_each_index(x.numel(), Axpy<T, float>{x.data<T>(), y.data<float>(), alpha});
  });
}

void CpuBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  dispatch_float(a.dtype(), "add", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(a.numel(), Add<T>{a.data<T>(), b.data<T>(), out.data<T>()});
  });
}

}  // namespace tessera
