// save_checkpoint (see checkpoint.h): the collective gather-to-rank-0 save,
// its fault-injection point and deadline. The files it writes, the runs that
// place pieces, the writer and the reader are the other checkpoint*.cpp
// (io/checkpoint_internal.h lists them).
//
// Every piece, whatever its slice, is reduced to one description
// (piece_layout): a list of runs of consecutive elements, each a range of the
// piece's row-major flattening and of the tensor's. The tiling check, rank 0's
// assembly and the reader all work on those runs.
//
// The save runs in phases every rank goes through, so that an error on one
// rank never leaves another waiting in a collective:
//   1. each rank checks its own pieces and rank-state keys and serialises
//      their descriptors (or its error) into bytes;
//   2. all-gather of those bytes (lengths first, then the padded buffers):
//      every rank now knows every piece, and all ranks throw together if any
//      rank reported an error;
//   3. every rank checks, from the same descriptors, that the pieces of each
//      tensor agree on shape and dtype and that the owned pieces cover it
//      exactly once (the same verdict everywhere, no communication): along
//      the cut dimension when every piece is a whole shard of one cut, else
//      over the runs' element intervals;
//   4. data: tensor by tensor in name order, the owners send their pieces to
//      rank 0, which assembles the tensor in host memory (a piece of one run
//      is received in place, others into a buffer then scattered) and writes
//      it (one tensor at a time in memory); then the rank-state blobs. If rank 0
//      fails (disk full, ...), it keeps receiving so nobody blocks;
//   5. rank 0 closes, fsyncs and publishes, then broadcasts the outcome;
//      every rank returns the path or throws rank 0's error.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include "core/context.h"
#include "core/fault.h"
#include "core/process_end.h"
#include "io/checkpoint_internal.h"

namespace tessera::io {

using namespace checkpoint_detail;

namespace {

// ---------------------------------------------------------------------------
// Piece descriptors, serialised for the all-gather.


struct RankInfo {
  std::string error;  // non-empty: this rank's pieces are unusable
  std::vector<PieceInfo> pieces;
  std::vector<std::pair<std::string, int64_t>> state_sizes;  // rank_state keys (sorted) and byte counts
};

class ByteWriter {
 public:
  void i64(int64_t value) { append(&value, sizeof value); }
  void text(const std::string& value) {
    i64(int64_t(value.size()));
    append(value.data(), value.size());
  }
  void shape(const Shape& shape) {
    i64(shape.ndim());
    for (int64_t size : shape.sizes()) i64(size);
  }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  void append(const void* data, size_t size) {
    const auto* at = static_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), at, at + size);
  }
  std::vector<uint8_t> bytes_;
};

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  int64_t i64() {
    int64_t value = 0;
    take(&value, sizeof value);
    return value;
  }
  std::string text() {
    const int64_t size = i64();
    TESSERA_CHECK(size >= 0 && size_t(size) <= size_ - at_, "checkpoint: corrupt piece descriptor");
    std::string value(reinterpret_cast<const char*>(data_ + at_), size_t(size));
    at_ += size_t(size);
    return value;
  }
  Shape shape() {
    const int64_t ndim = i64();
    TESSERA_CHECK(ndim >= 0 && ndim <= Shape::kMaxDims, "checkpoint: corrupt piece descriptor");
    std::vector<int64_t> sizes(static_cast<size_t>(ndim));
    for (auto& size : sizes) size = i64();
    return Shape(sizes);
  }

 private:
  void take(void* out, size_t size) {
    TESSERA_CHECK(size <= size_ - at_, "checkpoint: corrupt piece descriptor");
    std::memcpy(out, data_ + at_, size);
    at_ += size;
  }
  const uint8_t* data_;
  size_t size_, at_ = 0;
};

std::vector<uint8_t> serialise(const RankInfo& info) {
  ByteWriter out;
  out.text(info.error);
  out.i64(int64_t(info.pieces.size()));
  for (const PieceInfo& piece : info.pieces) {
    out.text(piece.name);
    out.i64(int64_t(piece.dtype));
    out.shape(piece.global);
    out.i64(int64_t(piece.slice.kind));
    out.i64(piece.slice.begin);
    out.i64(piece.slice.dim);
    out.shape(piece.slice.view);
    out.i64(piece.slice.sub_range ? 1 : 0);
    out.i64(piece.slice.sub_begin);
    out.i64(piece.slice.shard_length);
    out.shape(piece.local);
    out.i64(piece.owner ? 1 : 0);
  }
  out.i64(int64_t(info.state_sizes.size()));
  for (const auto& [key, size] : info.state_sizes) {
    out.text(key);
    out.i64(size);
  }
  return std::move(out.bytes());
}

