// PLACEHOLDER until the matmul family lands: every method throws. Replace this file.
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::matmul(const Tensor&, const Tensor&, Tensor&, const ops::MatmulOptions&) { TESSERA_THROW("matmul is not implemented on cpu yet"); }
void CpuBackend::matmul_backward(const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, bool, bool, bool) { TESSERA_THROW("matmul_backward is not implemented on cpu yet"); }
void CpuBackend::bias_add(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("bias_add is not implemented on cpu yet"); }
void CpuBackend::bias_add_backward(const Tensor&, Tensor&, bool) { TESSERA_THROW("bias_add_backward is not implemented on cpu yet"); }

}  // namespace tessera
