// StreamCommunicator: the Communicator for tensors on one accelerator whose
// operations run on a stream of their own, the NCCL design made
// backend-neutral. The collective library behind it is a CollectiveChannel:
// NCCL on CUDA devices (parallel/cuda/nccl_channel.cpp), MPI requests on the
// emulated accelerator (parallel/emulated_channel.cpp), so the CPU tests run
// this very code: streams, events, handles, the watchdog thread, teardown.
//
//   - Streams: a call records an event on the device's compute stream and
//     makes the communication stream wait for it (the operation sees every
//     kernel queued before it), then enqueues the channel's operation and
//     records a "done" event after it. Nothing blocks the host and nothing
//     synchronises the whole device.
//   - Handles: wait() makes the compute stream wait for the "done" event (no
//     host blocking on a GPU: work queued on the compute stream afterwards sees
//     the result). test() asks whether the event has passed. The handle keeps
//     the tensors alive until it is waited (or destroyed, which waits), so
//     their memory is not reused while the channel still uses it.
//   - barrier(): a one-element all-reduce, then the host waits for the stream.
//   - Watchdog (--comm-timeout): the host never waits for an operation, so a
//     thread (parallel/operation_watchdog.h), bound to the device first,
//     polls each one's "done" event against its deadline and the channel's
//     asynchronous error. On a late operation or an error it prints a report
//     naming the rank, communicator, operation and sequence number, aborts the
//     channel (its kernels stop) and ends the process; the launcher (mpirun,
//     srun --kill-on-bad-exit) then ends the job. A device fault found by the
//     event query (a kernel that failed) is reported as the device's failure,
//     with the last operation dispatched to the device, not as a
//     communication failure.
//   - Teardown: with no error, the communicator waits (bounded by the
//     deadline) for its stream to drain, then finalizes the channel. While an
//     exception unwinds, after the watchdog failed, after an asynchronous
//     error, or when the drain passes its deadline, it aborts the channel
//     instead: finalizing waits for every peer and would hang a failing rank.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/stream.h"
#include "parallel/communicator.h"
#include "parallel/operation_watchdog.h"

namespace tessera::parallel {

// A collective library on one device: enqueues operations on a stream.
// Tensors are checked by the communicator before they get here.
class CollectiveChannel {
 public:
  virtual ~CollectiveChannel() = default;

  virtual const char* library() const = 0;  // "NCCL", ... (in reports)
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual void all_reduce(Tensor& tensor, ReduceOp op, const Stream& stream) = 0;
  virtual void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const Stream& stream) = 0;
  virtual void all_gather(const Tensor& input, Tensor& output, const Stream& stream) = 0;
  virtual void broadcast(Tensor& tensor, int root, const Stream& stream) = 0;
  virtual void send_recv(const std::vector<P2POp>& ops, const Stream& stream) = 0;  // one group

  // "" while healthy, else the asynchronous error (a peer failed, the network
  // failed). Any thread.
  virtual std::string async_error() = 0;
  // Stops what is in flight; any thread; the first call counts.
  virtual void abort() noexcept = 0;
  // Releases the channel in order, once its operations have finished.
  virtual void finalize() noexcept = 0;
  // A channel over the ranks that pass the same `color`, ordered by `key`,
  // named `name`, whose operations will run on `stream` (collective over this
  // channel).
  virtual std::unique_ptr<CollectiveChannel> split(int color, int key, const std::string& name,
                                                   const Stream& stream) = 0;
};

class StreamCommunicator final : public Communicator {
 public:
  // `stream` is the communication stream on `device`, which `channel` uses.
  StreamCommunicator(std::unique_ptr<CollectiveChannel> channel, std::string name, Context& ctx, Device device,
                     Stream stream);
  ~StreamCommunicator() override;
  StreamCommunicator(const StreamCommunicator&) = delete;
  StreamCommunicator& operator=(const StreamCommunicator&) = delete;

  const std::string& name() const override { return name_; }
  int rank() const override { return channel_->rank(); }
  int size() const override { return channel_->size(); }

  uint64_t sequence() const override { return sequence_; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

  Device device() const { return device_; }
  const Stream& stream() const { return stream_; }
  CollectiveChannel& channel() { return *channel_; }

 private:
  CommHandle issue_all_reduce(Tensor& tensor, ReduceOp op) override;
  CommHandle issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override;
  CommHandle issue_all_gather(const Tensor& input, Tensor& output) override;
  CommHandle issue_broadcast(Tensor& tensor, int root) override;
  CommHandle issue_send(const Tensor& tensor, int peer) override;
  CommHandle issue_recv(Tensor& tensor, int peer) override;
  CommHandle issue_send_recv(const std::vector<P2POp>& ops) override;
  void issue_barrier() override;
  void start_watchdog();
  // The watchdog's verdict (on its thread): report, abort the channel, end the process.
  [[noreturn]] void fail_and_exit(const OperationWatchdog::Failure& failure);
  // Whether the stream finished its work before the teardown deadline.
  bool drained() const;
  std::string where(const char* op) const;
  void check_device(const std::string& at, const char* what, const Tensor& tensor) const;
  // Orders the communication stream after the compute stream, runs `enqueue`
  // (the channel's calls) on it, and returns a handle over the "done" event.
  template <typename Enqueue>
  CommHandle launch(const std::string& at, std::vector<Tensor> keep, Enqueue&& enqueue);

  Context& ctx_;
  Device device_;
  std::string name_;
  uint64_t sequence_ = 0;
  Stream stream_;
  std::unique_ptr<CollectiveChannel> channel_;
  std::shared_ptr<const Event> last_done_;       // the newest operation's "done" event
  std::unique_ptr<OperationWatchdog> watchdog_;  // stopped explicitly by the destructor
};

}  // namespace tessera::parallel
