// StreamCommunicator: operations of a CollectiveChannel on the communicator's
// own stream, ordered against the compute stream by events; the watchdog and
// the teardown rules (see stream_communicator.h).
#include "parallel/stream_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>
#include <utility>

#include "core/device_runtime.h"
#include "core/error.h"
#include "core/process_end.h"

namespace tessera::parallel {
namespace {

// The teardown waits at most this long (or the --comm-timeout, when longer)
// for the stream's last operation before it aborts instead of finalizing.
constexpr double kMinimumDrainSeconds = 30.0;

const char* op_name(ReduceOp op) {
  return op == ReduceOp::sum ? "sum" : op == ReduceOp::avg ? "avg" : "max";
}

// Throws when the channel has reported an asynchronous error.
void check_async(CollectiveChannel& channel, const std::string& at) {
  const std::string error = channel.async_error();
  TESSERA_CHECK(error.empty(), at, ": ", channel.library(), " reported an asynchronous error: ", error);
}

// One operation in flight: the "done" event on the communication stream.
class StreamWork final : public CommWork {
 public:
  StreamWork(const Stream& compute, std::shared_ptr<const Event> done, std::vector<Tensor> keep,
             CollectiveChannel& channel, std::string where)
      : compute_(compute),
        done_(std::move(done)),
        keep_(std::move(keep)),
        channel_(channel),
        where_(std::move(where)) {}
  ~StreamWork() override {
    if (waited_) return;
    try {
      wait();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "tessera: an unwaited %s operation failed while its handle was destroyed: %s\n",
                   channel_.library(), error.what());
    }
  }
  StreamWork(const StreamWork&) = delete;
  StreamWork& operator=(const StreamWork&) = delete;

  // The compute stream waits for the operation; the host does not.
  void wait() override {
    if (waited_) return;
    check_async(channel_, where_);
    done_->wait(compute_);
    waited_ = true;
    keep_.clear();  // later work on the compute stream is ordered after the operation
  }

  bool test() override {
    if (!waited_) check_async(channel_, where_);
    return done_->ready();
  }

 private:
  const Stream& compute_;
  std::shared_ptr<const Event> done_;  // shared with the watchdog
  std::vector<Tensor> keep_;
  CollectiveChannel& channel_;
  std::string where_;
  bool waited_ = false;
};

}  // namespace

StreamCommunicator::StreamCommunicator(std::unique_ptr<CollectiveChannel> channel, std::string name, Context& ctx,
                                       Device device, Stream stream)
    : ctx_(ctx), device_(device), name_(std::move(name)), stream_(std::move(stream)), channel_(std::move(channel)) {
  start_watchdog();
}

StreamCommunicator::~StreamCommunicator() {
  bool failing = std::uncaught_exceptions() > 0 || watchdog_->failed();
  if (!failing) {
    try {
      failing = !channel_->async_error().empty() || !drained();
    } catch (...) {  // a device fault: the stream will never drain
      failing = true;
    }
  }
  watchdog_.reset();  // no report from here on: the verdict is taken
  if (failing)
    channel_->abort();
  else
    channel_->finalize();
}

bool StreamCommunicator::drained() const {
  if (!last_done_) return true;
  const double seconds = std::max(timeout(), kMinimumDrainSeconds);
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  while (!last_done_->ready()) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr,
                   "tessera: [rank %d] %s communicator '%s' still had operation %llu in flight %.0f s after its last "
                   "use; aborting it instead of finalizing\n",
                   launcher_rank(), channel_->library(), name_.c_str(), static_cast<unsigned long long>(sequence_),
                   seconds);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void StreamCommunicator::start_watchdog() {
  const Device device = device_;
  watchdog_ = std::make_unique<OperationWatchdog>(
      name_, [this] { return channel_->async_error(); },
      [this](const OperationWatchdog::Failure& failure) { fail_and_exit(failure); }, std::chrono::milliseconds(100),
      [device] { bind_thread_to_device(device); });
}

