// The Communicator's public operations (each counted once here, whatever
// the backend: calls, bytes, and the time spent in them and in their
// handles), and helpers built on the interface alone.
#include "parallel/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

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

CommHandle Communicator::all_to_all(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                                    const std::vector<int64_t>& recv_counts) {
  const int ranks = size(), me = rank();
  const std::string at = "all_to_all on '" + name() + "' (rank " + std::to_string(me) + ")";
  TESSERA_CHECK(int(send_counts.size()) == ranks && int(recv_counts.size()) == ranks, at, ": ", send_counts.size(),
                " send and ", recv_counts.size(), " receive counts for a group of ", ranks, " ranks");
  const auto offsets = [&](const std::vector<int64_t>& counts, const Tensor& buffer, const char* which) {
    std::vector<int64_t> begin(size_t(ranks) + 1, 0);
    for (int r = 0; r < ranks; ++r) {
      TESSERA_CHECK(counts[size_t(r)] >= 0, at, ": a negative ", which, " count for rank ", r);
      begin[size_t(r) + 1] = begin[size_t(r)] + counts[size_t(r)];
    }
    TESSERA_CHECK(begin.back() == buffer.numel(), at, ": the ", which, " counts add up to ", begin.back(),
                  " elements, the ", which == std::string("send") ? "input" : "output", " holds ", buffer.numel());
    return begin;
  };
  const std::vector<int64_t> sent = offsets(send_counts, input, "send"), received = offsets(recv_counts, output, "receive");
  TESSERA_CHECK(input.dtype() == output.dtype(), at, ": the input is ", dtype_name(input.dtype()), ", the output ",
                dtype_name(output.dtype()));
  TESSERA_CHECK(send_counts[size_t(me)] == recv_counts[size_t(me)], at, ": this rank sends itself ",
                send_counts[size_t(me)], " elements but expects ", recv_counts[size_t(me)]);
  const Tensor from = input.flatten();
  Tensor into = output.flatten();
  std::vector<P2POp> ops;
  for (int r = 0; r < ranks; ++r) {
    if (r == me) continue;
    if (recv_counts[size_t(r)] > 0)
      ops.push_back({P2POp::Kind::recv, into.slice(received[size_t(r)], received[size_t(r) + 1]), r});
    if (send_counts[size_t(r)] > 0)
      ops.push_back({P2POp::Kind::send, from.slice(sent[size_t(r)], sent[size_t(r) + 1]), r});
  }
  if (send_counts[size_t(me)] > 0) {
    Tensor own = into.slice(received[size_t(me)], received[size_t(me) + 1]);
    own.copy_(from.slice(sent[size_t(me)], sent[size_t(me) + 1]));
  }
  // Reports name the exchange all_to_all (a stalled rank is found in it, not in a send_recv).
  struct Named {
    const char*& name;
    ~Named() { name = "send_recv"; }
  } named{transfers_name_ = "all_to_all"};
  return send_recv(ops);
}

std::vector<int64_t> all_to_all_counts(Communicator& group, const std::vector<int64_t>& send_counts, Context& scratch,
                                       Device device) {
  const int64_t ranks = group.size();
  Tensor mine = scratch.from_vector(Shape{ranks}, send_counts, device);
  Tensor theirs = scratch.empty(Shape{ranks}, DType::i64, device);
  group.all_to_all(mine, std::vector<int64_t>(size_t(ranks), 1), theirs, std::vector<int64_t>(size_t(ranks), 1))
      ->wait();
  return theirs.to_vector<int64_t>();
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
