// CudaBackend: the operators on CUDA devices. Method definitions are spread
// over kernels/cuda/*.cu and *.cpp, one file per operator family; thin
// launchers of the functors in kernels/functors/ (the same math as the CPU),
// plus cuBLASLt for matrix products and cuDNN for convolutions.
#pragma once

#include "kernels/backend.h"

namespace tessera {

class CudaBackend final : public Backend {
 public:
  TESSERA_BACKEND_OVERRIDES  // every operator of kernels/backend.h
};

}  // namespace tessera
