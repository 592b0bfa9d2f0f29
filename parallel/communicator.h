// Communicator: collectives and point-to-point transfers on tensors among the
// ranks of one group (the world, or one axis of the process grid). Counts are
// in elements and the datatype comes from the tensor. Every call is
// asynchronous and returns a handle to wait on; every call gets a sequence
// number and carries the group's name, so a stalled one can be named.
//
// Backends (chosen by which files CMake compiles, and at run time by the
// tensors' device unless overridden):
//   - MPI: host tensors through nonblocking MPI calls (MPI_Iallreduce, ...);
//     device tensors through host staging when NCCL is not available. MPI
//     progresses only inside MPI calls: poll() (called by the data-parallel
//     reducer as gradients become ready) keeps outstanding operations moving.
//   - NCCL: device tensors on the communicator's own stream, ordered after
//     the compute stream by events (no device-wide syncs).
// A group of size 1 is the identity and costs nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace tessera::parallel {

enum class ReduceOp { sum, avg, max };

// What a rank is busy with outside communication, so that ranks waiting on it
// past their deadline can say so (a rank writing a checkpoint is not stalled).
enum class RankActivity { none, writing_checkpoint };

// A communication in flight. wait() blocks until it completes (rethrowing
// its error); test() returns whether it has completed, making progress.
// Destroying an unfinished handle waits for it.
class CommWork {
 public:
  virtual ~CommWork() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
};
using CommHandle = std::unique_ptr<CommWork>;

// One half of a grouped exchange (send_recv): send `tensor` to `peer`, or
// receive into it from `peer`. Shapes are agreed up front; no metadata travels.
struct P2POp {
  enum class Kind { send, recv };
  Kind kind = Kind::send;
  Tensor tensor;
  int peer = 0;
};

// What a communicator has moved since it was made (or reset): calls and
// bytes per kind of operation, and the time this rank spent in its calls.
// Bytes are the size of the buffer the caller passed, the way nccl-tests
// reports sizes: the tensor for all-reduce, broadcast, send and recv; the
// input [size()·n] for reduce-scatter; the output [size()·n] for all-gather.
// Groups of one count too (they move nothing, but the call was made).
//
// `seconds` is wall time on this rank's host thread inside the communicator:
// issuing every operation, barrier(), and its handles' wait() and test() (and
// destroying an unfinished handle, which waits). It is exposed (blocked)
// communication time, not link time: an operation that completes while the
// rank computes adds only the cost of issuing and waiting for it, and a rank
// that reaches a collective late is not charged for it, the ranks that wait
// for it are. Counted by the Communicator base class for every backend (MPI,
// NCCL, the emulated channel, groups of one). Under NCCL wait() does not
// block the host (it orders the compute stream after the communication), so
// there the figure is the host's time only and the GPU's wait shows in step
// time instead; poll() (progress while the reducer waits for gradients) is
// not counted.
// `bytes` counts what crosses ranks: a group of one counts its calls but no bytes.
struct CommCounters {
  enum Kind { all_reduce, reduce_scatter, all_gather, broadcast, send, recv, kinds };
  int64_t calls[kinds] = {};
  int64_t bytes[kinds] = {};
  double seconds = 0.0;
  int64_t total_bytes() const {
    int64_t total = 0;
    for (const int64_t b : bytes) total += b;
    return total;
  }
};

// Timed events of the work done over a group (ring attention's blocks,
// exchanges and waits), for a trace: `clock` reads nanoseconds on the
// trace's timeline, `record(name, category, start, end)` keeps one event.
// Empty (the default): nothing is read or recorded.
struct GroupEvents {
  std::function<int64_t()> clock{};
  std::function<void(const std::string& name, const std::string& category, int64_t start_ns, int64_t end_ns)>
      record{};
  bool enabled() const { return bool(record) && bool(clock); }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // Where the users of this group record their timed events (set_events({})
  // stops it); the communicator itself records nothing.
  void set_events(GroupEvents events) { events_ = std::move(events); }
  const GroupEvents& events() const { return events_; }

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  // The deadline of every wait on this communicator's operations (and of
  // communicators split from it), in seconds; 0: none (the default). A wait
  // that passes it throws tessera::Error naming the operation (kind, group,
  // bytes, sequence number) and, where the backend can tell, which ranks of
  // the group had reached it and which had not (--comm-timeout).
  // `flag` is the setting the deadline comes from, named in its report
  // (--comm-timeout; --save-timeout while a checkpoint is written).
  virtual void set_timeout(double seconds, const std::string& flag = "--comm-timeout") {
    timeout_s_ = seconds;
    timeout_flag_ = flag;
  }
  double timeout() const { return timeout_s_; }
  const std::string& timeout_flag() const { return timeout_flag_; }
  // Within a longer deadline (a checkpoint save's --save-timeout): a rank of
  // the group that has not reached the operation waited for and has shown no
  // sign of life for `seconds` (it is neither in communication nor writing:
  // see heartbeat()) is stalled, and is named then, without waiting for the
  // deadline; 0: off (the default). Backends that cannot see the other ranks
  // (a group of one, NCCL's) ignore it.
  virtual void set_silence_limit(double seconds, const std::string& flag) {
    silence_s_ = seconds;
    silence_flag_ = flag;
  }
  double silence_limit() const { return silence_s_; }
  const std::string& silence_flag() const { return silence_flag_; }
  // This rank is alive and making progress outside communication (a
  // checkpoint writer between slabs): the others' silence checks see it.
  // Call from the thread that calls the communicator's operations.
  virtual void heartbeat() {}

