// Choosing a communicator's backend, and the communicator that routes each
// call to NCCL or MPI by the tensor's device (CommBackend::automatic on a GPU).
#include "parallel/process_group.h"

#include "core/error.h"
#include "parallel/mpi_communicator.h"

namespace tessera::parallel {
namespace {

// CUDA tensors through NCCL, host tensors through MPI; both communicators span
// the same ranks in the same order. Host-side operations (barrier, poll) are MPI's.
class DeviceRoutedCommunicator final : public Communicator {
 public:
  DeviceRoutedCommunicator(std::unique_ptr<Communicator> mpi, std::unique_ptr<Communicator> nccl)
      : mpi_(std::move(mpi)), nccl_(std::move(nccl)) {}

  const std::string& name() const override { return mpi_->name(); }
  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }

  CommHandle all_reduce(Tensor& tensor, ReduceOp op) override {
    ++sequence_;
    count(CommCounters::all_reduce, tensor);
    return route(tensor).all_reduce(tensor, op);
  }
  CommHandle reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    ++sequence_;
    count(CommCounters::reduce_scatter, input);
    return route(input).reduce_scatter(input, output, op);
  }
  CommHandle all_gather(const Tensor& input, Tensor& output) override {
    ++sequence_;
    count(CommCounters::all_gather, output);
    return route(input).all_gather(input, output);
  }
  CommHandle broadcast(Tensor& tensor, int root) override {
    ++sequence_;
    count(CommCounters::broadcast, tensor);
    return route(tensor).broadcast(tensor, root);
  }
  CommHandle send(const Tensor& tensor, int peer) override {
    ++sequence_;
    count(CommCounters::send, tensor);
    return route(tensor).send(tensor, peer);
  }
  CommHandle recv(Tensor& tensor, int peer) override {
    ++sequence_;
    count(CommCounters::recv, tensor);
    return route(tensor).recv(tensor, peer);
  }
  CommHandle send_recv(const std::vector<P2POp>& ops) override {
    ++sequence_;
    count(ops);
    if (ops.empty()) return mpi_->send_recv(ops);
    Communicator& backend = route(ops.front().tensor);
    for (const P2POp& op : ops)
      TESSERA_CHECK(&route(op.tensor) == &backend, "send_recv on communicator '", name(), "' (rank ", rank(),
                    "): one group mixes host and CUDA tensors; issue one send_recv per device kind");
    return backend.send_recv(ops);
  }
  void barrier() override {
    ++sequence_;
    mpi_->barrier();
  }
  void poll() override { mpi_->poll(); }
  void set_timeout(double seconds) override {
    Communicator::set_timeout(seconds);
    mpi_->set_timeout(seconds);
    nccl_->set_timeout(seconds);
  }
  uint64_t sequence() const override { return sequence_; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& child_name) override {
    ++sequence_;
    auto mpi = mpi_->split(color, key, child_name);
    auto nccl = nccl_->split(color, key, child_name);
    auto child = std::make_unique<DeviceRoutedCommunicator>(std::move(mpi), std::move(nccl));
    child->set_timeout(timeout());
    return child;
  }

 private:
  Communicator& route(const Tensor& tensor) { return tensor.defined() && tensor.device().is_cuda() ? *nccl_ : *mpi_; }

  std::unique_ptr<Communicator> mpi_, nccl_;
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

std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, const std::string& name, Context& ctx, Device device,
                                                CommBackend backend) {
  switch (backend) {
    case CommBackend::mpi:
      return make_mpi_communicator(comm, name);
    case CommBackend::nccl:
      TESSERA_CHECK(nccl_compiled(), "--comm-backend nccl: this Tessera was built without the CUDA backend, so ",
                    "without NCCL; use --comm-backend mpi (or auto), or rebuild with -DTESSERA_CUDA=ON");
      TESSERA_CHECK(device.is_cuda(), "--comm-backend nccl moves CUDA tensors, but communicator '", name, "' is for ",
                    device.to_string(), "; use --device cuda, or --comm-backend mpi");
      return make_nccl_communicator(comm, name, ctx, device);
    case CommBackend::automatic:
      break;
  }
  if (!device.is_cuda() || !nccl_compiled()) return make_mpi_communicator(comm, name);
  auto mpi = make_mpi_communicator(comm, name);
  auto nccl = make_nccl_communicator(comm, name, ctx, device);
  return std::make_unique<DeviceRoutedCommunicator>(std::move(mpi), std::move(nccl));
}

}  // namespace tessera::parallel
