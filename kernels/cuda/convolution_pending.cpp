// PLACEHOLDER until the convolution family lands: every method throws. Replace this file.
#include "kernels/cuda/cuda_backend.h"

namespace tessera {

void CudaBackend::conv2d_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, const ops::Conv2dParams&) { TESSERA_THROW("conv2d_forward is not implemented on cuda yet"); }
void CudaBackend::conv2d_backward(const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, Tensor*, const ops::Conv2dParams&, bool) { TESSERA_THROW("conv2d_backward is not implemented on cuda yet"); }
void CudaBackend::maxpool2d_forward(const Tensor&, Tensor&, Tensor&, const ops::Pool2dParams&) { TESSERA_THROW("maxpool2d_forward is not implemented on cuda yet"); }
void CudaBackend::maxpool2d_backward(const Tensor&, const Tensor&, Tensor&, const ops::Pool2dParams&) { TESSERA_THROW("maxpool2d_backward is not implemented on cuda yet"); }

}  // namespace tessera
