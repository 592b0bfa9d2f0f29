// PLACEHOLDER until the misc family lands: every method throws. Replace this file.
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::dropout_forward(const Tensor&, Tensor&, float, uint64_t, uint64_t) { TESSERA_THROW("dropout_forward is not implemented on cpu yet"); }
void CpuBackend::dropout_backward(const Tensor&, Tensor&, float, uint64_t, uint64_t) { TESSERA_THROW("dropout_backward is not implemented on cpu yet"); }
void CpuBackend::embedding_forward(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("embedding_forward is not implemented on cpu yet"); }
void CpuBackend::embedding_backward(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("embedding_backward is not implemented on cpu yet"); }
void CpuBackend::reduce(ReduceKind, const Tensor&, Tensor&) { TESSERA_THROW("reduce is not implemented on cpu yet"); }
void CpuBackend::reduce_backward(ReduceKind, const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("reduce_backward is not implemented on cpu yet"); }
void CpuBackend::adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const ops::AdamWParams&, Tensor*) { TESSERA_THROW("adamw_step is not implemented on cpu yet"); }
void CpuBackend::sgd_step(Tensor&, const Tensor&, Tensor&, const ops::SgdParams&, Tensor*) { TESSERA_THROW("sgd_step is not implemented on cpu yet"); }
void CpuBackend::cast(const Tensor&, Tensor&) { TESSERA_THROW("cast is not implemented on cpu yet"); }
void CpuBackend::scale_(Tensor&, float) { TESSERA_THROW("scale_ is not implemented on cpu yet"); }
void CpuBackend::axpy(float, const Tensor&, Tensor&) { TESSERA_THROW("axpy is not implemented on cpu yet"); }
void CpuBackend::add(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("add is not implemented on cpu yet"); }

}  // namespace tessera
