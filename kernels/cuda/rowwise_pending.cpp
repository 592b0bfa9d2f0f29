// PLACEHOLDER until the rowwise family lands: every method throws. Replace this file.
#include "kernels/cuda/cuda_backend.h"

namespace tessera {

void CudaBackend::softmax_forward(const Tensor&, Tensor&) { TESSERA_THROW("softmax_forward is not implemented on cuda yet"); }
void CudaBackend::softmax_backward(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("softmax_backward is not implemented on cuda yet"); }
void CudaBackend::cross_entropy_forward(const Tensor&, const Tensor&, Tensor&, Tensor&, int64_t) { TESSERA_THROW("cross_entropy_forward is not implemented on cuda yet"); }
void CudaBackend::cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, int64_t) { TESSERA_THROW("cross_entropy_backward is not implemented on cuda yet"); }
void CudaBackend::layernorm_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, float) { TESSERA_THROW("layernorm_forward is not implemented on cuda yet"); }
void CudaBackend::layernorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor*, bool) { TESSERA_THROW("layernorm_backward is not implemented on cuda yet"); }
void CudaBackend::rmsnorm_forward(const Tensor&, const Tensor&, Tensor&, Tensor&, float) { TESSERA_THROW("rmsnorm_forward is not implemented on cuda yet"); }
void CudaBackend::rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, bool) { TESSERA_THROW("rmsnorm_backward is not implemented on cuda yet"); }

}  // namespace tessera
