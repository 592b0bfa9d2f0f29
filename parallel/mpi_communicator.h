// MpiCommunicator: the Communicator over an MPI communicator (its own
// duplicate, freed by RAII), for host tensors and, through host staging, for
// device tensors.
//
//   - Every operation is nonblocking and returns a handle over its MPI
//     requests: all-reduce is a ring of MPI_Isend/MPI_Irecv steps (buffers of
//     16 KiB and more; MPI_Iallreduce below that: Open MPI 4.1's nonblocking
//     all-reduce reaches only a third to a half of MPI_Allreduce's bandwidth
//     on large buffers, the ring matches it, see mpi_communicator.cpp),
//     reduce_scatter MPI_Ireduce_scatter_block, all_gather MPI_Iallgather,
//     broadcast MPI_Ibcast, send/recv MPI_Isend/MPI_Irecv (send_recv posts
//     all receives, then all sends). wait() is MPI_Waitall, test()
//     MPI_Testall, each moving a multi-step operation on to its next step; on
//     completion the handle does the host-side rest: avg's division, rounding
//     f32 results back to bf16/f16, copying staged data back to the device.
//   - Datatypes from the tensor: f32 MPI_FLOAT, i32 MPI_INT32_T, i64
//     MPI_INT64_T, u8 MPI_UINT8_T. bf16/f16 reductions run in f32 (each rank
//     widens into an f32 buffer, MPI reduces in f32, the result is rounded
//     once); broadcast, all-gather and send/recv move the raw 16-bit values.
//     u8 sum and avg run in i32 (Open MPI 4.1's AVX reduction saturates long
//     8-bit sums but wraps short ones; this way both are well defined).
//   - avg is sum, then division by size() (integers: truncated toward zero).
//     A u8 sum wraps modulo 256; a u8 avg is the true average.
//   - Device (CUDA) tensors are copied to host memory (pinned when the CUDA
//     backend is built) before the call and back when the handle completes.
//   - In a communicator of size 1 the collectives are the identity (copies
//     where input and output differ), make no MPI call and return completed
//     handles; send/recv to itself still go through MPI.
//   - MPI progresses only inside MPI calls: poll() tests every outstanding
//     operation of this communicator (the live handles register themselves and
//     leave the registry when they complete or are destroyed).
// Only the thread that created MPI (MPI_THREAD_FUNNELED) may use it.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/stall_inspector.h"

namespace tessera::parallel {

class MpiWork;

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `comm` (collective over it); errors come back as exceptions
  // (MPI_ERRORS_RETURN on the duplicate). With `stall_inspector` the family
  // of communicators split from this one shares an RMA window that names the
  // stalled ranks when a wait passes its deadline (its free is collective);
  // without it, no window (a channel whose deadlines another watchdog keeps).
  MpiCommunicator(MPI_Comm comm, std::string name, bool stall_inspector = true);
  // Waits for outstanding operations, then frees the duplicate.
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void poll() override;
  void set_activity(RankActivity activity, int64_t step) override;
  void heartbeat() override;
  uint64_t sequence() const override { return sequence_; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

  MPI_Comm native() const { return comm_; }
  size_t outstanding() const { return live_.size(); }  // operations not yet completed

 private:
  CommHandle issue_all_reduce(Tensor& tensor, ReduceOp op) override;
  CommHandle issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override;
  CommHandle issue_all_gather(const Tensor& input, Tensor& output) override;
  CommHandle issue_broadcast(Tensor& tensor, int root) override;
  CommHandle issue_send(const Tensor& tensor, int peer) override;
  CommHandle issue_recv(Tensor& tensor, int peer) override;
  CommHandle issue_send_recv(const std::vector<P2POp>& ops) override;
  void issue_barrier() override;
  struct Adopt {};
  MpiCommunicator(Adopt, MPI_Comm owned, std::string name);  // takes ownership of `owned`
  void init();
  std::string where(const char* op) const;                        // "all_reduce on 'dp' (rank 1 of 2, operation 7)"
  std::string where(const char* op, const Tensor& buffer) const;  // ... "operation 7, 4096 bytes)"
  // The start of every operation: its sequence number, published for the stall inspector.
  void begin(const char* kind);
  // A wait on `work` passed the deadline: the report, and the communicator
  // stops waiting for anything else (the process is about to abort).
  [[noreturn]] void stalled(const MpiWork& work, double waited_s);
  // Under a silence limit: the ranks that have not reached `work` and show no
  // sign of life for longer than the limit, described (empty: none); then
  // the report, as stalled(), naming them.
  std::string silent_ranks(const MpiWork& work) const;
  [[noreturn]] void silent(const MpiWork& work, double waited_s, const std::string& ranks);
  CommHandle start(std::unique_ptr<MpiWork> work);
  int next_collective_tag();  // the same on every rank: collectives are issued in the same order

  friend class MpiWork;
  void enroll(MpiWork* work);
  void leave(MpiWork* work) noexcept;

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  int rank_ = 0, size_ = 1;
  uint64_t sequence_ = 0;
  uint64_t collectives_ = 0;  // all-reduces issued, for the ring's message tags
  std::vector<MpiWork*> live_;
  std::shared_ptr<StallInspector> inspector_;  // the root's (the communicator made from an MPI_Comm), shared by splits
  int slot_ = -1;                              // this communicator's slot in it
  bool stalled_ = false;                       // a wait timed out: nothing more is waited for
};

// A communicator over a duplicate of `comm` (e.g. MPI_COMM_WORLD), named `name`.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name,
                                                    bool stall_inspector = true);

}  // namespace tessera::parallel
