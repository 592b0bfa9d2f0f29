// Built instead of kernels/cuda/ when the CUDA backend is not: asking for it
// says how to get it.
#include "core/error.h"
#include "kernels/backend.h"

namespace tessera {

Backend& cuda_backend() {
  TESSERA_THROW(
      "a CUDA tensor reached an operator, but this Tessera was built without the CUDA backend; "
      "rebuild with -DTESSERA_CUDA=ON (needs nvcc)");
}

}  // namespace tessera
