// NcclCommunicator: NCCL collectives and point-to-point transfers on CUDA
// tensors, on the communicator's own stream, ordered against the compute
// stream by events (see nccl_communicator.h); the NCCL backend's factory.
#include "parallel/cuda/nccl_communicator.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <utility>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "parallel/cuda/nccl_check.h"
#include "parallel/mpi_check.h"
#include "parallel/process_group.h"

namespace tessera::parallel {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
  }
  return ncclSum;
}

const char* op_name(ReduceOp op) {
  return op == ReduceOp::sum ? "sum" : op == ReduceOp::avg ? "avg" : "max";
}

// Throws when NCCL has reported an asynchronous error on `comm` (a peer
// failed, a network error, ...).
void check_async(ncclComm_t comm, const std::string& at) {
  ncclResult_t async = ncclSuccess;
  TESSERA_NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
  TESSERA_CHECK(async == ncclSuccess || async == ncclInProgress, at,
                ": NCCL reported an asynchronous error: ", ncclGetErrorString(async), " (", ncclGetLastError(comm),
                ")");
}

// One NCCL operation in flight: the "done" event on the communication stream.
class NcclWork final : public CommWork {
 public:
  NcclWork(const Stream& compute, std::shared_ptr<const Event> done, std::vector<Tensor> keep, ncclComm_t comm,
           std::string where)
      : compute_(compute), done_(std::move(done)), keep_(std::move(keep)), comm_(comm), where_(std::move(where)) {}
  ~NcclWork() override {
    if (waited_) return;
    try {
      wait();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "tessera: an unwaited NCCL operation failed while its handle was destroyed: %s\n",
                   error.what());
    }
  }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  // The compute stream waits for the operation; the host does not.
  void wait() override {
    if (waited_) return;
    check_async(comm_, where_);
    done_->wait(compute_);
    waited_ = true;
    keep_.clear();  // later work on the compute stream is ordered after the operation
  }

  bool test() override {
    if (waited_) return done_->ready();
    check_async(comm_, where_);
    return done_->ready();
  }

 private:
  const Stream& compute_;
  std::shared_ptr<const Event> done_;  // shared with the watchdog
  std::vector<Tensor> keep_;
  ncclComm_t comm_;
  std::string where_;
  bool waited_ = false;
};

// Ends an NCCL group even when a call inside it throws.
class GroupGuard {
 public:
  GroupGuard() { TESSERA_NCCL_CHECK(ncclGroupStart()); }
  ~GroupGuard() {
    if (open_) ncclGroupEnd();
  }
  GroupGuard(const GroupGuard&) = delete;
  GroupGuard& operator=(const GroupGuard&) = delete;
  void end() {
    open_ = false;
    TESSERA_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

struct Bootstrap {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1;
};

// Rank 0 makes the unique id; MPI_Bcast hands it (and whether it exists) to
// every rank; all call ncclCommInitRank on `device`.
Bootstrap bootstrap(MPI_Comm comm, const std::string& name, Device device) {
  TESSERA_CHECK(device.is_cuda(), "NCCL communicator '", name, "' needs a CUDA device, not ", device.to_string());
  Bootstrap out;
  TESSERA_MPI_CHECK(MPI_Comm_rank(comm, &out.rank));
  TESSERA_MPI_CHECK(MPI_Comm_size(comm, &out.size));
  struct {
    int ok = 0;
    ncclUniqueId id{};
  } shared;
  if (out.rank == 0) {
    // Rank 0 must still take part in the broadcast when making the id fails,
    // or every other rank would wait for it forever.
    cuda_runtime::set_device(device.index);
    shared.ok = ncclGetUniqueId(&shared.id) == ncclSuccess ? 1 : 0;
  }
  TESSERA_MPI_CHECK(MPI_Bcast(&shared, int(sizeof shared), MPI_BYTE, 0, comm));
  TESSERA_CHECK(shared.ok, "NCCL communicator '", name, "': rank 0 could not make an ncclUniqueId (",
                out.rank == 0 ? ncclGetLastError(nullptr) : "see rank 0's error",
                "); check NCCL_SOCKET_IFNAME and that rank 0 has a usable network interface");
  cuda_runtime::set_device(device.index);
  TESSERA_NCCL_CHECK(ncclCommInitRank(&out.comm, out.size, shared.id, out.rank));
  return out;
}

}  // namespace

NcclCommunicator::OwnedComm::~OwnedComm() {
  const ncclComm_t comm = comm_.exchange(nullptr);
  if (!comm) return;
  ncclResult_t async = ncclSuccess;
  if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess &&
      ncclCommFinalize(comm) == ncclSuccess) {
    ncclCommDestroy(comm);
  } else {
    ncclCommAbort(comm);  // a failed communicator cannot be finalised
  }
}

void NcclCommunicator::OwnedComm::abort() {
  if (const ncclComm_t comm = comm_.exchange(nullptr)) ncclCommAbort(comm);
}

