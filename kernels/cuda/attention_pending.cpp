// PLACEHOLDER until the attention family lands: every method throws. Replace this file.
#include "kernels/cuda/cuda_backend.h"

namespace tessera {

void CudaBackend::attention_forward(const Tensor&, Tensor&, Tensor&, float) { TESSERA_THROW("attention_forward is not implemented on cuda yet"); }
void CudaBackend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, float) { TESSERA_THROW("attention_backward is not implemented on cuda yet"); }

}  // namespace tessera