RankInfo deserialise(const uint8_t* data, size_t size, int rank) {
  ByteReader in(data, size);
  RankInfo info;
  info.error = in.text();
  const int64_t pieces = in.i64();
  for (int64_t i = 0; i < pieces; ++i) {
    PieceInfo piece;
    piece.name = in.text();
    piece.dtype = DType(in.i64());
    piece.global = in.shape();
    piece.slice.kind = TensorSlice::Kind(in.i64());
    piece.slice.begin = in.i64();
    piece.slice.dim = int(in.i64());
    piece.slice.view = in.shape();
    piece.slice.sub_range = in.i64() != 0;
    piece.slice.sub_begin = in.i64();
    piece.slice.shard_length = in.i64();
    piece.local = in.shape();
    piece.owner = in.i64() != 0;
    piece.rank = rank;
    piece.index = int(i);
    info.pieces.push_back(std::move(piece));
  }
  const int64_t states = in.i64();
  for (int64_t i = 0; i < states; ++i) {
    std::string key = in.text();
    info.state_sizes.emplace_back(std::move(key), in.i64());
  }
  return info;
}

// Rank 0's outcome (empty: success), on every rank.
std::string broadcast_outcome(parallel::Communicator& world, Context& scratch, const std::string& failure) {
  Tensor length = scratch.full(Shape{1}, DType::i64, double(failure.size()));
  world.broadcast(length, 0)->wait();
  const int64_t size = length.data<int64_t>()[0];
  if (size == 0) return {};
  Tensor text = scratch.zeros(Shape{size}, DType::u8);
  if (world.rank() == 0) std::memcpy(text.data_ptr(), failure.data(), failure.size());
  world.broadcast(text, 0)->wait();
  return std::string(reinterpret_cast<const char*>(text.data_ptr()), size_t(size));
}

// ---------------------------------------------------------------------------
// Step 3: consistency and exact coverage of every tensor.


struct Interval {
  int64_t begin, end;
  int rank;
};

// Throws when `intervals` do not tile [0, total) exactly once; `unit`
// describes the indices ("elements", "indices along dimension 1").
void check_tiling(const std::string& what, const std::string& name, std::vector<Interval> intervals, int64_t total,
                  const std::string& unit) {
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.rank < b.rank;
  });
  int64_t covered = 0;
  int last_rank = -1;
  for (const Interval& interval : intervals) {
    TESSERA_CHECK(interval.begin <= covered, what, ": tensor ", name, ": ", unit, " [", covered, ", ", interval.begin,
                  ") are owned by no rank; every element must have exactly one owner (owner=true on one rank)");
    TESSERA_CHECK(interval.begin >= covered, what, ": tensor ", name, ": ", unit, " [", interval.begin, ", ",
                  std::min(covered, interval.end), ") are owned by both rank ", last_rank, " and rank ", interval.rank,
                  "; replicas must be saved by one owner only (owner=false on the others)");
    covered = interval.end;
    last_rank = interval.rank;
  }
  TESSERA_CHECK(covered == total, what, ": tensor ", name, ": ", unit, " [", covered, ", ", total,
                ") are owned by no rank; every element must have exactly one owner (owner=true on one rank)");
}

