// NcclChannel: the CollectiveChannel of CUDA devices, through NCCL (CUDA
// builds only), and the NCCL backend's factory. The stream communicator
// (parallel/stream_communicator.h) owns the streams, events, handles,
// watchdog and teardown rules; this file only speaks NCCL.
//
//   - Bootstrap: rank 0 of the MPI communicator makes the ncclUniqueId,
//     MPI_Bcast hands it out, every rank calls ncclCommInitRank. split() uses
//     ncclCommSplit (no new bootstrap).
//   - bf16, f16, f32, i32, i64 and u8 natively (NCCL reduces in the element
//     type, so 16-bit sums are rounded step by step, unlike the MPI backend's
//     f32 reductions); avg is ncclAvg (a u8 avg divides the wrapped sum).
//   - send_recv groups its transfers with ncclGroupStart/ncclGroupEnd.
//   - The ncclComm_t is finalised and destroyed when the communicator's work
//     has drained, aborted otherwise (abort may come from the watchdog's
//     thread, so the handle is atomic).
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <memory>
#include <utility>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "parallel/cuda/nccl_check.h"
#include "parallel/mpi_check.h"
#include "parallel/process_group.h"
#include "parallel/stream_communicator.h"

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

cudaStream_t native(const Stream& stream) {
  return static_cast<cudaStream_t>(stream.native_handle());
}

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

// Rank 0 makes the unique id; MPI_Bcast hands it (and whether it exists) to
// every rank; all call ncclCommInitRank on `device`.
ncclComm_t bootstrap(MPI_Comm comm, const std::string& name, Device device) {
  TESSERA_CHECK(device.is_cuda(), "NCCL communicator '", name, "' needs a CUDA device, not ", device.to_string());
  int rank = 0, size = 1;
  TESSERA_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  TESSERA_MPI_CHECK(MPI_Comm_size(comm, &size));
  struct {
    int ok = 0;
    ncclUniqueId id{};
  } shared;
  if (rank == 0) {
    // Rank 0 must still take part in the broadcast when making the id fails,
    // or every other rank would wait for it forever.
    cuda_runtime::set_device(device.index);
    shared.ok = ncclGetUniqueId(&shared.id) == ncclSuccess ? 1 : 0;
  }
  TESSERA_MPI_CHECK(MPI_Bcast(&shared, int(sizeof shared), MPI_BYTE, 0, comm));
  TESSERA_CHECK(shared.ok, "NCCL communicator '", name, "': rank 0 could not make an ncclUniqueId (",
                rank == 0 ? ncclGetLastError(nullptr) : "see rank 0's error",
                "); check NCCL_SOCKET_IFNAME and that rank 0 has a usable network interface");
  cuda_runtime::set_device(device.index);
  ncclComm_t made = nullptr;
  TESSERA_NCCL_CHECK(ncclCommInitRank(&made, size, shared.id, rank));
  return made;
}

class NcclChannel final : public CollectiveChannel {
 public:
  NcclChannel(ncclComm_t comm, Device device) : comm_(comm), device_(device) {
    TESSERA_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
    TESSERA_NCCL_CHECK(ncclCommCount(comm, &size_));
  }
  ~NcclChannel() override { abort(); }  // finalize() or abort() came first; this only covers a throw in between
  NcclChannel(const NcclChannel&) = delete;
  NcclChannel& operator=(const NcclChannel&) = delete;

  const char* library() const override { return "NCCL"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(Tensor& tensor, ReduceOp op, const Stream& stream) override {
    TESSERA_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()),
                                     nccl_type(tensor.dtype()), nccl_op(op), comm(), native(stream)));
  }
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const Stream& stream) override {
    TESSERA_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), size_t(output.numel()),
                                         nccl_type(input.dtype()), nccl_op(op), comm(), native(stream)));
  }
  void all_gather(const Tensor& input, Tensor& output, const Stream& stream) override {
    TESSERA_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), size_t(input.numel()),
                                     nccl_type(input.dtype()), comm(), native(stream)));
  }
  void broadcast(Tensor& tensor, int root, const Stream& stream) override {
    TESSERA_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()),
                                     nccl_type(tensor.dtype()), root, comm(), native(stream)));
  }
  void send_recv(const std::vector<P2POp>& ops, const Stream& stream) override {
    GroupGuard group;
    for (const P2POp& op : ops) {
      const size_t count = size_t(op.tensor.numel());
      if (op.kind == P2POp::Kind::send)
        TESSERA_NCCL_CHECK(
            ncclSend(op.tensor.data_ptr(), count, nccl_type(op.tensor.dtype()), op.peer, comm(), native(stream)));
      else
        TESSERA_NCCL_CHECK(
            ncclRecv(op.tensor.data_ptr(), count, nccl_type(op.tensor.dtype()), op.peer, comm(), native(stream)));
    }
    group.end();
  }

  std::string async_error() override {
    const ncclComm_t c = comm_.load();
    if (!c) return "the communicator was aborted";
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(c, &async) != ncclSuccess) return "ncclCommGetAsyncError failed";
    if (async == ncclSuccess || async == ncclInProgress) return "";
    return std::string(ncclGetErrorString(async)) + " (" + ncclGetLastError(c) + ")";
  }

  void abort() noexcept override {
    if (const ncclComm_t c = comm_.exchange(nullptr)) ncclCommAbort(c);
  }

  // Called once the communicator's stream has drained: nothing is in flight,
  // so ncclCommFinalize has nothing to wait for.
  void finalize() noexcept override {
    const ncclComm_t c = comm_.exchange(nullptr);
    if (!c) return;
    if (ncclCommFinalize(c) == ncclSuccess)
      ncclCommDestroy(c);
    else
      ncclCommAbort(c);
  }

  std::unique_ptr<CollectiveChannel> split(int color, int key, const std::string&, const Stream&) override {
    cuda_runtime::set_device(device_.index);
    ncclComm_t child = nullptr;
    TESSERA_NCCL_CHECK(ncclCommSplit(comm(), color, key, &child, nullptr));
    return std::make_unique<NcclChannel>(child, device_);
  }

 private:
  ncclComm_t comm() const {
    const ncclComm_t c = comm_.load();
    TESSERA_CHECK(c != nullptr, "NCCL communicator on ", device_.to_string(), " was aborted");
    return c;
  }

  std::atomic<ncclComm_t> comm_;
  Device device_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool nccl_compiled() {
  return true;
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                     Device device) {
  TESSERA_CHECK(device.is_cuda() && device.index < ctx.cuda_device_count(), "NCCL communicator '", name, "' for ",
                device.to_string(), ": this process sees ", ctx.cuda_device_count(),
                " CUDA device(s); use --comm-backend mpi, or check CUDA_VISIBLE_DEVICES");
  cuda_runtime::set_device(device.index);
  Stream stream = Stream::create(device);
  auto channel = std::make_unique<NcclChannel>(bootstrap(comm, name, device), device);
  return std::make_unique<StreamCommunicator>(std::move(channel), name, ctx, device, std::move(stream));
}

}  // namespace tessera::parallel
