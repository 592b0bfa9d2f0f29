// PLACEHOLDER until the matmul family lands: every method throws. Replace this file.
#include "kernels/cuda/cuda_backend.h"

namespace tessera {

void CudaBackend::matmul(const Tensor&, const Tensor&, Tensor&, const ops::MatmulOptions&) { TESSERA_THROW("matmul is not implemented on cuda yet"); }
void CudaBackend::matmul_backward(const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, bool, bool, bool) { TESSERA_THROW("matmul_backward is not implemented on cuda yet"); }
void CudaBackend::bias_add(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("bias_add is not implemented on cuda yet"); }
void CudaBackend::bias_add_backward(const Tensor&, Tensor&, bool) { TESSERA_THROW("bias_add_backward is not implemented on cuda yet"); }

}  // namespace tessera
