// PLACEHOLDER until the misc family lands: every method throws. Replace this file.
#include "kernels/cuda/cuda_backend.h"

namespace tessera {

void CudaBackend::dropout_forward(const Tensor&, Tensor&, float, uint64_t, uint64_t) { TESSERA_THROW("dropout_forward is not implemented on cuda yet"); }
void CudaBackend::dropout_backward(const Tensor&, Tensor&, float, uint64_t, uint64_t) { TESSERA_THROW("dropout_backward is not implemented on cuda yet"); }
void CudaBackend::embedding_forward(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("embedding_forward is not implemented on cuda yet"); }
void CudaBackend::embedding_backward(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("embedding_backward is not implemented on cuda yet"); }
void CudaBackend::reduce(ReduceKind, const Tensor&, Tensor&) { TESSERA_THROW("reduce is not implemented on cuda yet"); }
void CudaBackend::reduce_backward(ReduceKind, const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("reduce_backward is not implemented on cuda yet"); }
void CudaBackend::adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const ops::AdamWParams&, Tensor*) { TESSERA_THROW("adamw_step is not implemented on cuda yet"); }
void CudaBackend::sgd_step(Tensor&, const Tensor&, Tensor&, const ops::SgdParams&, Tensor*) { TESSERA_THROW("sgd_step is not implemented on cuda yet"); }
void CudaBackend::cast(const Tensor&, Tensor&) { TESSERA_THROW("cast is not implemented on cuda yet"); }
void CudaBackend::scale_(Tensor&, float) { TESSERA_THROW("scale_ is not implemented on cuda yet"); }
void CudaBackend::axpy(float, const Tensor&, Tensor&) { TESSERA_THROW("axpy is not implemented on cuda yet"); }
void CudaBackend::add(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("add is not implemented on cuda yet"); }

}  // namespace tessera