// Ended as a watchdog thread (core/process_end.h): not MPI_Abort, since MPI
// runs MPI_THREAD_FUNNELED and this is the watchdog's thread, while the main
// thread may be blocked in a device call for good. A rank that exits without
// MPI_Finalize makes mpirun (and srun --kill-on-bad-exit, as slurm/ launches)
// end the whole job.
void StreamCommunicator::fail_and_exit(const OperationWatchdog::Failure& failure) {
  const int rank = launcher_rank();
  const std::string device = device_.to_string();
  if (failure.kind == OperationWatchdog::Failure::Kind::device) {
    const std::string last = ctx_.last_operation(device_);
    std::fprintf(stderr,
                 "tessera: [rank %d] %s failed: a kernel or copy on it faulted after it was queued. This is the "
                 "device's failure, not the communication's: the %s watchdog of communicator '%s' only found it. "
                 "The last operation dispatched to %s was %s%s%s; rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the "
                 "failing kernel, and compute-sanitizer to find a bad access. Details: %s\n",
                 rank, device.c_str(), channel_->library(), name_.c_str(), device.c_str(), last.empty() ? "" : "'",
                 last.empty() ? "not recorded" : last.c_str(), last.empty() ? "" : "'", failure.report.c_str());
  } else {
    std::fprintf(stderr, "tessera: [rank %d] %s watchdog: %s\n", rank, channel_->library(), failure.report.c_str());
  }
  std::fprintf(stderr,
               "tessera: rank %d aborts %s communicator '%s' (rank %d of %d, %s) and exits; the launcher ends the "
               "job (see docs/when-things-go-wrong.md)\n",
               rank, channel_->library(), name_.c_str(), channel_->rank(), channel_->size(), device.c_str());
  std::fflush(nullptr);
  channel_->abort();
  end_process(ProcessEnd::watchdog_thread, 1);  // the program's hook: std::_Exit (apps/process_end.h)
}

std::string StreamCommunicator::where(const char* op) const {
  return detail::concat(op, " on ", channel_->library(), " communicator '", name_, "' (rank ", channel_->rank(), " of ",
                        channel_->size(), ", ", device_.to_string(), ", operation ", sequence_, ")");
}

void StreamCommunicator::check_device(const std::string& at, const char* what, const Tensor& tensor) const {
  TESSERA_CHECK(tensor.defined(), at, ": the ", what, " tensor is undefined");
  TESSERA_CHECK(tensor.device() == device_, at, ": the ", what, " tensor is on ", tensor.device().to_string(),
                ", but this communicator moves tensors on ", device_.to_string());
}

template <typename Enqueue>
CommHandle StreamCommunicator::launch(const std::string& at, std::vector<Tensor> keep, Enqueue&& enqueue) {
  bind_thread_to_device(device_);
  const Stream& compute = ctx_.compute_stream(device_);
  Event ready(device_);
  ready.record(compute);
  ready.wait(stream_);
  TESSERA_CHECK(!watchdog_->failed(), at, ": the communicator has failed: ", watchdog_->report());
  enqueue();
  auto done = std::make_shared<Event>(device_);
  done->record(stream_);
  last_done_ = done;
  watchdog_->watch(at, sequence_, timeout(), [done] {
    try {
      return done->ready();
    } catch (const Error& error) {
      if (is_device_fault(error)) throw OperationWatchdog::DeviceFault(error.what());
      throw;
    }
  });
  return std::make_unique<StreamWork>(compute, std::move(done), std::move(keep), *channel_, at);
}

CommHandle StreamCommunicator::issue_all_reduce(Tensor& tensor, ReduceOp op) {
  ++sequence_;
  const std::string at = where("all_reduce") + " " + op_name(op);
  check_device(at, "", tensor);
  return launch(at, {tensor}, [&] { channel_->all_reduce(tensor, op, stream_); });
}

