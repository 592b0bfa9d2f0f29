// Built instead of parallel/cuda/nccl_channel.cpp when the CUDA backend
// is not: there is no NCCL, and asking for it says how to get it.
#include "core/error.h"
#include "parallel/process_group.h"

namespace tessera::parallel {

bool nccl_compiled() {
  return false;
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm, const std::string& name, Context&, Device) {
  TESSERA_THROW("communicator '", name,
                "' asked for NCCL, but this Tessera was built without the CUDA backend; use --comm-backend mpi, or "
                "rebuild with -DTESSERA_CUDA=ON (needs nvcc and NCCL)");
}

}  // namespace tessera::parallel
