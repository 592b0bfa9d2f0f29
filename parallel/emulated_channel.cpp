// EmulatedChannel: the CollectiveChannel of the emulated accelerator (emu:N,
// core/device.h), so that the CPU tests run the stream communicator that NCCL
// uses (parallel/stream_communicator.h) with everything but the NCCL calls.
//
// Each operation is the MPI communicator's nonblocking operation on an MPI
// communicator of this channel's own (a duplicate: device traffic never
// matches host traffic, as NCCL's never matches MPI's), enqueued on the
// emulated stream as work the stream's events cover. Its tensors are device
// tensors, so the MPI side stages them through pinned host memory, as it does
// for a GPU without NCCL. Progress is made by the thread that enqueued (MPI is
// FUNNELED), whenever it queries or waits; the watchdog thread only reads.
// An MPI error becomes the channel's asynchronous error; abort() drops what is
// in flight and leaves its requests and communicator to the ending process.
#include <mpi.h>

#include <memory>
#include <mutex>
#include <utility>

#include "core/emulated_runtime.h"
#include "core/error.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"
#include "parallel/stream_communicator.h"

namespace tessera::parallel {
namespace {

class EmulatedChannel final : public CollectiveChannel {
 public:
  EmulatedChannel(std::unique_ptr<Communicator> mpi, const Stream& stream)
      : mpi_(std::move(mpi)), stream_(stream.native_handle()), state_(std::make_shared<Shared>()) {}
  ~EmulatedChannel() override {
    if (state_->aborted) (void)mpi_.release();  // requests may be pending on it: the failing process keeps it
  }
  EmulatedChannel(const EmulatedChannel&) = delete;
  EmulatedChannel& operator=(const EmulatedChannel&) = delete;

  const char* library() const override { return "emulated device channel (MPI)"; }
  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }

  void all_reduce(Tensor& tensor, ReduceOp op, const Stream&) override { enqueue(mpi_->all_reduce(tensor, op)); }
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const Stream&) override {
    enqueue(mpi_->reduce_scatter(input, output, op));
  }
  void all_gather(const Tensor& input, Tensor& output, const Stream&) override {
    enqueue(mpi_->all_gather(input, output));
  }
  void broadcast(Tensor& tensor, int root, const Stream&) override { enqueue(mpi_->broadcast(tensor, root)); }
  void send_recv(const std::vector<P2POp>& ops, const Stream&) override { enqueue(mpi_->send_recv(ops)); }

  std::string async_error() override {
    std::lock_guard lock(state_->mutex);
    return state_->aborted ? "the communicator was aborted" : state_->error;
  }

  void abort() noexcept override {
    {
      std::lock_guard lock(state_->mutex);
      if (state_->aborted) return;
      state_->aborted = true;
    }
    emulated::abandon_work(stream_);
  }

  void finalize() noexcept override {}  // the stream has drained; the MPI communicator frees itself

  std::unique_ptr<CollectiveChannel> split(int color, int key, const std::string& name, const Stream& stream) override {
    return std::make_unique<EmulatedChannel>(mpi_->split(color, key, name), stream);
  }

 private:
  // What the enqueued work shares with the channel: it may outlive it.
  struct Shared {
    std::mutex mutex;
    std::string error;
    bool aborted = false;
  };

  // The request as stream work: polled by test(); an error is kept as the
  // channel's asynchronous error (and finishes the work). After an abort
  // the handle is never destroyed: that would wait for a request that may
  // never complete.
  void enqueue(CommHandle handle) {
    std::shared_ptr<CommWork> work(handle.release(), [state = state_](CommWork* w) {
      bool aborted;
      {
        std::lock_guard lock(state->mutex);
        aborted = state->aborted;
      }
      if (!aborted) delete w;
    });
    emulated::enqueue_work(stream_, [work, state = state_]() -> bool {
      try {
        return work->test();
      } catch (const std::exception& error) {
        std::lock_guard lock(state->mutex);
        if (state->error.empty()) state->error = error.what();
        return true;
      }
    });
  }

  std::unique_ptr<Communicator> mpi_;
  void* stream_;
  std::shared_ptr<Shared> state_;
};

}  // namespace

std::unique_ptr<Communicator> make_emulated_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                         Device device) {
  TESSERA_CHECK(device.is_emulated(), "the emulated device channel '", name, "' moves tensors on emu:N, not on ",
                device.to_string());
  bind_thread_to_device(device);
  Stream stream = Stream::create(device);
  // No stall inspector: the stream communicator's watchdog keeps the deadlines,
  // and the teardown of a healthy rank must not wait for a failed one (as
  // NCCL's finalize does not).
  auto channel = std::make_unique<EmulatedChannel>(make_mpi_communicator(comm, name, false), stream);
  return std::make_unique<StreamCommunicator>(std::move(channel), name, ctx, device, std::move(stream));
}

}  // namespace tessera::parallel
