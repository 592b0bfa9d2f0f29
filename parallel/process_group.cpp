// Choosing a communicator's backend, and the communicator that routes each
// call to the device channel (NCCL; the emulated channel on emu:N) or MPI by
// the tensor's device (CommBackend::automatic on an accelerator).
#include "parallel/process_group.h"

#include "core/error.h"
#include "parallel/mpi_communicator.h"

namespace tessera::parallel {
namespace {

// Device tensors through the device channel, host tensors through MPI; both
// communicators span the same ranks in the same order and never match each
// other's traffic, so the two sides of every transfer must agree on where the
// tensor lives (a device tensor sent to a host buffer waits forever). The
// emulated accelerator routes the same way, which is how the CPU tests catch
// a mismatch. Host-side operations (barrier, poll) are MPI's.
class DeviceRoutedCommunicator final : public Communicator {
 public:
  DeviceRoutedCommunicator(std::unique_ptr<Communicator> mpi, std::unique_ptr<Communicator> device)
      : mpi_(std::move(mpi)), device_(std::move(device)) {}

  const std::string& name() const override { return mpi_->name(); }
  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }

 private:
  CommHandle issue_all_reduce(Tensor& tensor, ReduceOp op) override {
    ++sequence_;
    return route(tensor).all_reduce(tensor, op);
  }
  CommHandle issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    ++sequence_;
    return route(input).reduce_scatter(input, output, op);
  }
  CommHandle issue_all_gather(const Tensor& input, Tensor& output) override {
    ++sequence_;
    return route(input).all_gather(input, output);
  }
  CommHandle issue_broadcast(Tensor& tensor, int root) override {
    ++sequence_;
    return route(tensor).broadcast(tensor, root);
  }
  CommHandle issue_send(const Tensor& tensor, int peer) override {
    ++sequence_;
    return route(tensor).send(tensor, peer);
  }
  CommHandle issue_recv(Tensor& tensor, int peer) override {
    ++sequence_;
    return route(tensor).recv(tensor, peer);
  }
  CommHandle issue_send_recv(const std::vector<P2POp>& ops) override {
    ++sequence_;
    if (ops.empty()) return mpi_->send_recv(ops);
    Communicator& backend = route(ops.front().tensor);
    for (const P2POp& op : ops)
      TESSERA_CHECK(&route(op.tensor) == &backend, "send_recv on communicator '", name(), "' (rank ", rank(),
                    "): one group mixes host and device tensors; issue one send_recv per device kind");
    return backend.send_recv(ops);
  }
  void issue_barrier() override {
    ++sequence_;
    mpi_->barrier();
  }

 public:
  void poll() override { mpi_->poll(); }
  void set_activity(RankActivity activity, int64_t step) override { mpi_->set_activity(activity, step); }
  void set_silence_limit(double seconds, const std::string& flag) override {
    Communicator::set_silence_limit(seconds, flag);
    mpi_->set_silence_limit(seconds, flag);
  }
  void heartbeat() override { mpi_->heartbeat(); }
  void set_timeout(double seconds, const std::string& flag = "--comm-timeout") override {
    Communicator::set_timeout(seconds, flag);
    mpi_->set_timeout(seconds, flag);
    device_->set_timeout(seconds, flag);
  }
  uint64_t sequence() const override { return sequence_; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& child_name) override {
    ++sequence_;
    auto mpi = mpi_->split(color, key, child_name);
    auto device = device_->split(color, key, child_name);
    auto child = std::make_unique<DeviceRoutedCommunicator>(std::move(mpi), std::move(device));
    child->set_timeout(timeout(), timeout_flag());
    return child;
  }

 private:
  Communicator& route(const Tensor& tensor) {
    return tensor.defined() && tensor.device().is_accelerator() ? *device_ : *mpi_;
  }

  std::unique_ptr<Communicator> mpi_, device_;
  uint64_t sequence_ = 0;
};

}  // namespace

CommBackend parse_comm_backend(std::string_view text) {
  if (text == "auto" || text == "automatic") return CommBackend::automatic;
  if (text == "mpi") return CommBackend::mpi;
  if (text == "nccl") return CommBackend::nccl;
  TESSERA_THROW("--comm-backend '", text, "' is not a communication backend; use auto, mpi or nccl");
}

std::string_view comm_backend_name(CommBackend backend) {
  switch (backend) {
    case CommBackend::automatic:
      return "auto";
    case CommBackend::mpi:
      return "mpi";
    case CommBackend::nccl:
      return "nccl";
  }
  return "?";
}

std::unique_ptr<Communicator> make_device_communicator(MPI_Comm comm, const std::string& name, Context& ctx,
                                                       Device device) {
  if (device.is_emulated()) return make_emulated_communicator(comm, name, ctx, device);
  return make_nccl_communicator(comm, name, ctx, device);
}

std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, const std::string& name, Context& ctx, Device device,
                                                CommBackend backend) {
  switch (backend) {
    case CommBackend::mpi:
      return make_mpi_communicator(comm, name);
    case CommBackend::nccl:
      if (device.is_emulated()) break;
      TESSERA_CHECK(nccl_compiled(), "--comm-backend nccl: this Tessera was built without the CUDA backend, so ",
                    "without NCCL; use --comm-backend mpi (or auto), or rebuild with -DTESSERA_CUDA=ON");
      TESSERA_CHECK(device.is_cuda(), "--comm-backend nccl moves CUDA tensors, but communicator '", name, "' is for ",
                    device.to_string(), "; use --device cuda, or --comm-backend mpi");
      break;
    case CommBackend::automatic:
      if (!device.is_emulated() && !(device.is_cuda() && nccl_compiled())) return make_mpi_communicator(comm, name);
      break;
  }
  return std::make_unique<DeviceRoutedCommunicator>(make_mpi_communicator(comm, name),
                                                    make_device_communicator(comm, name, ctx, device));
}

}  // namespace tessera::parallel
