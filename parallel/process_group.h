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
//   - nccl: as automatic, but an error when NCCL is not built or `device` is
//     not a CUDA device (instead of falling back to MPI). Host tensors (rank
//     agreement, checkpoints) still go through MPI: NCCL moves device memory.
// On the emulated accelerator (emu:N, core/device.h) the device channel is
// the emulated one (parallel/emulated_channel.cpp) in place of NCCL, through
// the same routing and the same stream communicator: what a GPU run does with
// NCCL, the CPU tests do with it.
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
// The device channel alone, for device tensors only (tests, and what the
// routed communicator holds): NCCL on a CUDA device, the emulated channel on
// emu:N. Collective over `comm`.
std::unique_ptr<Communicator> make_device_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                       Device device);
// The emulated accelerator's device channel: the same stream communicator as
// NCCL's, its operations MPI requests on a communicator of its own
// (parallel/emulated_channel.cpp). Collective over `comm`.
std::unique_ptr<Communicator> make_emulated_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                         Device device);

}  // namespace tessera::parallel
