// Making communicators: which backend moves a group's tensors.
//
//   make_communicator(MPI_COMM_WORLD, "world", ctx, device, backend)
//
// CommBackend (the trainer's --comm-backend):
//   - automatic: for a CUDA `device` in a build with NCCL, CUDA tensors go
//     through NCCL and host tensors through MPI (the choice is made per call,
//     from the tensor's device); otherwise everything goes through MPI (device
//     tensors staged through host memory);
//   - mpi: MPI for every tensor;
//   - nccl: NCCL only (CUDA tensors on `device`); an error when NCCL is not
//     built or `device` is not a CUDA device.
// Creating a communicator is collective over `comm`; NCCL's bootstrap (rank 0
// makes the ncclUniqueId, MPI_Bcast hands it out, ncclCommInitRank) runs once
// per communicator, and split() makes NCCL sub-communicators with
// ncclCommSplit.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <string_view>

#include "core/context.h"
#include "parallel/communicator.h"

namespace tessera::parallel {

enum class CommBackend { automatic, mpi, nccl };

// "auto", "mpi", "nccl" (the --comm-backend values); throws naming the flag otherwise.
CommBackend parse_comm_backend(std::string_view text);
std::string_view comm_backend_name(CommBackend backend);

std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, const std::string& name, Context& ctx, Device device,
                                                CommBackend backend = CommBackend::automatic);

// The NCCL side, from parallel/cuda/ (or the stand-ins of parallel/no_cuda/).
bool nccl_compiled();
// An NCCL communicator over the ranks of `comm` for tensors on `device`
// (collective over `comm`).
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                     Device device);

}  // namespace tessera::parallel
