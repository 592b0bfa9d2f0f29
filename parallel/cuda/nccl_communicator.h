// NcclCommunicator: the Communicator for CUDA tensors on one device, through
// NCCL (CUDA builds only; make it with make_nccl_communicator or
// make_communicator, parallel/process_group.h).
//
//   - Bootstrap: rank 0 of the MPI communicator makes the ncclUniqueId,
//     MPI_Bcast hands it out, every rank calls ncclCommInitRank. split() uses
//     ncclCommSplit (no new bootstrap).
//   - Streams: each communicator has its own CUDA stream. A call records an
//     event on the device's compute stream and makes the communication stream
//     wait for it (so the collective sees every kernel queued before it), then
//     enqueues the NCCL call and records a "done" event after it. Nothing
//     blocks the host and nothing synchronises the whole device.
//   - Handles: wait() makes the compute stream wait for the "done" event (no
//     host blocking: work queued on the compute stream afterwards sees the
//     result; reading it on the host goes through a copy, which synchronises
//     the compute stream). test() asks whether the event has passed. The
//     handle keeps the tensors alive until it is waited (or destroyed, which
//     waits), so their memory is not reused while NCCL still uses it.
//   - bf16, f16, f32, i32, i64 and u8 natively (NCCL reduces in the element
//     type, so 16-bit sums are rounded step by step, unlike the MPI backend's
//     f32 reductions); avg is ncclAvg (a u8 avg divides the wrapped sum).
//   - send_recv groups its transfers with ncclGroupStart/ncclGroupEnd.
//   - barrier(): a one-element all-reduce on the communication stream, then
//     the host waits for that stream.
//   - Watchdog (--comm-timeout): the host never waits for an NCCL operation,
//     so a thread (parallel/operation_watchdog.h) polls each one's "done"
//     event against its deadline and ncclCommGetAsyncError. On a late
//     operation or an asynchronous error it prints a report naming the rank,
//     communicator, operation and sequence number, aborts the communicator
//     (ncclCommAbort: its kernels stop) and ends the process; the launcher
//     (mpirun, srun --kill-on-bad-exit) then ends the job.
//   - RAII: the ncclComm_t is finalised and destroyed (aborted when NCCL has
//     reported an asynchronous error); stream and events are core's RAII types.
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/stream.h"
#include "parallel/communicator.h"
#include "parallel/operation_watchdog.h"

namespace tessera::parallel {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `comm`: one NCCL rank per MPI rank, for tensors on `device` (CUDA).
  NcclCommunicator(MPI_Comm comm, std::string name, Context& ctx, Device device);
  ~NcclCommunicator() override = default;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  CommHandle all_reduce(Tensor& tensor, ReduceOp op) override;
  CommHandle reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override;
  CommHandle all_gather(const Tensor& input, Tensor& output) override;
  CommHandle broadcast(Tensor& tensor, int root) override;
  CommHandle send(const Tensor& tensor, int peer) override;
  CommHandle recv(Tensor& tensor, int peer) override;
  CommHandle send_recv(const std::vector<P2POp>& ops) override;
  void barrier() override;
  uint64_t sequence() const override { return sequence_; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

  Device device() const { return device_; }
  ncclComm_t native() const { return comm_.get(); }
  const Stream& stream() const { return stream_; }

  // Owns an ncclComm_t: finalise + destroy, or abort after an asynchronous
  // error. abort() may come from the watchdog's thread.
  class OwnedComm {
   public:
    explicit OwnedComm(ncclComm_t comm = nullptr) : comm_(comm) {}
    ~OwnedComm();
    OwnedComm(const OwnedComm&) = delete;
    OwnedComm& operator=(const OwnedComm&) = delete;
    ncclComm_t get() const { return comm_.load(); }
    void abort();  // ncclCommAbort, once; get() is null afterwards

   private:
    std::atomic<ncclComm_t> comm_;
  };

 private:
  NcclCommunicator(ncclComm_t adopted, std::string name, Context& ctx, Device device);
  void start_watchdog();
  // The watchdog's verdict (on its thread): report, abort the communicator, end the process.
  [[noreturn]] void fail_and_exit(const std::string& report);
  std::string where(const char* op) const;
  void check_device(const std::string& at, const char* what, const Tensor& tensor) const;
  // Orders the communication stream after the compute stream, runs `enqueue`
  // (the NCCL calls) on it, and returns a handle over the "done" event.
  template <typename Enqueue>
  CommHandle launch(const std::string& at, std::vector<Tensor> keep, Enqueue&& enqueue);

  Context& ctx_;
  Device device_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  uint64_t sequence_ = 0;
  Stream stream_;
  OwnedComm comm_;
  std::unique_ptr<OperationWatchdog> watchdog_;  // after comm_: its thread stops before the communicator goes
};

}  // namespace tessera::parallel
