// PLACEHOLDER until the attention family lands: every method throws. Replace this file.
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::attention_forward(const Tensor&, Tensor&, Tensor&, float) { TESSERA_THROW("attention_forward is not implemented on cpu yet"); }
void CpuBackend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, float) { TESSERA_THROW("attention_backward is not implemented on cpu yet"); }

}  // namespace tessera
