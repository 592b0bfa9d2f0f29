// PLACEHOLDER until the rowwise family lands: every method throws. Replace this file.
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::softmax_forward(const Tensor&, Tensor&) { TESSERA_THROW("softmax_forward is not implemented on cpu yet"); }
void CpuBackend::softmax_backward(const Tensor&, const Tensor&, Tensor&) { TESSERA_THROW("softmax_backward is not implemented on cpu yet"); }
void CpuBackend::cross_entropy_forward(const Tensor&, const Tensor&, Tensor&, Tensor&, int64_t) { TESSERA_THROW("cross_entropy_forward is not implemented on cpu yet"); }
void CpuBackend::cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, int64_t) { TESSERA_THROW("cross_entropy_backward is not implemented on cpu yet"); }
void CpuBackend::layernorm_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, float) { TESSERA_THROW("layernorm_forward is not implemented on cpu yet"); }
void CpuBackend::layernorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor*, bool) { TESSERA_THROW("layernorm_backward is not implemented on cpu yet"); }
void CpuBackend::rmsnorm_forward(const Tensor&, const Tensor&, Tensor&, Tensor&, float) { TESSERA_THROW("rmsnorm_forward is not implemented on cpu yet"); }
void CpuBackend::rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, bool) { TESSERA_THROW("rmsnorm_backward is not implemented on cpu yet"); }

}  // namespace tessera
