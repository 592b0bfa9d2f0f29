// Versions of the communication libraries this build links, for start-up
// logs and `tessera info`.
#pragma once

#include <string>

namespace tessera {

std::string mpi_library_version();   // e.g. "Open MPI v4.1.4, ..."
std::string nccl_library_version();  // e.g. "NCCL 2.28.9", or "not built" without the CUDA backend

}  // namespace tessera