NcclCommunicator::NcclCommunicator(MPI_Comm comm, std::string name, Context& ctx, Device device)
    : ctx_(ctx), device_(device), name_(std::move(name)), stream_(Stream::create(device)), comm_([&] {
        const Bootstrap b = bootstrap(comm, name_, device);
        rank_ = b.rank;
        size_ = b.size;
        return b.comm;
      }()) {
  start_watchdog();
}

NcclCommunicator::NcclCommunicator(ncclComm_t adopted, std::string name, Context& ctx, Device device)
    : ctx_(ctx), device_(device), name_(std::move(name)), stream_(Stream::create(device)), comm_(adopted) {
  TESSERA_NCCL_CHECK(ncclCommUserRank(adopted, &rank_));
  TESSERA_NCCL_CHECK(ncclCommCount(adopted, &size_));
  start_watchdog();
}

void NcclCommunicator::start_watchdog() {
  const auto health = [this] {
    const ncclComm_t comm = comm_.get();
    ncclResult_t async = ncclSuccess;
    if (!comm || ncclCommGetAsyncError(comm, &async) != ncclSuccess) return std::string();
    if (async == ncclSuccess || async == ncclInProgress) return std::string();
    return std::string(ncclGetErrorString(async)) + " (" + ncclGetLastError(comm) + ")";
  };
  watchdog_ =
      std::make_unique<OperationWatchdog>(name_, health, [this](const std::string& report) { fail_and_exit(report); });
}

// Not MPI_Abort: MPI runs MPI_THREAD_FUNNELED and this is the watchdog's
// thread, while the main thread may be blocked in a CUDA call for good. A
// rank that exits without MPI_Finalize makes mpirun (and srun
// --kill-on-bad-exit, as slurm/ launches) end the whole job.
void NcclCommunicator::fail_and_exit(const std::string& report) {
  const int rank = launcher_rank();
  std::fprintf(stderr,
               "tessera: [rank %d] NCCL watchdog: %s\n"
               "tessera: rank %d aborts NCCL communicator '%s' (rank %d of %d, %s) and exits; the launcher ends the "
               "job (see docs/when-things-go-wrong.md)\n",
               rank, report.c_str(), rank, name_.c_str(), rank_, size_, device_.to_string().c_str());
  std::fflush(nullptr);
  comm_.abort();
  std::_Exit(1);
}

std::string NcclCommunicator::where(const char* op) const {
  return detail::concat(op, " on NCCL communicator '", name_, "' (rank ", rank_, " of ", size_, ", ",
                        device_.to_string(), ", operation ", sequence_, ")");
}

void NcclCommunicator::check_device(const std::string& at, const char* what, const Tensor& tensor) const {
  TESSERA_CHECK(tensor.defined(), at, ": the ", what, " tensor is undefined");
  TESSERA_CHECK(tensor.device() == device_, at, ": the ", what, " tensor is on ", tensor.device().to_string(),
                ", but this communicator moves tensors on ", device_.to_string());
}

template <typename Enqueue>
CommHandle NcclCommunicator::launch(const std::string& at, std::vector<Tensor> keep, Enqueue&& enqueue) {
  cuda_runtime::set_device(device_.index);
  const Stream& compute = ctx_.compute_stream(device_);
  Event ready(device_);
  ready.record(compute);
  ready.wait(stream_);
  TESSERA_CHECK(!watchdog_->failed(), at, ": the communicator has failed: ", watchdog_->report());
  enqueue(static_cast<cudaStream_t>(stream_.native_handle()));
  auto done = std::make_shared<Event>(device_);
  done->record(stream_);
  watchdog_->watch(at, sequence_, timeout(), [done] { return done->ready(); });
  return std::make_unique<NcclWork>(compute, std::move(done), std::move(keep), comm_.get(), at);
}

CommHandle NcclCommunicator::all_reduce(Tensor& tensor, ReduceOp op) {
  ++sequence_;
  count(CommCounters::all_reduce, tensor);
  const std::string at = where("all_reduce") + " " + op_name(op);
  check_device(at, "", tensor);
  return launch(at, {tensor}, [&](cudaStream_t stream) {
    TESSERA_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()),
                                     nccl_type(tensor.dtype()), nccl_op(op), comm_.get(), stream));
  });
}

CommHandle NcclCommunicator::reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  ++sequence_;
  count(CommCounters::reduce_scatter, input);
  const std::string at = where("reduce_scatter") + " " + op_name(op);
  check_device(at, "input", input);
  check_device(at, "output", output);
  TESSERA_CHECK(input.dtype() == output.dtype(), at, ": input is ", dtype_name(input.dtype()), " but output is ",
                dtype_name(output.dtype()));
  TESSERA_CHECK(input.numel() == int64_t(size_) * output.numel(), at, ": input has ", input.numel(),
                " elements, but it must have size() × output elements = ", size_, " × ", output.numel());
  return launch(at, {input, output}, [&](cudaStream_t stream) {
    TESSERA_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), size_t(output.numel()),
                                         nccl_type(input.dtype()), nccl_op(op), comm_.get(), stream));
  });
}