std::vector<TensorPlan> plan_tensors(const std::vector<RankInfo>& ranks, const std::string& what) {
  std::map<std::string, TensorPlan> plans;
  std::map<std::string, const PieceInfo*> first;
  for (const RankInfo& rank : ranks)
    for (const PieceInfo& piece : rank.pieces) {
      auto [it, inserted] = first.emplace(piece.name, &piece);
      const PieceInfo& seen = *it->second;
      TESSERA_CHECK(seen.global == piece.global && seen.dtype == piece.dtype, what, ": tensor ", piece.name, " is ",
                    dtype_name(seen.dtype), " ", seen.global.to_string(), " on rank ", seen.rank, " but ",
                    dtype_name(piece.dtype), " ", piece.global.to_string(), " on rank ", piece.rank,
                    "; every rank must describe a tensor the same way");
      TensorPlan& plan = plans[piece.name];
      if (inserted) plan = {piece.name, piece.global, piece.dtype, {}};
      if (piece.owner) plan.owned.push_back(&piece);
    }
  std::vector<TensorPlan> out;
  for (auto& entry : plans) {  // not a structured binding: the lambdas below capture `plan` (clang < 16)
    const std::string& name = entry.first;
    TensorPlan& plan = entry.second;
    std::vector<PieceLayout> layouts;
    for (const PieceInfo* piece : plan.owned)
      layouts.push_back(piece_layout(name, plan.shape, piece->slice, piece->local, what));
    // Whole shards all cut along the same dimension of the same shape are
    // checked along it (few intervals); anything else element by element in
    // runs.
    const bool one_dim = !plan.owned.empty() && std::all_of(plan.owned.begin(), plan.owned.end(), [&](auto* piece) {
      return piece->slice.kind == TensorSlice::Kind::dim_range && !piece->slice.sub_range &&
             piece->slice.dim == plan.owned[0]->slice.dim;
    }) && std::all_of(layouts.begin(), layouts.end(), [&](const PieceLayout& layout) {
      return layout.cut == layouts[0].cut;
    });
    std::vector<Interval> intervals;
    if (one_dim) {
      const int dim = plan.owned[0]->slice.dim;
      const Shape& cut = layouts[0].cut;
      for (size_t i = 0; i < plan.owned.size(); ++i)
        if (layouts[i].count > 0)
          intervals.push_back(
              {plan.owned[i]->slice.begin, plan.owned[i]->slice.begin + layouts[i].count, plan.owned[i]->rank});
      if (plan.shape.numel() > 0)
        check_tiling(what, name, std::move(intervals), cut[dim],
                     "indices along dimension " + std::to_string(dim) +
                         (cut == plan.shape ? "" : " of view " + cut.to_string()));
    } else {
      for (size_t i = 0; i < plan.owned.size(); ++i)
        for (const Run& run : layouts[i].runs)
          intervals.push_back({run.global, run.global + run.count, plan.owned[i]->rank});
      check_tiling(what, name, std::move(intervals), plan.shape.numel(), "elements");
    }
    out.push_back(std::move(plan));
  }
  return out;
}

// The checkpoint_crash fault: this process dies here (tests prove the
// previous checkpoint survives).
void crash_if_due(int64_t step, int rank) {
  if (fault_due("slow_checkpoint", step, rank)) {
    std::fprintf(stderr, "tessera: TESSERA_FAULT: slow_checkpoint while writing the step-%lld checkpoint on rank %d\n",
                 static_cast<long long>(step), rank);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(6));
  }
  if (fault_due("checkpoint_crash", step, rank)) {
    std::fprintf(stderr, "tessera: TESSERA_FAULT: checkpoint_crash while writing the step-%lld checkpoint on rank %d\n",
                 static_cast<long long>(step), rank);
    std::fflush(nullptr);
    end_process(ProcessEnd::injected_crash, 128 + SIGKILL);
  }
}

// Rank 0's "writing checkpoint step N" for the other ranks' deadline
// reports, for the life of this object.
class WritingActivity {
 public:
  WritingActivity(parallel::Communicator& world, bool writer, int64_t step) : world_(world), writer_(writer) {
    if (writer_) world_.set_activity(parallel::RankActivity::writing_checkpoint, step);
  }
  ~WritingActivity() {
    if (writer_) world_.set_activity(parallel::RankActivity::none, 0);
  }
  WritingActivity(const WritingActivity&) = delete;
  WritingActivity& operator=(const WritingActivity&) = delete;

 private:
  parallel::Communicator& world_;
  bool writer_;
};

// Bytes a checkpoint of `plans` and the ranks' state will take on disk: the
// data plus HDF5's object headers and attributes (about 0.4 KiB per
// dataset measured; 0.5 KiB is counted) and the file's own structures.
int64_t checkpoint_file_bytes(const std::vector<TensorPlan>& plans, const std::vector<RankInfo>& all) {
  int64_t bytes = 4096;
  for (const TensorPlan& plan : plans) bytes += plan.shape.numel() * int64_t(dtype_size(plan.dtype)) + 512;
  for (const RankInfo& info : all)
    for (const auto& [key, size] : info.state_sizes) bytes += size + 512;
  return bytes;
}

}  // namespace

