// MpiCommunicator: nonblocking MPI collectives and point-to-point transfers
// on tensors, with host staging for device tensors and f32 reductions for
// bf16/f16 (see mpi_communicator.h for the rules).
#include "parallel/mpi_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>
#include <thread>
#include <type_traits>
#include <utility>

#include "core/context.h"
#include "core/process_end.h"
#include "core/storage.h"
#include "parallel/mpi_check.h"

// Like TESSERA_MPI_CHECK, with the operation, communicator and rank in the message.
#define TESSERA_MPI_CHECK_AT(at, expr)                                                                        \
  do {                                                                                                        \
    const int tessera_status_ = (expr);                                                                       \
    if (tessera_status_ != MPI_SUCCESS) [[unlikely]]                                                          \
      ::tessera::throw_error(::tessera::ErrorSite{"MPI", tessera_status_, {}, #expr, __FILE__, __LINE__, {}}, \
                             (at) + ": " + ::tessera::detail::mpi_error_text(tessera_status_));               \
  } while (0)

namespace tessera::parallel {

// One operation in flight: its MPI requests, the buffers they use, and what
// to do on the host once they complete.
class MpiWork final : public CommWork {
 public:
  MpiWork(MpiCommunicator* comm, std::string where)
      : comm_(comm), where_(std::move(where)), sequence_(comm ? comm->sequence() : 0) {}
  ~MpiWork() override;
  MpiWork(const MpiWork&) = delete;
  MpiWork& operator=(const MpiWork&) = delete;

  void wait() override;
  bool test() override;

  bool pending() const { return !requests_.empty() || next_step_; }
  const std::string& where() const { return where_; }
  uint64_t sequence() const { return sequence_; }  // the operation's number on its communicator
  MPI_Request* add_request() { return &requests_.emplace_back(MPI_REQUEST_NULL); }
  void keep(Tensor tensor) { kept_.push_back(std::move(tensor)); }
  void on_complete(std::function<void()> step) { finish_.push_back(std::move(step)); }
  // A multi-step algorithm: `next` runs whenever the requests in flight have
  // completed; it posts the next step's requests and returns true, or returns
  // false when the algorithm is done. Runs once now to post the first step.
  void run_steps(std::function<bool(MpiWork&)> next) {
    next_step_ = std::move(next);
    advance();
  }
  // Runs the host-side steps now (no MPI involved: size 1, or nothing to move).
  void complete_now() { complete(); }

 private:
  void complete();
  [[noreturn]] void fail(std::exception_ptr error);
  // After the requests in flight completed: the next step, if any. False when all is done.
  bool advance();

  MpiCommunicator* comm_;  // registered there while pending
  std::string where_;
  uint64_t sequence_;
  std::vector<MPI_Request> requests_;
  std::vector<Tensor> kept_;  // buffers MPI reads or writes until completion
  std::vector<std::function<void()>> finish_;
  std::function<bool(MpiWork&)> next_step_;
  bool done_ = false;
  std::exception_ptr error_;
  friend class MpiCommunicator;
};

MpiWork::~MpiWork() {
  if (!done_ && comm_ && comm_->stalled_) {
    comm_->leave(this);  // abandoned: the process is about to abort
    return;
  }
  if (!done_) {
    try {
      wait();
    } catch (const std::exception& error) {
      // A destructor cannot throw; say what was lost rather than dropping it.
      std::fprintf(stderr, "tessera: an unwaited communication failed while its handle was destroyed: %s\n",
                   error.what());
    }
  }
  if (comm_) comm_->leave(this);
}

void MpiWork::wait() {
  if (done_) {
    if (error_) std::rethrow_exception(error_);
    return;
  }
  try {
    TESSERA_CHECK(!comm_ || !comm_->stalled_, where_, ": not waited for: an earlier operation on '", comm_->name(),
                  "' timed out and the job is being aborted");
    // Test, spinning for the first 2 ms (short operations), then with short
    // sleeps (ranks often outnumber cores), until done or the deadline.
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const double timeout = comm_ ? comm_->timeout() : 0.0;
    const double silence = comm_ && comm_->inspector_ ? comm_->silence_limit() : 0.0;
    double next_silence_check = silence;  // then once a second
    uint64_t polls = 0;
    do {
      int flag = requests_.empty() ? 1 : 0;
      while (!flag) {
        TESSERA_MPI_CHECK_AT(where_, MPI_Testall(int(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
        if (flag) break;
        const double waited = std::chrono::duration<double>(Clock::now() - start).count();
        if (timeout > 0.0 && waited > timeout) comm_->stalled(*this, waited);
        if (silence > 0.0 && waited > next_silence_check) {
          if (const std::string ranks = comm_->silent_ranks(*this); !ranks.empty()) comm_->silent(*this, waited, ranks);
          next_silence_check = waited + 1.0;
        }
        if (waited > 2e-3) std::this_thread::sleep_for(std::chrono::microseconds(50));
        if (comm_->inspector_ && ++polls % 1024 == 0) comm_->inspector_->heartbeat();  // alive, waiting
      }
    } while (advance());
  } catch (...) {
    fail(std::current_exception());
  }
  complete();
}

bool MpiWork::test() {
  if (done_) {
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  try {
    do {
      int flag = 1;
      if (!requests_.empty())
        TESSERA_MPI_CHECK_AT(where_, MPI_Testall(int(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
      if (!flag) return false;
    } while (advance());
  } catch (...) {
    fail(std::current_exception());
  }
  complete();
  return true;
}

bool MpiWork::advance() {
  requests_.clear();
  if (!next_step_) return false;
  if (next_step_(*this)) return true;
  next_step_ = nullptr;
  return false;
}

void MpiWork::complete() {
  try {
    for (auto& step : finish_) step();
  } catch (...) {
    fail(std::current_exception());
  }
  done_ = true;
  finish_.clear();
  kept_.clear();
  if (comm_) comm_->leave(this);
  comm_ = nullptr;
}

void MpiWork::fail(std::exception_ptr error) {
  done_ = true;
  next_step_ = nullptr;
  error_ = error;
  finish_.clear();
  kept_.clear();
  if (comm_) comm_->leave(this);
  comm_ = nullptr;
  std::rethrow_exception(error);
}

namespace {

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;  // moved as raw bits; reductions go through f32
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::max ? MPI_MAX : MPI_SUM;  // avg: sum, then divide
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

// The dtype a reduction of `dtype` runs in: bf16/f16 in f32; u8 sums in
// i32 (so avg is the true average; also, Open MPI 4.1's AVX reduction
// saturates 8-bit sums of 27 or more elements where shorter ones wrap).
DType reduction_dtype(DType dtype, ReduceOp op) {
  if (dtype == DType::bf16 || dtype == DType::f16) return DType::f32;
  if (dtype == DType::u8 && op != ReduceOp::max) return DType::i32;
  return dtype;
}

// The host-side arithmetic here (conversions, avg's division, the ring's
// additions) runs on the calling thread only, vectorised, like MPI's own
// reductions: OpenMP workers would compete for the cores with the other ranks
// of the node (and their spinning would stall MPI's progress).

// to[i] = from[i] / divisor in to's dtype: floating types through f32
// (rounding once), integers through int64 (division truncated toward zero;
// u8 keeps the value modulo 256). `to` may be `from` itself.
void convert(const Tensor& from, const Tensor& to, int divisor) {
  dispatch_any(from.dtype(), [&](auto from_tag) {
    dispatch_any(to.dtype(), [&](auto to_tag) {
      using From = decltype(from_tag);
      using To = decltype(to_tag);
      if constexpr (std::is_integral_v<From> == std::is_integral_v<To>) {
        const From* in = static_cast<const From*>(from.data_ptr());
        To* out = static_cast<To*>(to.data_ptr());
        const int64_t n = from.numel();
        if constexpr (std::is_integral_v<From>) {
          for (int64_t i = 0; i < n; ++i) out[i] = To(int64_t(in[i]) / divisor);
        } else if (divisor == 1) {
          for (int64_t i = 0; i < n; ++i) out[i] = from_float<To>(to_float(in[i]));
        } else {
          const float scale = float(divisor);
          for (int64_t i = 0; i < n; ++i) out[i] = from_float<To>(to_float(in[i]) / scale);
        }
      } else {
        TESSERA_THROW("communicator: no conversion from ", dtype_name(from.dtype()), " to ", dtype_name(to.dtype()));
      }
    });
  });
}

// A host copy of `host` in `dtype`.
Tensor converted(const Tensor& host, DType dtype) {
  Tensor out = host.context().empty(Shape{host.numel()}, dtype);
  convert(host, out, 1);
  return out;
}

// x[i] = x[i] + y[i] (or max) over n elements of a host buffer (f32, i32,
// i64: the dtypes reductions run in).
void reduce_into(void* x, const void* y, int64_t n, DType dtype, ReduceOp op) {
  dispatch_any(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>) {
      T* out = static_cast<T*>(x);
      const T* in = static_cast<const T*>(y);
      if (op == ReduceOp::max) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) out[i] = out[i] < in[i] ? in[i] : out[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) out[i] += in[i];
      }
    } else {
      TESSERA_THROW("communicator: reductions run in f32, i32 or i64, not ", dtype_name(dtype));
    }
  });
}

// All-reduce as a ring over nonblocking point-to-point messages: the buffer
// is cut into size() chunks; size()−1 steps of reduce-scatter (send one chunk
// to the right, receive one from the left and add it to ours) leave each rank
// with one reduced chunk, size()−1 steps of all-gather pass the reduced chunks
// round. Every rank sends and receives 2(n−1)/n of the buffer, the
// bandwidth-optimal amount. Each step is posted when the previous one
// completes, inside wait(), test() or the communicator's poll().
//
// Why not MPI_Iallreduce: Open MPI 4.1's nonblocking collectives (libnbc) run
// at a third to a half of MPI_Allreduce's bandwidth on 1-64 MiB buffers here
// (benchmarks/allreduce.cpp); this ring matches MPI_Allreduce and stays
// nonblocking. Small buffers, where latency dominates, still use
// MPI_Iallreduce.
class RingAllReduce {
 public:
  RingAllReduce(MPI_Comm comm, int rank, int size, int tag, const Tensor& buffer, ReduceOp op)
      : comm_(comm),
        rank_(rank),
        size_(size),
        tag_(tag),
        buffer_(buffer),
        op_(op),
        type_(mpi_type(buffer.dtype())),
        element_(buffer.element_size()) {
    const int64_t n = buffer.numel();
    for (int c = 0; c <= size; ++c) begin_.push_back(n * c / size);
    int64_t largest = 0;
    for (int c = 0; c < size; ++c) largest = std::max(largest, begin_[size_t(c + 1)] - begin_[size_t(c)]);
    scratch_ = buffer.context().empty(Shape{largest}, buffer.dtype());
  }

  // Posts step 0, or, once step `step_` has completed, finishes it and posts the next.
  bool operator()(MpiWork& work) {
    if (step_ >= 0 && step_ < size_ - 1) {
      const int chunk = mod(rank_ - step_ - 1);
      reduce_into(at(chunk), scratch_.data_ptr(), length(chunk), buffer_.dtype(), op_);
    }
    if (++step_ == 2 * (size_ - 1)) return false;
    const int left = mod(rank_ - 1), right = mod(rank_ + 1);
    int send_chunk, receive_chunk;
    void* receive_into;
    if (step_ < size_ - 1) {  // reduce-scatter
      send_chunk = mod(rank_ - step_);
      receive_chunk = mod(rank_ - step_ - 1);
      receive_into = scratch_.data_ptr();
    } else {  // all-gather
      const int s = step_ - (size_ - 1);
      send_chunk = mod(rank_ + 1 - s);
      receive_chunk = mod(rank_ - s);
      receive_into = at(receive_chunk);
    }
    TESSERA_MPI_CHECK_AT(work.where(), MPI_Irecv(receive_into, int(length(receive_chunk)), type_, left, tag_, comm_,
                                                 work.add_request()));
    TESSERA_MPI_CHECK_AT(work.where(), MPI_Isend(at(send_chunk), int(length(send_chunk)), type_, right, tag_, comm_,
                                                 work.add_request()));
    return true;
  }

 private:
  int mod(int c) const { return ((c % size_) + size_) % size_; }
  char* at(int chunk) const {
    return static_cast<char*>(buffer_.data_ptr()) + size_t(begin_[size_t(chunk)]) * element_;
  }
  int64_t length(int chunk) const { return begin_[size_t(chunk) + 1] - begin_[size_t(chunk)]; }

  MPI_Comm comm_;
  int rank_, size_, tag_;
  Tensor buffer_, scratch_;
  ReduceOp op_;
  MPI_Datatype type_;
  size_t element_;
  std::vector<int64_t> begin_;  // chunk c is elements [begin_[c], begin_[c + 1])
  int step_ = -1;
};

// Below this many bytes, MPI_Iallreduce's latency-optimal algorithms (log
// size() steps) are used instead of the ring's 2(size−1) steps. (With 2 ranks
// here the ring is ahead from 4 KiB on: 0.73 vs 0.58 of MPI_Allreduce.)
constexpr size_t kRingMinBytes = size_t(16) << 10;

// An empty host tensor like `like`: pinned memory when `like` is on a device
// (copies between them are DMA transfers), ordinary memory otherwise.
Tensor host_buffer(const Tensor& like) {
  Context& ctx = like.context();
  if (like.device().is_cpu()) return ctx.empty(Shape{like.numel()}, like.dtype());
  std::shared_ptr<Allocator> pinned(std::shared_ptr<void>(), &ctx.pinned_allocator(like.device()));  // non-owning
  return Tensor(std::make_shared<Storage>(ctx, pinned, std::max<size_t>(like.nbytes(), 1), nullptr), 0,
                Shape{like.numel()}, like.dtype());
}

// The host memory MPI uses for `tensor`: itself on the host, otherwise a host
// buffer (filled from the device when `copy_in`).
Tensor host_side(const Tensor& tensor, bool copy_in) {
  if (tensor.device().is_cpu()) return tensor;
  Tensor host = host_buffer(tensor);
  if (copy_in) host.copy_(tensor);
  return host;
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace

// ---------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, bool stall_inspector) : name_(std::move(name)) {
  TESSERA_CHECK(comm != MPI_COMM_NULL, "MpiCommunicator '", name_, "': MPI_COMM_NULL given");
  TESSERA_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  init();
  // The root of a family of communicators: the stall inspector's window lives here.
  if (size_ > 1 && stall_inspector) {
    inspector_ = std::make_shared<StallInspector>(comm_);
    slot_ = inspector_->add_group();
  }
}

MpiCommunicator::MpiCommunicator(Adopt, MPI_Comm owned, std::string name) : comm_(owned), name_(std::move(name)) {
  init();
}

void MpiCommunicator::init() {
  try {
    TESSERA_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    TESSERA_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    TESSERA_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  } catch (...) {
    MPI_Comm_free(&comm_);
    throw;
  }
}

MpiCommunicator::~MpiCommunicator() {
  if (stalled_ || std::uncaught_exceptions() > 0) {
    // After a timeout, or while an error unwinds this rank alone, nothing
    // collective is safe: leave the window and the communicator to MPI_Abort.
    if (inspector_ && inspector_.use_count() == 1)
      new std::shared_ptr<StallInspector>(std::move(inspector_));  // leak: no collective free
    comm_ = MPI_COMM_NULL;
    return;
  }
  // Finish what is in flight (its buffers and requests must not outlive the
  // communicator); the handles stay valid and report completion.
  while (!live_.empty()) {
    MpiWork* work = live_.back();
    try {
      work->wait();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "tessera: a communication on '%s' failed while the communicator was destroyed: %s\n",
                   name_.c_str(), error.what());
    }
    leave(work);  // in case wait() failed before leaving
  }
  inspector_.reset();
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (!finalised && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::string MpiCommunicator::where(const char* op) const {
  return detail::concat(op, " on communicator '", name_, "' (rank ", rank_, " of ", size_, ", operation ", sequence_,
                        ")");
}

std::string MpiCommunicator::where(const char* op, const Tensor& buffer) const {
  return detail::concat(op, " on communicator '", name_, "' (rank ", rank_, " of ", size_, ", operation ", sequence_,
                        ", ", buffer.nbytes(), " bytes)");
}

void MpiCommunicator::set_activity(RankActivity activity, int64_t step) {
  if (inspector_) inspector_->set_activity(int64_t(activity), step);
}

void MpiCommunicator::heartbeat() {
  if (inspector_) inspector_->heartbeat();
}

std::string MpiCommunicator::silent_ranks(const MpiWork& work) const {
  return inspector_->silent(slot_, comm_, work.sequence(), silence_limit(), std::min(2.0, 0.5 * silence_limit()));
}

void MpiCommunicator::silent(const MpiWork& work, double waited_s, const std::string& ranks) {
  stalled_ = true;
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  std::ostringstream text;
  text << "rank " << world_rank << ": " << work.where() << " waited " << waited_s << " s (within " << timeout_flag()
       << " " << timeout() << " s) for ranks that show no sign of life for more than " << silence_limit() << " s ("
       << silence_flag() << "): they are neither in communication nor writing:\n"
       << ranks << "Where the ranks of '" << name_ << "' are:\n"
       << inspector_->report(slot_, comm_, work.sequence(), 2.0, silence_limit())
       << "A rank that makes no progress in its own checkpoint write is stalled (hung, stopped or dead); see its "
          "output above. The job is aborted so that no rank waits for the whole "
       << timeout_flag() << "; raise " << silence_flag() << " if a rank's writes legitimately pause longer.";
  std::fprintf(stderr, "tessera: error: %s\n", text.str().c_str());
  std::fflush(stderr);
  end_process(ProcessEnd::stalled_collective, 3);  // the program's hook: MPI_Abort (apps/process_end.h)
}

void MpiCommunicator::begin(const char* kind) {
  ++sequence_;
  if (inspector_) inspector_->publish(slot_, sequence_, kind);
}

void MpiCommunicator::stalled(const MpiWork& work, double waited_s) {
  stalled_ = true;
  // The report goes to stderr and the job is ended from here: unwinding
  // would run collective clean-up (window and communicator frees) that the
  // stalled ranks never join.
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  std::ostringstream text;
  text << "rank " << world_rank << " on " << host << ": " << work.where() << " did not complete within " << timeout()
       << " s (" << timeout_flag() << "; waited " << waited_s << " s). Where the ranks of '" << name_ << "' are:\n"
       << (inspector_ ? inspector_->report(slot_, comm_, work.sequence(), 2.0, 0.5 * waited_s)
                      : std::string("  (no stall inspector: a group of one, or split from one)\n"))
       << "A rank that has not reached the operation is stalled (hung, far slower, or dead) or is waiting in "
          "another operation; see its output above. The job is aborted so that no rank waits forever; raise "
          "--comm-timeout if a step legitimately takes longer (--save-timeout if a rank marked WRITING A "
          "CHECKPOINT is saving: its saves take longer than that).";
  std::fprintf(stderr, "tessera: error: %s\n", text.str().c_str());
  std::fflush(stderr);
  end_process(ProcessEnd::stalled_collective, 3);  // the program's hook: MPI_Abort (apps/process_end.h)
}

int MpiCommunicator::next_collective_tag() {
  // Tags 1..kTagSpan for the ring's messages, one per collective, so that two
  // all-reduces in flight never take each other's messages (tag 0 is send/recv's).
  constexpr uint64_t kTagSpan = 30000;  // MPI guarantees tags up to 32767
  return int(1 + collectives_++ % kTagSpan);
}

void MpiCommunicator::enroll(MpiWork* work) {
  live_.push_back(work);
}

void MpiCommunicator::leave(MpiWork* work) noexcept {
  live_.erase(std::remove(live_.begin(), live_.end(), work), live_.end());
}

CommHandle MpiCommunicator::start(std::unique_ptr<MpiWork> work) {
  if (work->pending())
    enroll(work.get());
  else
    work->complete_now();
  return work;
}

namespace {

void check_tensor(const std::string& at, const char* what, const Tensor& tensor) {
  TESSERA_CHECK(tensor.defined(), at, ": the ", what, " tensor is undefined");
  TESSERA_CHECK(tensor.numel() <= INT_MAX, at, ": the ", what, " tensor has ", tensor.numel(),
                " elements, more than one MPI call can count (", INT_MAX, "); split it into chunks");
}

// reduce_scatter and all_gather: two defined tensors of one dtype on one
// device, `whole` holding `ranks` times the elements of `block`.
void check_whole_and_block(const std::string& at, const char* whole_name, const Tensor& whole, const char* block_name,
                           const Tensor& block, int ranks) {
  check_tensor(at, whole_name, whole);
  check_tensor(at, block_name, block);
  TESSERA_CHECK(whole.dtype() == block.dtype(), at, ": ", whole_name, " is ", dtype_name(whole.dtype()), " but ",
                block_name, " is ", dtype_name(block.dtype()));
  TESSERA_CHECK(whole.device() == block.device(), at, ": ", whole_name, " is on ", whole.device().to_string(), " but ",
                block_name, " is on ", block.device().to_string());
  TESSERA_CHECK(whole.numel() == int64_t(ranks) * block.numel(), at, ": ", whole_name, " has ", whole.numel(),
                " elements, but it must have size() × ", block_name, " elements = ", ranks, " × ", block.numel());
}

void check_peer(const std::string& at, const char* what, int peer, int size) {
  TESSERA_CHECK(peer >= 0 && peer < size, at, ": ", what, " ", peer, " is not a rank of this communicator (0..",
                size - 1, ")");
}

}  // namespace

CommHandle MpiCommunicator::issue_all_reduce(Tensor& tensor, ReduceOp op) {
  begin("all_reduce");
  const std::string at = where("all_reduce", tensor) + " " + op_name(op);
  check_tensor(at, "", tensor);
  auto work = std::make_unique<MpiWork>(this, at);
  if (size_ == 1) return start(std::move(work));  // sum, avg and max of one value are the value

  Tensor target = tensor;
  const Tensor host = host_side(tensor, true);
  const DType wide = reduction_dtype(tensor.dtype(), op);
  const bool widen = wide != tensor.dtype();
  const Tensor buffer = widen ? converted(host, wide) : host;
  const int count = int(tensor.numel());
  const int tag = next_collective_tag();
  if (buffer.nbytes() >= kRingMinBytes && count >= size_) {
    work->run_steps(RingAllReduce(comm_, rank_, size_, tag, buffer, op == ReduceOp::max ? op : ReduceOp::sum));
  } else {
    TESSERA_MPI_CHECK_AT(at, MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), count, mpi_type(wide), mpi_op(op), comm_,
                                            work->add_request()));
  }
  work->keep(buffer);
  const int divisor = op == ReduceOp::avg ? size_ : 1;
  const bool staged = !tensor.device().is_cpu();
  work->on_complete([=]() mutable {
    if (widen || divisor != 1) convert(buffer, host, divisor);
    if (staged) target.copy_(host);
  });
  return start(std::move(work));
}

CommHandle MpiCommunicator::issue_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  begin("reduce_scatter");
  const std::string at = where("reduce_scatter", input) + " " + op_name(op);
  check_whole_and_block(at, "input", input, "output", output, size_);
  auto work = std::make_unique<MpiWork>(this, at);
  if (size_ == 1) {
    output.copy_(input);
    return start(std::move(work));
  }

  Tensor target = output;
  const Tensor in_host = host_side(input, true);
  const DType wide = reduction_dtype(input.dtype(), op);
  const bool widen = wide != input.dtype();
  // The result lands in `output` directly when MPI may write there.
  const bool direct = output.device().is_cpu() && (widen || !overlaps(input, output));
  const Tensor out_host = direct ? output : host_buffer(output);
  const Tensor send = widen ? converted(in_host, wide) : in_host;
  const Tensor receive = widen ? output.context().empty(Shape{output.numel()}, wide) : out_host;
  const int count = int(output.numel());
  TESSERA_MPI_CHECK_AT(at, MPI_Ireduce_scatter_block(send.data_ptr(), receive.data_ptr(), count, mpi_type(wide),
                                                     mpi_op(op), comm_, work->add_request()));
  work->keep(send);
  work->keep(receive);
  const int divisor = op == ReduceOp::avg ? size_ : 1;
  work->on_complete([=]() mutable {
    if (widen || divisor != 1) convert(receive, out_host, divisor);
    if (!direct) target.copy_(out_host);
  });
  return start(std::move(work));
}

CommHandle MpiCommunicator::issue_all_gather(const Tensor& input, Tensor& output) {
  begin("all_gather");
  const std::string at = where("all_gather", output);
  check_whole_and_block(at, "output", output, "input", input, size_);
  auto work = std::make_unique<MpiWork>(this, at);
  if (size_ == 1) {
    output.copy_(input);
    return start(std::move(work));
  }

  Tensor target = output;
  const int count = int(input.numel());
  const bool on_host = output.device().is_cpu();
  // Rank r's input already in block r of the output: MPI_IN_PLACE.
  const bool in_place = on_host && input.shares_storage_with(output) &&
                        input.data_ptr() == static_cast<char*>(output.data_ptr()) + size_t(rank_) * input.nbytes();
  const bool direct = on_host && (in_place || !overlaps(input, output));
  const Tensor out_host = direct ? output : host_buffer(output);
  const Tensor in_host = in_place ? Tensor() : host_side(input, true);
  const MPI_Datatype type = mpi_type(input.dtype());
  TESSERA_MPI_CHECK_AT(at, MPI_Iallgather(in_place ? MPI_IN_PLACE : in_host.data_ptr(), count, type,
                                          out_host.data_ptr(), count, type, comm_, work->add_request()));
  if (in_host.defined()) work->keep(in_host);
  work->keep(out_host);
  if (!direct) work->on_complete([=]() mutable { target.copy_(out_host); });
  return start(std::move(work));
}

CommHandle MpiCommunicator::issue_broadcast(Tensor& tensor, int root) {
  begin("broadcast");
  const std::string at = where("broadcast", tensor) + " from root " + std::to_string(root);
  check_tensor(at, "", tensor);
  check_peer(at, "root", root, size_);
  auto work = std::make_unique<MpiWork>(this, at);
  if (size_ == 1) return start(std::move(work));

  Tensor target = tensor;
  const Tensor host = host_side(tensor, rank_ == root);
  TESSERA_MPI_CHECK_AT(
      at, MPI_Ibcast(host.data_ptr(), int(tensor.numel()), mpi_type(tensor.dtype()), root, comm_, work->add_request()));
  work->keep(host);
  if (!tensor.device().is_cpu() && rank_ != root) work->on_complete([=]() mutable { target.copy_(host); });
  return start(std::move(work));
}

namespace {
constexpr int kP2PTag = 0;  // one tag: messages between two ranks match in the order they were posted
}  // namespace

CommHandle MpiCommunicator::issue_send(const Tensor& tensor, int peer) {
  begin("send");
  const std::string at = where("send", tensor) + " to rank " + std::to_string(peer);
  check_tensor(at, "", tensor);
  check_peer(at, "peer", peer, size_);
  auto work = std::make_unique<MpiWork>(this, at);
  const Tensor host = host_side(tensor, true);
  TESSERA_MPI_CHECK_AT(at, MPI_Isend(host.data_ptr(), int(tensor.numel()), mpi_type(tensor.dtype()), peer, kP2PTag,
                                     comm_, work->add_request()));
  work->keep(host);
  return start(std::move(work));
}

CommHandle MpiCommunicator::issue_recv(Tensor& tensor, int peer) {
  begin("recv");
  const std::string at = where("recv", tensor) + " from rank " + std::to_string(peer);
  check_tensor(at, "", tensor);
  check_peer(at, "peer", peer, size_);
  auto work = std::make_unique<MpiWork>(this, at);
  Tensor target = tensor;
  const Tensor host = host_side(tensor, false);
  TESSERA_MPI_CHECK_AT(at, MPI_Irecv(host.data_ptr(), int(tensor.numel()), mpi_type(tensor.dtype()), peer, kP2PTag,
                                     comm_, work->add_request()));
  work->keep(host);
  if (!tensor.device().is_cpu()) work->on_complete([=]() mutable { target.copy_(host); });
  return start(std::move(work));
}

CommHandle MpiCommunicator::issue_send_recv(const std::vector<P2POp>& ops) {
  begin(transfers_name());
  const std::string at =
      where(transfers_name()) + " (" + std::to_string(ops.size()) + (ops.size() == 1 ? " transfer)" : " transfers)");
  for (const P2POp& op : ops) {
    check_tensor(at, op.kind == P2POp::Kind::send ? "send" : "recv", op.tensor);
    check_peer(at, "peer", op.peer, size_);
  }
  auto work = std::make_unique<MpiWork>(this, at);
  // All receives first, then all sends: every send finds its receive posted.
  for (const P2POp& op : ops) {
    if (op.kind != P2POp::Kind::recv) continue;
    Tensor target = op.tensor;
    const Tensor host = host_side(target, false);
    TESSERA_MPI_CHECK_AT(at, MPI_Irecv(host.data_ptr(), int(target.numel()), mpi_type(target.dtype()), op.peer, kP2PTag,
                                       comm_, work->add_request()));
    work->keep(host);
    if (!target.device().is_cpu()) work->on_complete([=]() mutable { target.copy_(host); });
  }
  for (const P2POp& op : ops) {
    if (op.kind != P2POp::Kind::send) continue;
    const Tensor host = host_side(op.tensor, true);
    TESSERA_MPI_CHECK_AT(at, MPI_Isend(host.data_ptr(), int(op.tensor.numel()), mpi_type(op.tensor.dtype()), op.peer,
                                       kP2PTag, comm_, work->add_request()));
    work->keep(host);
  }
  return start(std::move(work));
}

void MpiCommunicator::issue_barrier() {
  begin("barrier");
  if (size_ == 1) return;
  auto work = std::make_unique<MpiWork>(this, where("barrier"));
  TESSERA_MPI_CHECK_AT(work->where(), MPI_Ibarrier(comm_, work->add_request()));
  start(std::move(work))->wait();
}

void MpiCommunicator::poll() {
  // test() may complete a work, which leaves live_: iterate over a copy.
  const std::vector<MpiWork*> works = live_;
  for (MpiWork* work : works)
    if (std::find(live_.begin(), live_.end(), work) != live_.end()) work->test();
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& name) {
  begin("split");
  const std::string at = where("split") + " into '" + name + "'";
  TESSERA_CHECK(color >= 0, at, ": color ", color, " is negative; every rank must pass a colour >= 0");
  MPI_Comm child = MPI_COMM_NULL;
  TESSERA_MPI_CHECK_AT(at, MPI_Comm_split(comm_, color, key, &child));
  auto made = std::unique_ptr<MpiCommunicator>(new MpiCommunicator(Adopt{}, child, name));
  made->set_timeout(timeout(), timeout_flag());
  if (inspector_ && made->size_ > 1) {
    made->inspector_ = inspector_;
    made->slot_ = inspector_->add_group();  // split is collective over this communicator: the same order everywhere
  }
  return made;
}

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name, bool stall_inspector) {
  return std::make_unique<MpiCommunicator>(comm, name, stall_inspector);
}

}  // namespace tessera::parallel
