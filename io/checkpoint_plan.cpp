// The phases every checkpoint save shares (io/checkpoint_internal.h), whoever
// writes the data: each rank's piece descriptors and rank-state blobs,
// serialised and all-gathered; the plan of each tensor with its exact-coverage
// check; the outcome broadcast; the fault points; the disk-space estimate.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <exception>
#include <filesystem>
#include <thread>
#include <utility>

#include "core/context.h"
#include "core/fault.h"
#include "core/process_end.h"
#include "io/checkpoint_internal.h"

namespace tessera::io::checkpoint_detail {

namespace {

// ---------------------------------------------------------------------------
// Piece descriptors, serialised for the all-gather.

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
  out.i64(int64_t(info.states.size()));
  for (const auto& [key, bytes] : info.states) {
    out.text(key);
    out.text(std::string(bytes.begin(), bytes.end()));
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
    const std::string bytes = in.text();
    info.states.emplace_back(std::move(key), std::vector<uint8_t>(bytes.begin(), bytes.end()));
  }
  return info;
}

// ---------------------------------------------------------------------------
// Consistency and exact coverage of every tensor.

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

}  // namespace

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

// The checkpoint_crash fault: this process dies here (tests prove the
// previous checkpoint survives).
void crash_if_due(int64_t step, int rank, const WriteProgress& progress) {
  const auto announce = [&](const char* kind) {
    std::fprintf(stderr, "tessera: TESSERA_FAULT: %s while writing the step-%lld checkpoint on rank %d\n", kind,
                 static_cast<long long>(step), rank);
    std::fflush(stderr);
  };
  if (fault_due("slow_checkpoint", step, rank)) {  // a slow disk: 6 s, making progress all along
    announce("slow_checkpoint");
    for (int tenth = 0; tenth < 60; ++tenth) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (progress) progress();
    }
  }
  if (fault_due("checkpoint_hang", step, rank)) {  // a writer stuck for good (a dead mount, a stopped process)
    announce("checkpoint_hang");
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  if (fault_due("checkpoint_crash", step, rank)) {
    announce("checkpoint_crash");
    std::fflush(nullptr);
    end_process(ProcessEnd::injected_crash, 128 + SIGKILL);
  }
}

// Bytes a checkpoint of `plans` and the ranks' state will take on disk: the
// data plus HDF5's object headers and attributes (about 0.4 KiB per dataset
// measured, 0.5 KiB counted) and the files' own structures; sharded, also
// each tensor's virtual dataset and piece table in the index (about 0.9 KiB
// measured, 1 KiB counted) and a file per rank.
int64_t checkpoint_file_bytes(const std::vector<TensorPlan>& plans, const std::vector<RankInfo>& all, bool sharded) {
  int64_t bytes = 4096;
  for (const TensorPlan& plan : plans) {
    bytes += plan.shape.numel() * int64_t(dtype_size(plan.dtype)) + 512;
    if (sharded) bytes += 1024 + 512 * int64_t(plan.owned.size());
  }
  for (const RankInfo& info : all) {
    if (sharded) bytes += 1024;
    for (const auto& [key, blob] : info.states) bytes += int64_t(blob.size()) + 512;
  }
  return bytes;
}

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
      mine.states.emplace_back(key, bytes);
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

}  // namespace tessera::io::checkpoint_detail