// ---------------------------------------------------------------------------
// save_checkpoint, in phases: this rank's descriptors (1), everyone's (2),
// the plan (3), then the data: the other ranks send what they own (4), rank
// 0 opens a temporary directory, writes tensor by tensor and the ranks'
// states, and publishes it atomically (5); every rank learns the outcome.

namespace {

// Phase 1: this rank's pieces and rank states described (or the error that
// stops every rank: `local_error` holds it, the descriptor its message).
RankInfo describe_pieces(const std::string& dir, int64_t step, const std::vector<TensorPiece>& pieces,
                         const CheckpointMetadata& metadata, const SaveOptions& options, const std::string& what,
                         int rank, std::exception_ptr& local_error) {
  RankInfo mine;
  try {
    TESSERA_CHECK(!dir.empty(), "saving a checkpoint: the save directory is empty; pass --save DIR");
    TESSERA_CHECK(step >= 0, what, ": the step must be non-negative, got ", step);
    TESSERA_CHECK(options.keep >= 0, what, ": keep must be >= 0 (0 keeps all), got ", options.keep);
    for (size_t i = 0; i < pieces.size(); ++i) {
      const TensorPiece& piece = pieces[i];
      check_piece_local(piece, what);
      piece_layout(piece.name, piece.global_shape, piece.slice, piece.local.shape(), what);
      mine.pieces.push_back(
          {piece.name, piece.dtype, piece.global_shape, piece.slice, piece.local.shape(), piece.owner, rank, int(i)});
    }
    for (const auto& [key, bytes] : options.rank_state) {
      TESSERA_CHECK(!key.empty() && key != "." && key != ".." && key.find('/') == std::string::npos, what,
                    ": rank_state key '", key, "' cannot be stored; keys must be non-empty, without '/'");
      mine.state_sizes.emplace_back(key, int64_t(bytes.size()));
    }
    for (const auto& [key, value] : metadata)
      TESSERA_CHECK(!key.empty() && key != "." && key.find('/') == std::string::npos, what, ": metadata key '", key,
                    "' cannot be stored; keys must be non-empty, without '/'");
  } catch (const std::exception& error) {
    local_error = std::current_exception();
    mine = RankInfo{};
    mine.error = message_of(error);
  }
  return mine;
}

// Phase 2: every rank's descriptors; all ranks stop together on any rank's error.
std::vector<RankInfo> gather_descriptors(parallel::Communicator& world, Context& scratch, const RankInfo& mine,
                                         const std::exception_ptr& local_error, const std::string& what) {
  const std::vector<std::vector<uint8_t>> gathered = parallel::all_gather_bytes(world, scratch, serialise(mine));
  std::vector<RankInfo> all;
  for (int r = 0; r < world.size(); ++r)
    all.push_back(deserialise(gathered[size_t(r)].data(), gathered[size_t(r)].size(), r));
  for (int r = 0; r < world.size(); ++r) {
    if (all[size_t(r)].error.empty()) continue;
    if (r == world.rank()) std::rethrow_exception(local_error);
    TESSERA_THROW(what, ": rank ", r, " failed: ", all[size_t(r)].error);
  }
  return all;
}

// Phase 4 on a rank other than 0: what it owns of each tensor, then its rank
// states, to rank 0 (host copies: the host channel of a device-routed
// communicator whatever device the pieces live on, parallel/process_group.h).
void send_to_writer(parallel::Communicator& world, Context& scratch, const std::vector<TensorPlan>& plans,
                    const std::vector<TensorPiece>& pieces, const SaveOptions& options, int64_t step) {
  const int rank = world.rank();
  const size_t crash_after = plans.size() / 2;  // the fault point: after this tensor (or before closing when none)
  for (size_t t = 0; t < plans.size(); ++t) {
    for (const PieceInfo* piece : plans[t].owned)
      if (piece->rank == rank && piece->local.numel() > 0)
        world.send(pieces[size_t(piece->index)].local.to(Device::cpu()), 0)->wait();
    if (t == crash_after) crash_if_due(step, rank);
  }
  if (plans.empty()) crash_if_due(step, rank);
  for (const auto& [key, bytes] : options.rank_state) {
    if (bytes.empty()) continue;
    Tensor blob = scratch.empty(Shape{int64_t(bytes.size())}, DType::u8);
    std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
    world.send(blob, 0)->wait();
  }
}

// Rank 0's side of phases 4 and 5. After its first error it only receives
// (so no rank blocks), and the error is what every rank reports.
class RankZeroSave {
 public:
  RankZeroSave(parallel::Communicator& world, Context& scratch, const std::string& what)
      : world_(world), scratch_(scratch), what_(what) {}