  virtual const std::string& name() const = 0;  // "world", "dp", "tp", "pp", ...
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // The operations: each counts its call, bytes and time (counters()) and
  // hands the work to the backend's issue_* below.
  // In place on `tensor`; avg divides the sum by size() (integers: truncated).
  CommHandle all_reduce(Tensor& tensor, ReduceOp op);
  // input [size() · n] → output [n]: rank r gets block r of the reduction.
  CommHandle reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op);
  // input [n] → output [size() · n], block r from rank r. In place when
  // `input` is this rank's block of `output` (MPI_IN_PLACE, NCCL's in-place
  // all-gather): ZeRO-1/2 gather their updated pieces that way.
  CommHandle all_gather(const Tensor& input, Tensor& output);
  CommHandle broadcast(Tensor& tensor, int root);
  CommHandle send(const Tensor& tensor, int peer);
  CommHandle recv(Tensor& tensor, int peer);
  // All sends and receives as one group (no deadlock whatever their order).
  CommHandle send_recv(const std::vector<P2POp>& ops);
  // Variable all-to-all (MPI_Alltoallv's): `input` holds, flat and in rank
  // order, send_counts[r] elements for each rank r; `output` receives, in
  // rank order, recv_counts[r] elements from each rank r (what rank r's
  // send_counts say for this one: agree them first, all_to_all_counts).
  // Blocks of no elements move nothing. One grouped send_recv (so MPI, NCCL's
  // grouped send/recv and the emulated channel run it, with their deadlines
  // and stall reports) and a copy of this rank's own block.
  CommHandle all_to_all(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                        const std::vector<int64_t>& recv_counts);
  void barrier();
  // Makes progress on outstanding nonblocking operations (MPI); free otherwise.
  virtual void poll() {}
  // Publishes what this rank is doing from now on (`step`: the checkpoint's),
  // for the deadline reports of the ranks of every communicator of this
  // family (MPI's stall inspector); nothing for backends without one.
  virtual void set_activity(RankActivity /*activity*/, int64_t /*step*/) {}

  // Operations issued on this communicator so far.
  virtual uint64_t sequence() const = 0;

  // A new communicator over the ranks that pass the same `color`, ordered by
  // `key`, named `name` (collective over this communicator).
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

 protected:
  // What the grouped transfers being issued are called in errors and stall
  // reports: "send_recv", or "all_to_all" while all_to_all issues them.
  const char* transfers_name() const { return transfers_name_; }

 private:
  // The backend's side of each operation, called once per operation by the
  // public ones above (which count it): starts it and returns its handle
  // (barrier: returns when every rank has reached it).
  virtual CommHandle issue_all_reduce(Tensor& tensor, ReduceOp op) = 0;
  virtual CommHandle issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  virtual CommHandle issue_all_gather(const Tensor& input, Tensor& output) = 0;
  virtual CommHandle issue_broadcast(Tensor& tensor, int root) = 0;
  virtual CommHandle issue_send(const Tensor& tensor, int peer) = 0;
  virtual CommHandle issue_recv(Tensor& tensor, int peer) = 0;
  virtual CommHandle issue_send_recv(const std::vector<P2POp>& ops) = 0;
  virtual void issue_barrier() = 0;

  // Bytes only where they cross ranks: a group of one moves nothing.
  void count(CommCounters::Kind kind, const Tensor& buffer) {
    ++counters_.calls[kind];
    if (size() > 1) counters_.bytes[kind] += int64_t(buffer.nbytes());
  }
  // `issue`'s handle, its time and its handle's waits added to counters_.seconds.
  template <typename Issue>
  CommHandle timed(Issue&& issue);

  CommCounters counters_;
  GroupEvents events_;
  const char* transfers_name_ = "send_recv";
  double timeout_s_ = 0.0;
  std::string timeout_flag_ = "--comm-timeout";
  double silence_s_ = 0.0;
  std::string silence_flag_;
};

// Sets `group`'s deadline to `seconds` (named `flag`) for the life of this
// object and gives the previous one back at its end (a save's own deadline).
// `silent_ranks_stall`: the group's deadline until now (--comm-timeout)
// becomes its silence limit for the scope (see set_silence_limit): a save
// may take --save-timeout, a rank silent for --comm-timeout is still a stall.
class ScopedTimeout {
 public:
  ScopedTimeout(Communicator& group, double seconds, const std::string& flag, bool silent_ranks_stall = false)
      : group_(group),
        seconds_(group.timeout()),
        flag_(group.timeout_flag()),
        silence_s_(group.silence_limit()),
        silence_flag_(group.silence_flag()) {
    if (silent_ranks_stall) group_.set_silence_limit(seconds_, flag_);
    group_.set_timeout(seconds, flag);
  }
  ~ScopedTimeout() {
    group_.set_timeout(seconds_, flag_);
    group_.set_silence_limit(silence_s_, silence_flag_);
  }
  ScopedTimeout(const ScopedTimeout&) = delete;
  ScopedTimeout& operator=(const ScopedTimeout&) = delete;

 private:
  Communicator& group_;
  double seconds_;
  std::string flag_;
  double silence_s_;
  std::string silence_flag_;
};

// What every rank of `group` sends to this one, from what this rank sends to
// each (send_counts[r]: elements for rank r): an all-to-all of one i64 per
// pair of ranks, on `device` (a device communicator moves device tensors).
// Collective over `group`.
std::vector<int64_t> all_to_all_counts(Communicator& group, const std::vector<int64_t>& send_counts, Context& scratch,
                                       Device device);

// Every rank's `mine` (any lengths), on every rank, in rank order: two
// all-gathers of host tensors made in `scratch` (lengths, then the bytes
// padded to the longest). Collective over `group`.
std::vector<std::vector<uint8_t>> all_gather_bytes(Communicator& group, Context& scratch,
                                                   const std::vector<uint8_t>& mine);

}  // namespace tessera::parallel
