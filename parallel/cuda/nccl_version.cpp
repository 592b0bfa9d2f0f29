// The linked NCCL's version.
#include <string>

#include "parallel/cuda/nccl_check.h"
#include "parallel/library_versions.h"

namespace tessera {

std::string nccl_library_version() {
  int version = 0;
  TESSERA_NCCL_CHECK(ncclGetVersion(&version));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return "NCCL " + std::to_string(version / 10000) + "." + std::to_string((version % 10000) / 100) + "." +
         std::to_string(version % 100);
}

}  // namespace tessera