  // The save directory (created, stale temporaries removed, room checked)
  // and the temporary checkpoint directory the writer fills.
  void open(const fs::path& save_dir, const fs::path& temporary, int64_t needed, int64_t step,
            const CheckpointMetadata& metadata) {
    attempt([&] {
      std::error_code error;
      const bool existed = fs::is_directory(save_dir, error);
      fs::create_directories(save_dir, error);
      TESSERA_CHECK(!error, "cannot create the directory ", save_dir.string(), ": ", error.message());
      if (!existed) fsync_path(save_dir.has_parent_path() ? save_dir.parent_path() : fs::path("."), true);
      remove_stale_temporaries(save_dir);
      // Before writing anything: a checkpoint that cannot fit fails now, with a message saying so.
      TESSERA_CHECK(has_room(save_dir, needed), no_room_message(save_dir, needed, false));
      fs::create_directory(temporary, error);
      TESSERA_CHECK(!error, "cannot create ", temporary.string(), ": ", error.message());
      writer_.emplace(temporary, step, world_.size(), metadata);
    });
  }

  // One logical tensor: the other ranks' pieces received (straight into
  // place when they are one run, else into a buffer scattered afterwards),
  // rank 0's own copied, the whole written.
  void write_tensor(const TensorPlan& plan, const std::vector<TensorPiece>& pieces) {
    const size_t element_size = dtype_size(plan.dtype);
    Tensor whole;
    if (ok()) attempt([&] { whole = scratch_.empty(Shape{plan.shape.numel()}, plan.dtype); });
    struct Incoming {
      std::vector<Run> runs;
      Tensor buffer;
    };
    std::vector<Incoming> incoming;
    std::vector<parallel::CommHandle> receives;
    for (const PieceInfo* piece : plan.owned) {
      PieceLayout layout = piece_layout(plan.name, plan.shape, piece->slice, piece->local, what_);
      if (layout.numel == 0) continue;
      if (piece->rank != 0) {
        const Run& first = layout.runs.front();
        Tensor buffer = whole.defined() && layout.contiguous() ? whole.slice(first.global, first.global + first.count)
                                                               : scratch_.empty(Shape{layout.numel}, plan.dtype);
        receives.push_back(world_.recv(buffer, piece->rank));
        incoming.push_back({std::move(layout.runs), buffer});
      } else if (whole.defined()) {
        attempt([&] {
          Tensor staging;
          const std::byte* bytes = host_bytes(pieces[size_t(piece->index)].local, staging);
          scatter_runs(layout.runs, element_size, bytes, static_cast<std::byte*>(whole.data_ptr()));
        });
      }
    }
    for (auto& handle : receives) handle->wait();
    if (!ok() || !whole.defined()) return;
    attempt([&] {
      for (Incoming& in : incoming)
        if (!in.buffer.shares_storage_with(whole))
          scatter_runs(in.runs, element_size, static_cast<const std::byte*>(in.buffer.data_ptr()),
                       static_cast<std::byte*>(whole.data_ptr()));
      writer_->write_tensor(plan, whole.data_ptr());
    });
  }

  // Rank state: rank 0's own, then each other rank's in key order.
  void write_rank_states(const std::vector<RankInfo>& all, const SaveOptions& options) {
    for (int r = 0; r < world_.size(); ++r) {
      for (const auto& [key, size] : all[size_t(r)].state_sizes) {
        std::vector<uint8_t> bytes;
        if (r == 0) {
          bytes = options.rank_state.at(key);
        } else if (size > 0) {
          Tensor blob = scratch_.empty(Shape{size}, DType::u8);
          world_.recv(blob, r)->wait();
          bytes.assign(blob.data<uint8_t>(), blob.data<uint8_t>() + size);
        }
        const std::string& name = key;  // clang before 16 cannot capture a structured binding
        if (ok()) attempt([&] { writer_->write_rank_state(r, name, bytes); });
      }
    }
  }

