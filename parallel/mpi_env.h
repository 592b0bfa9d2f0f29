// MpiEnv: MPI for the life of the process (RAII). Construction calls
// MPI_Init_thread (unless MPI is already initialised, e.g. by a test harness)
// and sets MPI_ERRORS_RETURN on the world communicator so failures come back
// as tessera::Error; destruction calls MPI_Finalize if this object
// initialised MPI. It knows the world rank and size, the node-local rank and
// size (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED), the number of nodes
// and this node's index, the same way under mpirun, srun --mpi=pmix and an
// MPIJob launcher (mpirun --hostfile). A process started without a launcher is
// a world of one (MPI singleton); the constructor refuses one started in a way
// that cannot work (see launch_problem) before MPI_Init.
#pragma once

#include <mpi.h>

#include <functional>
#include <string>

#include "core/device.h"

namespace tessera::parallel {

// What is wrong with the way this process was started, judged from its
// environment before MPI_Init, or "" when nothing is. `getenv` looks a
// variable up (nullptr when unset); `open_mpi`: the MPI library is Open MPI.
//  - Started plainly (no srun, mpirun or other launcher: no SLURM_STEP_ID,
//    OMPI_*, PMIX_* or PMI_* variables) inside a Slurm allocation of several
//    tasks (SLURM_NTASKS > 1, or several nodes), as `tessera train` run
//    straight from an sbatch script or an salloc shell: it would train alone
//    as a world of one while the allocation idles. (A batch script has
//    SLURM_PROCID=0 but no SLURM_STEP_ID; srun's tasks have both.) A
//    one-task allocation started plainly is fine.
//  - Started by srun without an MPI plugin (srun --mpi=none, or a cluster
//    whose MpiDefault is none; Open MPI only): MPI_Init would fail with Open
//    MPI's text.
// The message says how to launch (srun --mpi=pmix ..., or mpirun -np N ...).
// TESSERA_LAUNCH_CHECK=0 turns the check off, for a launcher it does not know.
std::string launch_problem(const std::function<const char*(const char*)>& getenv, bool open_mpi);

class MpiEnv {
 public:
  MpiEnv();
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int node_count() const { return node_count_; }
  int node_index() const { return node_index_; }
  bool is_root() const { return world_rank_ == 0; }
  const std::string& hostname() const { return hostname_; }
  MPI_Comm world() const { return MPI_COMM_WORLD; }

  // The device this rank uses by default: cuda:<local rank modulo the
  // node's devices> when `cuda` is asked for, the CPU otherwise.
  Device default_device(bool cuda, int cuda_devices) const;
  // What a --device flag means on this rank: `cuda` the local rank's GPU,
  // `emu` the local rank's emulated device, anything else as written (cuda:1).
  Device device_for_flag(const std::string& flag) const;

  // The layout for rank 0's start-up line: world, nodes, ranks per node,
  // hostnames. Collective: every rank must call it.
  std::string describe_layout() const;

 private:
  bool initialised_here_ = false;
  int world_rank_ = 0, world_size_ = 1;
  int local_rank_ = 0, local_size_ = 1;
  int node_count_ = 1, node_index_ = 0;
  std::string hostname_;
};

}  // namespace tessera::parallel
