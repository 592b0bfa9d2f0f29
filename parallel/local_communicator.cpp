// LocalCommunicator: the Communicator of a single process without MPI
// (identity collectives, completed handles).
#include "parallel/local_communicator.h"

#include "core/error.h"

namespace tessera::parallel {
namespace {

class DoneWork final : public CommWork {
 public:
  void wait() override {}
  bool test() override { return true; }
};

CommHandle done() {
  return std::make_unique<DoneWork>();
}

// output = input unless they are the same memory.
void copy_unless_same(const Tensor& input, Tensor& output, const char* op) {
  TESSERA_CHECK(input.numel() == output.numel() && input.dtype() == output.dtype(), op,
                " on a group of one: input and output must have the same size and dtype, got ", input.numel(), " ",
                dtype_name(input.dtype()), " and ", output.numel(), " ", dtype_name(output.dtype()));
  if (input.numel() == 0 || (input.shares_storage_with(output) && input.offset_bytes() == output.offset_bytes()))
    return;
  output.copy_(input);
}

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(std::string name) : name_(std::move(name)) {}

  const std::string& name() const override { return name_; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  uint64_t sequence() const override { return sequence_; }
  std::unique_ptr<Communicator> split(int, int, const std::string& name) override {
    ++sequence_;
    return std::make_unique<LocalCommunicator>(name);
  }

 private:
  CommHandle issue_all_reduce(Tensor&, ReduceOp) override {
    ++sequence_;
    return done();
  }
  CommHandle issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp) override {
    ++sequence_;
    copy_unless_same(input, output, "reduce_scatter");
    return done();
  }
  CommHandle issue_all_gather(const Tensor& input, Tensor& output) override {
    ++sequence_;
    copy_unless_same(input, output, "all_gather");
    return done();
  }
  CommHandle issue_broadcast(Tensor&, int root) override {
    TESSERA_CHECK(root == 0, "broadcast on '", name_, "' (a group of one): root ", root, " does not exist");
    ++sequence_;
    return done();
  }
  CommHandle issue_send(const Tensor&, int peer) override {
    TESSERA_THROW("send on '", name_, "' (a group of one, no MPI): there is no peer ", peer);
  }
  CommHandle issue_recv(Tensor&, int peer) override {
    TESSERA_THROW("recv on '", name_, "' (a group of one, no MPI): there is no peer ", peer);
  }
  CommHandle issue_send_recv(const std::vector<P2POp>& ops) override {
    TESSERA_CHECK(ops.empty(), "send_recv on '", name_, "' (a group of one, no MPI): there is no peer ",
                  ops.front().peer);
    ++sequence_;
    return done();
  }
  void issue_barrier() override { ++sequence_; }

  std::string name_;
  uint64_t sequence_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(const std::string& name) {
  return std::make_unique<LocalCommunicator>(name);
}

}  // namespace tessera::parallel