CommHandle StreamCommunicator::issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  ++sequence_;
  const std::string at = where("reduce_scatter") + " " + op_name(op);
  check_device(at, "input", input);
  check_device(at, "output", output);
  TESSERA_CHECK(input.dtype() == output.dtype(), at, ": input is ", dtype_name(input.dtype()), " but output is ",
                dtype_name(output.dtype()));
  TESSERA_CHECK(input.numel() == int64_t(size()) * output.numel(), at, ": input has ", input.numel(),
                " elements, but it must have size() × output elements = ", size(), " × ", output.numel());
  return launch(at, {input, output}, [&] { channel_->reduce_scatter(input, output, op, stream_); });
}

CommHandle StreamCommunicator::issue_all_gather(const Tensor& input, Tensor& output) {
  ++sequence_;
  const std::string at = where("all_gather");
  check_device(at, "input", input);
  check_device(at, "output", output);
  TESSERA_CHECK(input.dtype() == output.dtype(), at, ": input is ", dtype_name(input.dtype()), " but output is ",
                dtype_name(output.dtype()));
  TESSERA_CHECK(output.numel() == int64_t(size()) * input.numel(), at, ": output has ", output.numel(),
                " elements, but it must have size() × input elements = ", size(), " × ", input.numel());
  return launch(at, {input, output}, [&] { channel_->all_gather(input, output, stream_); });
}

CommHandle StreamCommunicator::issue_broadcast(Tensor& tensor, int root) {
  ++sequence_;
  const std::string at = where("broadcast") + " from root " + std::to_string(root);
  check_device(at, "", tensor);
  TESSERA_CHECK(root >= 0 && root < size(), at, ": root ", root, " is not a rank of this communicator (0..", size() - 1,
                ")");
  return launch(at, {tensor}, [&] { channel_->broadcast(tensor, root, stream_); });
}

CommHandle StreamCommunicator::issue_send(const Tensor& tensor, int peer) {
  return issue_send_recv({{P2POp::Kind::send, tensor, peer}});
}

CommHandle StreamCommunicator::issue_recv(Tensor& tensor, int peer) {
  return issue_send_recv({{P2POp::Kind::recv, tensor, peer}});
}

CommHandle StreamCommunicator::issue_send_recv(const std::vector<P2POp>& ops) {
  ++sequence_;
  const std::string at =
      where(transfers_name()) + " (" + std::to_string(ops.size()) + (ops.size() == 1 ? " transfer)" : " transfers)");
  std::vector<Tensor> keep;
  for (const P2POp& op : ops) {
    check_device(at, op.kind == P2POp::Kind::send ? "send" : "recv", op.tensor);
    TESSERA_CHECK(op.peer >= 0 && op.peer < size(), at, ": peer ", op.peer, " is not a rank of this communicator (0..",
                  size() - 1, ")");
    keep.push_back(op.tensor);
  }
  return launch(at, std::move(keep), [&] { channel_->send_recv(ops, stream_); });
}

void StreamCommunicator::issue_barrier() {
  ++sequence_;
  const std::string at = where("barrier");
  Tensor token = ctx_.zeros(Shape{1}, DType::f32, device_);  // written on the compute stream: launch orders it
  CommHandle done = launch(at, {token}, [&] { channel_->all_reduce(token, ReduceOp::sum, stream_); });
  stream_.synchronize();  // the host waits (bounded by the watchdog)
  done->wait();
}

std::unique_ptr<Communicator> StreamCommunicator::split(int color, int key, const std::string& child_name) {
  ++sequence_;
  const std::string at = where("split") + " into '" + child_name + "'";
  TESSERA_CHECK(color >= 0, at, ": color ", color, " is negative; every rank must pass a colour >= 0");
  bind_thread_to_device(device_);
  Stream child_stream = Stream::create(device_);
  std::unique_ptr<CollectiveChannel> child = channel_->split(color, key, child_name, child_stream);
  auto made =
      std::make_unique<StreamCommunicator>(std::move(child), child_name, ctx_, device_, std::move(child_stream));
  made->set_timeout(timeout(), timeout_flag());
  return made;
}

}  // namespace tessera::parallel
