// Without the CUDA backend there is no NCCL.
#include "parallel/library_versions.h"

namespace tessera {

std::string nccl_library_version() {
  return "not built (no CUDA backend)";
}

}  // namespace tessera
