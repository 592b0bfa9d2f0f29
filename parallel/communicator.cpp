// The Communicator's public operations (each counted once here, whatever
// the backend: calls, bytes, and the time spent in them and in their
// handles), and helpers built on the interface alone.
#include "parallel/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/context.h"

namespace tessera::parallel {
namespace {

// Adds the time from its construction to its destruction to `seconds`.
class BlockedTime {
 public:
  explicit BlockedTime(double& seconds) : seconds_(seconds), start_(Clock::now()) {}
  ~BlockedTime() { seconds_ += std::chrono::duration<double>(Clock::now() - start_).count(); }
  BlockedTime(const BlockedTime&) = delete;
  BlockedTime& operator=(const BlockedTime&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  double& seconds_;
  Clock::time_point start_;
};

// A backend's handle whose wait(), test() and destruction (which waits for
// an unfinished operation) add their time to the communicator's counters.
// Handles do not outlive their communicator (its destructor waits for them).
class TimedWork final : public CommWork {
 public:
  TimedWork(CommHandle work, double& seconds) : work_(std::move(work)), seconds_(seconds) {}
  ~TimedWork() override {
    const BlockedTime time(seconds_);
    work_.reset();
  }
  TimedWork(const TimedWork&) = delete;
  TimedWork& operator=(const TimedWork&) = delete;

  void wait() override {
    const BlockedTime time(seconds_);
    work_->wait();
  }
  bool test() override {
    const BlockedTime time(seconds_);
    return work_->test();
  }

 private:
  CommHandle work_;
  double& seconds_;
};

}  // namespace

template <typename Issue>
CommHandle Communicator::timed(Issue&& issue) {
  const BlockedTime time(counters_.seconds);
  return std::make_unique<TimedWork>(issue(), counters_.seconds);
}

CommHandle Communicator::all_reduce(Tensor& tensor, ReduceOp op) {
  count(CommCounters::all_reduce, tensor);
  return timed([&] { return issue_all_reduce(tensor, op); });
}

CommHandle Communicator::reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  count(CommCounters::reduce_scatter, input);
  return timed([&] { return issue_reduce_scatter(input, output, op); });
}

CommHandle Communicator::all_gather(const Tensor& input, Tensor& output) {
  count(CommCounters::all_gather, output);
  return timed([&] { return issue_all_gather(input, output); });
}

CommHandle Communicator::broadcast(Tensor& tensor, int root) {
  count(CommCounters::broadcast, tensor);
  return timed([&] { return issue_broadcast(tensor, root); });
}

CommHandle Communicator::send(const Tensor& tensor, int peer) {
  count(CommCounters::send, tensor);
  return timed([&] { return issue_send(tensor, peer); });
}

CommHandle Communicator::recv(Tensor& tensor, int peer) {
  count(CommCounters::recv, tensor);
  return timed([&] { return issue_recv(tensor, peer); });
}

CommHandle Communicator::send_recv(const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops) count(op.kind == P2POp::Kind::send ? CommCounters::send : CommCounters::recv, op.tensor);
  return timed([&] { return issue_send_recv(ops); });
}

void Communicator::barrier() {
  const BlockedTime time(counters_.seconds);
  issue_barrier();
}

std::vector<std::vector<uint8_t>> all_gather_bytes(Communicator& group, Context& scratch,
                                                   const std::vector<uint8_t>& mine) {
  const int ranks = group.size();
  Tensor length = scratch.full(Shape{1}, DType::i64, double(mine.size()));
  Tensor lengths = scratch.empty(Shape{ranks}, DType::i64);
  group.all_gather(length, lengths)->wait();
  const int64_t* sizes = lengths.data<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(sizes, sizes + ranks));
  Tensor buffer = scratch.zeros(Shape{longest}, DType::u8);
  if (!mine.empty()) std::memcpy(buffer.data_ptr(), mine.data(), mine.size());
  Tensor gathered = scratch.empty(Shape{longest * ranks}, DType::u8);
  group.all_gather(buffer, gathered)->wait();
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(ranks));
  const uint8_t* all = gathered.data<uint8_t>();
  for (int r = 0; r < ranks; ++r) out[size_t(r)].assign(all + r * longest, all + r * longest + sizes[r]);
  return out;
}

}  // namespace tessera::parallel