CommHandle NcclCommunicator::all_gather(const Tensor& input, Tensor& output) {
  ++sequence_;
  count(CommCounters::all_gather, output);
  const std::string at = where("all_gather");
  check_device(at, "input", input);
  check_device(at, "output", output);
  TESSERA_CHECK(input.dtype() == output.dtype(), at, ": input is ", dtype_name(input.dtype()), " but output is ",
                dtype_name(output.dtype()));
  TESSERA_CHECK(output.numel() == int64_t(size_) * input.numel(), at, ": output has ", output.numel(),
                " elements, but it must have size() × input elements = ", size_, " × ", input.numel());
  return launch(at, {input, output}, [&](cudaStream_t stream) {
    TESSERA_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), size_t(input.numel()),
                                     nccl_type(input.dtype()), comm_.get(), stream));
  });
}

CommHandle NcclCommunicator::broadcast(Tensor& tensor, int root) {
  ++sequence_;
  count(CommCounters::broadcast, tensor);
  const std::string at = where("broadcast") + " from root " + std::to_string(root);
  check_device(at, "", tensor);
  TESSERA_CHECK(root >= 0 && root < size_, at, ": root ", root, " is not a rank of this communicator (0..", size_ - 1,
                ")");
  return launch(at, {tensor}, [&](cudaStream_t stream) {
    TESSERA_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()),
                                     nccl_type(tensor.dtype()), root, comm_.get(), stream));
  });
}

CommHandle NcclCommunicator::send(const Tensor& tensor, int peer) {
  return send_recv({{P2POp::Kind::send, tensor, peer}});
}

CommHandle NcclCommunicator::recv(Tensor& tensor, int peer) {
  return send_recv({{P2POp::Kind::recv, tensor, peer}});
}

CommHandle NcclCommunicator::send_recv(const std::vector<P2POp>& ops) {
  ++sequence_;
  count(ops);
  const std::string at =
      where("send_recv") + " (" + std::to_string(ops.size()) + (ops.size() == 1 ? " transfer)" : " transfers)");
  std::vector<Tensor> keep;
  for (const P2POp& op : ops) {
    check_device(at, op.kind == P2POp::Kind::send ? "send" : "recv", op.tensor);
    TESSERA_CHECK(op.peer >= 0 && op.peer < size_, at, ": peer ", op.peer, " is not a rank of this communicator (0..",
                  size_ - 1, ")");
    keep.push_back(op.tensor);
  }
  return launch(at, std::move(keep), [&](cudaStream_t stream) {
    GroupGuard group;
    for (const P2POp& op : ops) {
      const size_t count = size_t(op.tensor.numel());
      if (op.kind == P2POp::Kind::send)
        TESSERA_NCCL_CHECK(
            ncclSend(op.tensor.data_ptr(), count, nccl_type(op.tensor.dtype()), op.peer, comm_.get(), stream));
      else
        TESSERA_NCCL_CHECK(
            ncclRecv(op.tensor.data_ptr(), count, nccl_type(op.tensor.dtype()), op.peer, comm_.get(), stream));
    }
    group.end();
  });
}

void NcclCommunicator::barrier() {
  ++sequence_;
  const std::string at = where("barrier");
  Tensor token = ctx_.zeros(Shape{1}, DType::f32, device_);  // written on the compute stream: launch orders it
  CommHandle done = launch(at, {token}, [&](cudaStream_t stream) {
    TESSERA_NCCL_CHECK(ncclAllReduce(token.data_ptr(), token.data_ptr(), 1, ncclFloat32, ncclSum, comm_.get(), stream));
  });
  stream_.synchronize();  // the host waits (bounded by the watchdog)
  done->wait();
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  ++sequence_;
  const std::string at = where("split") + " into '" + name + "'";
  TESSERA_CHECK(color >= 0, at, ": color ", color, " is negative; every rank must pass a colour >= 0");
  cuda_runtime::set_device(device_.index);
  ncclComm_t child = nullptr;
  TESSERA_NCCL_CHECK(ncclCommSplit(comm_.get(), color, key, &child, nullptr));
  std::unique_ptr<Communicator> made(new NcclCommunicator(child, name, ctx_, device_));
  made->set_timeout(timeout());
  return made;
}

bool nccl_compiled() {
  return true;
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                     Device device) {
  TESSERA_CHECK(device.is_cuda() && device.index < ctx.cuda_device_count(), "NCCL communicator '", name, "' for ",
                device.to_string(), ": this process sees ", ctx.cuda_device_count(),
                " CUDA device(s); use --comm-backend mpi, or check CUDA_VISIBLE_DEVICES");
  return std::make_unique<NcclCommunicator>(comm, name, ctx, device);
}

}  // namespace tessera::parallel