  // The temporary directory closed, renamed into place, `latest` pointed at
  // it and old checkpoints pruned (keep-K); on a failure before, the
  // temporary is removed and the previous checkpoint and `latest` untouched.
  void publish(const fs::path& save_dir, const fs::path& temporary, const fs::path& final_path, int keep,
               int64_t needed) {
    if (ok()) {
      bool published = false;
      attempt([&] {
        writer_->close();
        writer_.reset();
        fsync_path(temporary, true);
        publish_directory(temporary, final_path);
        published = true;
        fsync_path(save_dir, true);
        write_file_atomically(save_dir / kLatestFile, final_path.filename().string() + "\n");
        prune(save_dir, keep, final_path.filename().string());
      });
      if (!ok() && published)
        failure_ += " (" + final_path.string() +
                    " itself is complete, but 'latest' still names the previous checkpoint, which --resume auto uses)";
    }
    if (ok()) return;
    writer_.reset();
    std::error_code ignored;
    fs::remove_all(temporary, ignored);
    // A write that ran out of room (more than estimated, or another writer
    // filled the disk) says so first; HDF5's stack follows.
    if (failure_.find("No space left on device") != std::string::npos &&
        failure_.find("free space there") == std::string::npos)
      failure_ = no_room_message(save_dir, needed, true) + ". " + failure_;
  }

  bool ok() const { return failure_.empty(); }
  const std::string& failure() const { return failure_; }

 private:
  // Runs `step`, keeping the first error instead of throwing it.
  template <typename Step>
  void attempt(Step&& step) {
    try {
      step();
    } catch (const std::exception& error) {
      if (failure_.empty()) failure_ = message_of(error);
    }
  }

  parallel::Communicator& world_;
  Context& scratch_;
  const std::string& what_;
  std::optional<CheckpointWriter> writer_;
  std::string failure_;
};

}  // namespace

std::string save_checkpoint(parallel::Communicator& world, const std::string& dir, int64_t step,
                            const std::vector<TensorPiece>& pieces, const CheckpointMetadata& metadata,
                            const SaveOptions& options) {
  const int rank = world.rank();
  const fs::path save_dir(dir);
  const fs::path final_path = save_dir / step_directory_name(step);
  const std::string what = "saving checkpoint " + final_path.string();
  Context scratch;  // host buffers of this save, released when it returns
  // Every rank waits for rank 0's writes: the save has its own deadline, and
  // rank 0 tells the others' deadline reports that it is writing, not stalled.
  std::optional<parallel::ScopedTimeout> deadline;
  if (options.timeout_s) deadline.emplace(world, *options.timeout_s, "--save-timeout");
  const WritingActivity writing(world, rank == 0, step);

  std::exception_ptr local_error;
  const RankInfo mine = describe_pieces(dir, step, pieces, metadata, options, what, rank, local_error);
  const std::vector<RankInfo> all = gather_descriptors(world, scratch, mine, local_error, what);
  // 3. Shapes agree and every tensor is owned exactly once (same verdict on every rank).
  const std::vector<TensorPlan> plans = plan_tensors(all, what);

  if (rank != 0) {
    send_to_writer(world, scratch, plans, pieces, options, step);
    const std::string failure = broadcast_outcome(world, scratch, {});
    TESSERA_CHECK(failure.empty(), what, " failed on rank 0 (the writer): ", failure);
    return final_path.string();
  }
  const int64_t needed = checkpoint_file_bytes(plans, all);
  const fs::path temporary = save_dir / temporary_directory_name(step);
  RankZeroSave save(world, scratch, what);
  save.open(save_dir, temporary, needed, step, metadata);
  const size_t crash_after = plans.size() / 2;  // the same fault point as the other ranks'
  for (size_t t = 0; t < plans.size(); ++t) {
    save.write_tensor(plans[t], pieces);
    if (t == crash_after) crash_if_due(step, rank);
  }
  if (plans.empty()) crash_if_due(step, rank);
  save.write_rank_states(all, options);
  save.publish(save_dir, temporary, final_path, options.keep, needed);
  broadcast_outcome(world, scratch, save.failure());
  if (!save.ok()) TESSERA_THROW(what, " failed (the previous checkpoint and 'latest' are untouched): ", save.failure());
  return final_path.string();
}

}  // namespace tessera::io
