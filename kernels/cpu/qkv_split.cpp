// CpuBackend: split_qkv / join_qkv (functors in kernels/functors/qkv_split.h).
#include "kernels/functors/qkv_split.h"

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::split_qkv(const Tensor& qkv, bool grouped, Tensor& q, Tensor& kv) {
  const QkvSplitIndex index{qkv_layout_of(qkv.size(2), qkv.size(3), qkv.size(4), grouped)};
  dispatch_float(qkv.dtype(), "split_qkv", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(q.numel() + kv.numel(), QkvSplit<T>{index, qkv.data<T>(), q.data<T>(), kv.data<T>()});
  });
}

void CpuBackend::join_qkv(const Tensor& grad_q, const Tensor& grad_kv, bool grouped, Tensor& grad_qkv) {
  const QkvSplitIndex index{qkv_layout_of(grad_qkv.size(2), grad_qkv.size(3), grad_qkv.size(4), grouped)};
  dispatch_float(grad_qkv.dtype(), "join_qkv", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = grad_q.numel() + grad_kv.numel();
    if (grad_q.dtype() == DType::f32)
      cpu_for_each_index(n, QkvJoin<float, T>{index, grad_q.data<float>(), grad_kv.data<float>(), grad_qkv.data<T>()});
    else
      cpu_for_each_index(n, QkvJoin<T, T>{index, grad_q.data<T>(), grad_kv.data<T>(), grad_qkv.data<T>()});
  });
}

}  // namespace tessera
