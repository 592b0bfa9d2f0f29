// The CUDA backend object. Stateless: handles and streams come from the Context.
#include "kernels/cuda/cuda_backend.h"

namespace tessera {

Backend& cuda_backend() {
  static CudaBackend backend;
  return backend;
}

}  // namespace tessera
