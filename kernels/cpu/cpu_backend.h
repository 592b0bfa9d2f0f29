// CpuBackend: the operators on the host. Method definitions are spread over
// kernels/cpu/*.cpp, one file per operator family; elementwise, row-wise and
// optimizer math comes from kernels/functors/ (shared with CUDA), run by
// parallel_for / cpu_for_each_index (OpenMP, one pool shared with OpenBLAS and
// oneDNN). Matrix products use OpenBLAS (f32) and oneDNN (bf16, f16).
#pragma once

#include "kernels/backend.h"

namespace tessera {

class CpuBackend final : public Backend {
 public:
  TESSERA_BACKEND_OVERRIDES  // every operator of kernels/backend.h
};

}  // namespace tessera
