// PLACEHOLDER until the convolution family lands: every method throws. Replace this file.
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

void CpuBackend::conv2d_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, const ops::Conv2dParams&) { TESSERA_THROW("conv2d_forward is not implemented on cpu yet"); }
void CpuBackend::conv2d_backward(const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, Tensor*, const ops::Conv2dParams&, bool) { TESSERA_THROW("conv2d_backward is not implemented on cpu yet"); }
void CpuBackend::maxpool2d_forward(const Tensor&, Tensor&, Tensor&, const ops::Pool2dParams&) { TESSERA_THROW("maxpool2d_forward is not implemented on cpu yet"); }
void CpuBackend::maxpool2d_backward(const Tensor&, const Tensor&, Tensor&, const ops::Pool2dParams&) { TESSERA_THROW("maxpool2d_backward is not implemented on cpu yet"); }

}  // namespace tessera
