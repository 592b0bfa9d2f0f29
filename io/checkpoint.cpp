// Checkpoints (see checkpoint.h): the collective gather-to-rank-0 save with
// its atomic publish, keep-K pruning and fault-injection point, the reader
// that validates the format and checksums (keeping the last tensor it read),
// and find_latest_checkpoint.
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
#include "io/checkpoint.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include "core/context.h"
#include "core/fault.h"
#include "core/process_end.h"
#include "core/units.h"
#include "io/hdf5_file.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;

constexpr const char* kCheckpointFile = "checkpoint.h5";
constexpr const char* kLatestFile = "latest";
constexpr const char* kFormatAttribute = "tessera_checkpoint_format";
constexpr const char* kDtypeAttribute = "tessera_dtype";
constexpr const char* kCrcAttribute = "crc32";

// ---------------------------------------------------------------------------
// Names of directories.

std::string step_directory_name(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

std::optional<int64_t> parse_digits(std::string_view digits) {
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

// The step of a directory named "step_<digits>".
std::optional<int64_t> parse_step_name(std::string_view name) {
  if (!name.starts_with("step_")) return std::nullopt;
  return parse_digits(name.substr(5));
}

// A save's temporary directory: ".step_<anything>.tmp".
bool is_temporary_name(std::string_view name) {
  return name.starts_with(".step_") && name.ends_with(".tmp");
}

struct StepDirectory {
  int64_t step;
  fs::path path;
};

// The published checkpoints of `dir` (step_* directories holding the file), oldest first.
std::vector<StepDirectory> list_step_directories(const fs::path& dir) {
  std::vector<StepDirectory> found;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    const auto step = parse_step_name(name);
    std::error_code ignored;
    if (step && it->is_directory(ignored) && fs::exists(it->path() / kCheckpointFile, ignored))
      found.push_back({*step, it->path()});
  }
  std::sort(found.begin(), found.end(), [](const StepDirectory& a, const StepDirectory& b) {
    return a.step != b.step ? a.step < b.step : a.path < b.path;
  });
  return found;
}

std::string read_latest_name(const fs::path& dir) {
  std::ifstream in(dir / kLatestFile);
  std::string name;
  if (in) std::getline(in, name);
  while (!name.empty() && (name.back() == '\r' || name.back() == ' ' || name.back() == '\t')) name.pop_back();
  return name;
}

// ---------------------------------------------------------------------------
// POSIX durability helpers; each throws naming the path.

std::string errno_text(int error) {
  return std::error_code(error, std::generic_category()).message();
}

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TESSERA_CHECK(fd >= 0, "cannot open ", path.string(), " to fsync it: ", errno_text(errno));
  const int status = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  TESSERA_CHECK(status == 0, "fsync of ", path.string(), " failed: ", errno_text(error),
                "; check the file system (full? read-only?)");
}

void rename_path(const fs::path& from, const fs::path& to) {
  TESSERA_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from.string(), " to ", to.string(), ": ",
                errno_text(errno));
}

// Writes `text` to `path` atomically: `path`.tmp, fsync, rename, fsync of the directory.
void write_file_atomically(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TESSERA_CHECK(fd >= 0, "cannot create ", temporary.string(), ": ", errno_text(errno));
  const ssize_t written = ::write(fd, text.data(), text.size());
  const int write_error = errno;
  const int synced = ::fsync(fd);
  const int sync_error = errno;
  ::close(fd);
  if (written != ssize_t(text.size()) || synced != 0) ::unlink(temporary.c_str());  // `path` keeps its old text
  TESSERA_CHECK(written == ssize_t(text.size()), "cannot write ", temporary.string(), ": ", errno_text(write_error));
  TESSERA_CHECK(synced == 0, "fsync of ", temporary.string(), " failed: ", errno_text(sync_error));
  rename_path(temporary, path);
  fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path(), true);
}

// ---------------------------------------------------------------------------
// Bytes, checksums, dtypes.

uint32_t crc32_of(const void* data, size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const Bytef* at = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes 32-bit lengths
    const uInt chunk = uInt(std::min<size_t>(bytes, size_t(1) << 30));
    crc = crc32(crc, at, chunk);
    at += chunk;
    bytes -= chunk;
  }
  return uint32_t(crc);
}

hid_t file_type_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return H5T_IEEE_F32LE;
    case DType::bf16:
    case DType::f16:
      return H5T_STD_U16LE;  // raw 16-bit patterns, tagged with tessera_dtype
    case DType::i32:
      return H5T_STD_I32LE;
    case DType::i64:
      return H5T_STD_I64LE;
    case DType::u8:
      return H5T_STD_U8LE;
  }
  throw_unsupported_dtype(dtype, "checkpoint");
}

hid_t memory_type_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return H5T_NATIVE_FLOAT;
    case DType::bf16:
    case DType::f16:
      return H5T_NATIVE_UINT16;
    case DType::i32:
      return H5T_NATIVE_INT32;
    case DType::i64:
      return H5T_NATIVE_INT64;
    case DType::u8:
      return H5T_NATIVE_UINT8;
  }
  throw_unsupported_dtype(dtype, "checkpoint");
}

H5T_class_t type_class_of(DType dtype) {
  return dtype == DType::f32 ? H5T_FLOAT : H5T_INTEGER;
}

// Where a piece lies in its tensor: runs of consecutive elements in both
// row-major flattenings, elements [piece, piece + count) of the piece being
// elements [global, global + count) of the tensor. A piece's runs follow one
// another in the piece (the first at 0, each starting where the previous one
// ends) and two runs are never contiguous in the tensor too (they are merged).
struct Run {
  int64_t global = 0, piece = 0, count = 0;
};

struct PieceLayout {
  std::vector<Run> runs;  // empty for an empty piece
  int64_t numel = 0;      // the piece's elements
  // dim_range: the shape that is cut (the view or the global shape) and the
  // indices [begin, begin + count) along the slice's dim that the (whole)
  // shard spans.
  Shape cut;
  int64_t count = 0;

  bool contiguous() const { return runs.size() <= 1; }
};

// The runs of elements [first, first + n) of the flattening of the shard
// "indices [begin, begin + count) along `dim` of `cut`" (n > 0, inside it).
// Row o of the shard (o over the dimensions before `dim`) is `count · inner`
// elements at (o · size + begin) · inner of the tensor and o · count · inner
// of the shard, as nn::shard_runs computes.
std::vector<Run> dim_runs(const Shape& cut, int dim, int64_t begin, int64_t count, int64_t first, int64_t n) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= cut[d];
  for (int d = dim + 1; d < cut.ndim(); ++d) inner *= cut[d];
  const int64_t size = cut[dim], row = count * inner;
  if (outer == 1 || count == size) return {Run{begin * inner + first, 0, n}};  // the shard is contiguous
  std::vector<Run> runs;
  const int64_t end = first + n;
  for (int64_t o = first / row; o * row < end; ++o) {
    const int64_t lo = std::max(o * row, first), hi = std::min((o + 1) * row, end);
    runs.push_back({(o * size + begin) * inner + (lo - o * row), lo - first, hi - lo});
  }
  return runs;
}

// Checks a piece against its tensor and returns its layout; throws naming the
// tensor (`what` says whether it is being saved or loaded).
PieceLayout piece_layout(const std::string& name, const Shape& global, const TensorSlice& slice,
                         const Shape& local_shape, const std::string& what) {
  const int64_t numel = global.numel(), n = local_shape.numel();
  PieceLayout layout;
  layout.numel = n;
  if (slice.kind != TensorSlice::Kind::dim_range)
    TESSERA_CHECK(slice.view.ndim() == 0 && !slice.sub_range && slice.sub_begin == 0 && slice.shard_length == 0, what,
                  ": tensor ", name, ": a view or a sub-range belongs to a dim_range slice only (a sub-range of a ",
                  "whole tensor is a flat_range)");
  switch (slice.kind) {
    case TensorSlice::Kind::whole:
      TESSERA_CHECK(n == numel, what, ": tensor ", name, " is a whole piece of ", n, " elements ",
                    local_shape.to_string(), " but the tensor has ", numel, " ", global.to_string());
      if (n > 0) layout.runs.push_back({0, 0, n});
      return layout;
    case TensorSlice::Kind::flat_range:
      TESSERA_CHECK(slice.begin >= 0 && slice.begin + n <= numel, what, ": tensor ", name, ": flat_range piece [",
                    slice.begin, ", ", slice.begin + n, ") lies outside its ", numel, " elements ", global.to_string());
      if (n > 0) layout.runs.push_back({slice.begin, 0, n});
      return layout;
    case TensorSlice::Kind::dim_range:
      break;
    default:
      TESSERA_THROW(what, ": tensor ", name, ": unknown slice kind ", int(slice.kind));
  }

  const bool has_view = slice.view.ndim() > 0;
  const Shape& cut = has_view ? slice.view : global;
  const std::string of_cut =
      has_view ? " of view " + cut.to_string() + " (tensor shape " + global.to_string() + ")" : "";
  if (has_view)
    TESSERA_CHECK(cut.numel() == numel, what, ": tensor ", name, ": dim_range view ", cut.to_string(), " holds ",
                  cut.numel(), " elements but the tensor ", global.to_string(), " has ", numel,
                  "; a view must reshape the tensor, not resize it");
  TESSERA_CHECK(slice.dim >= 0 && slice.dim < cut.ndim(), what, ": tensor ", name, ": dim_range along dimension ",
                slice.dim, " of ", has_view ? "view " : "a tensor of shape ", cut.to_string());
  const int64_t size = cut[slice.dim];
  const int64_t per_index = size > 0 ? cut.numel() / size : 0;  // elements of one index along dim
  int64_t count = 0;
  if (slice.sub_range) {
    count = slice.shard_length;
  } else if (!has_view) {
    TESSERA_CHECK(local_shape.ndim() == global.ndim(), what, ": tensor ", name, ": a dim_range piece must have the ",
                  "tensor's ", global.ndim(), " dimensions, it has shape ", local_shape.to_string(),
                  " (give the slice a view to cut a tensor with another local shape)");
    for (int d = 0; d < global.ndim(); ++d)
      TESSERA_CHECK(d == slice.dim || local_shape[d] == global[d], what, ": tensor ", name, ": dim_range piece ",
                    local_shape.to_string(), " along dimension ", slice.dim, " differs from the tensor ",
                    global.to_string(), " in dimension ", d);
    count = local_shape[slice.dim];
  } else if (per_index > 0) {
    TESSERA_CHECK(n % per_index == 0, what, ": tensor ", name, ": a dim_range piece along dimension ", slice.dim,
                  of_cut, " holds a whole number of indices of ", per_index, " elements each, but its local tensor ",
                  local_shape.to_string(), " has ", n, " elements");
    count = n / per_index;
  } else {
    TESSERA_CHECK(n == 0, what, ": tensor ", name, ": the tensor is empty but the dim_range piece ",
                  local_shape.to_string(), " has ", n, " elements");
  }
  TESSERA_CHECK(slice.begin >= 0 && count >= 0 && slice.begin + count <= size, what, ": tensor ", name,
                ": dim_range piece [", slice.begin, ", ", slice.begin + count, ") along dimension ", slice.dim,
                " lies outside its size ", size, has_view ? of_cut : " (shape " + global.to_string() + ")");
  layout.cut = cut;
  layout.count = count;
  const int64_t shard_numel = per_index * count;
  int64_t first = 0;
  if (slice.sub_range) {
    first = slice.sub_begin;
    TESSERA_CHECK(first >= 0 && first + n <= shard_numel, what, ": tensor ", name, ": sub-range [", first, ", ",
                  first + n, ") lies outside the ", shard_numel, " elements of its dim_range shard [", slice.begin,
                  ", ", slice.begin + count, ") along dimension ", slice.dim, has_view ? of_cut : "");
  } else {
    TESSERA_CHECK(slice.sub_begin == 0 && slice.shard_length == 0, what, ": tensor ", name,
                  ": sub_begin and shard_length describe a sub-range; set sub_range (with_sub_range()) or leave "
                  "them 0");
  }
  if (n > 0) layout.runs = dim_runs(cut, slice.dim, slice.begin, count, first, n);
  return layout;
}

// Copies a piece's elements into their places in the whole tensor
// (row-major), or out of them.
void scatter_runs(const std::vector<Run>& runs, size_t element_size, const std::byte* piece, std::byte* whole) {
  for (const Run& run : runs)
    std::memcpy(whole + size_t(run.global) * element_size, piece + size_t(run.piece) * element_size,
                size_t(run.count) * element_size);
}

void gather_runs(const std::vector<Run>& runs, size_t element_size, const std::byte* whole, std::byte* piece) {
  for (const Run& run : runs)
    std::memcpy(piece + size_t(run.piece) * element_size, whole + size_t(run.global) * element_size,
                size_t(run.count) * element_size);
}

void check_tensor_name(const std::string& name, const std::string& what) {
  TESSERA_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos, what,
                ": tensor name '", name,
                "' cannot be stored; names must be non-empty, without '/', and not '.' or '..'");
}

void check_piece_local(const TensorPiece& piece, const std::string& what) {
  check_tensor_name(piece.name, what);
  TESSERA_CHECK(piece.local.defined(), what, ": tensor ", piece.name, ": the piece's local tensor is undefined");
  TESSERA_CHECK(piece.local.dtype() == piece.dtype, what, ": tensor ", piece.name, ": the piece says ",
                dtype_name(piece.dtype), " but its local tensor holds ", dtype_name(piece.local.dtype()));
}

// A host pointer to `tensor`'s bytes, copying from a device when needed
// (`staging` keeps the copy alive).
const std::byte* host_bytes(const Tensor& tensor, Tensor& staging) {
  if (tensor.device().is_cpu()) return static_cast<const std::byte*>(tensor.data_ptr());
  staging = tensor.to(Device::cpu());
  return static_cast<const std::byte*>(staging.data_ptr());
}

// ---------------------------------------------------------------------------
// Piece descriptors, serialised for the all-gather.

struct PieceInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape global;
  TensorSlice slice;
  Shape local;
  bool owner = true;
  int rank = 0;
  int index = 0;  // in that rank's `pieces`
};

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

struct TensorPlan {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  std::vector<const PieceInfo*> owned;  // in (rank, index) order
};

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

// ---------------------------------------------------------------------------
// The writer (rank 0): HDF5 file in the temporary directory.

Hdf5Handle group_handle(hid_t id) {
  return {id, H5Gclose};
}

Hdf5Handle create_group(const std::string& path, hid_t parent, const char* name) {
  return group_handle(TESSERA_HDF5_CHECK_AT(path, H5Gcreate2(parent, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
}

Hdf5Handle create_dataspace(const std::string& path, const Shape& shape) {
  if (shape.ndim() == 0) return dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate(H5S_SCALAR)));
  std::vector<hsize_t> dims(shape.sizes().begin(), shape.sizes().end());
  return dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(int(dims.size()), dims.data(), nullptr)));
}

void write_u32_attribute(const std::string& path, hid_t object, const char* name, uint32_t value) {
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate(H5S_SCALAR)));
  Hdf5Handle attribute = attribute_handle(
      TESSERA_HDF5_CHECK_AT(path, H5Acreate2(object, name, H5T_STD_U32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT)));
  TESSERA_HDF5_CHECK_AT(path, H5Awrite(attribute.get(), H5T_NATIVE_UINT32, &value));
}

// A dataset `name` in `group` holding `bytes` (row-major, `dtype`), with its
// dtype and checksum attributes.
void write_tensor_dataset(const std::string& path, hid_t group, const std::string& name, const Shape& shape,
                          DType dtype, const void* bytes) {
  Hdf5Handle space = create_dataspace(path, shape);
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(
      path, H5Dcreate2(group, name.c_str(), file_type_of(dtype), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
  if (shape.numel() > 0)
    TESSERA_HDF5_CHECK_AT(path, H5Dwrite(dataset.get(), memory_type_of(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes));
  write_string_attribute(path, dataset.get(), kDtypeAttribute, dtype_name(dtype));
  write_u32_attribute(path, dataset.get(), kCrcAttribute, crc32_of(bytes, size_t(shape.numel()) * dtype_size(dtype)));
}

class CheckpointWriter {
 public:
  CheckpointWriter(const fs::path& directory, int64_t step, int ranks, const CheckpointMetadata& metadata)
      : path_((directory / kCheckpointFile).string()) {
    Hdf5QuietErrors quiet;
    // Format 1.8 or later: attributes over 64 KiB (a long config value) go to dense storage.
    Hdf5Handle access = property_list_handle(TESSERA_HDF5_CHECK_AT(path_, H5Pcreate(H5P_FILE_ACCESS)));
    TESSERA_HDF5_CHECK_AT(path_, H5Pset_libver_bounds(access.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST));
    const hid_t id = H5Fcreate(path_.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, access.get());
    if (id < 0)
      throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fcreate", __FILE__, __LINE__, {}},
                  "cannot create " + path_ + ": " + tessera::detail::hdf5_error_stack());
    file_ = file_handle(id);
    write_int64_attribute(path_, file_.get(), kFormatAttribute, kCheckpointFormat);
    write_int64_attribute(path_, file_.get(), "step", step);
    write_int64_attribute(path_, file_.get(), "ranks_saved", ranks);
    Hdf5Handle group = create_group(path_, file_.get(), "metadata");
    for (const auto& [key, value] : metadata) write_string_attribute(path_, group.get(), key.c_str(), value);
    tensors_ = create_group(path_, file_.get(), "tensors");
    ranks_ = create_group(path_, file_.get(), "ranks");
  }

  const std::string& path() const { return path_; }

  void write_tensor(const TensorPlan& plan, const void* bytes) {
    Hdf5QuietErrors quiet;
    write_tensor_dataset(path_, tensors_.get(), plan.name, plan.shape, plan.dtype, bytes);
  }

  void write_rank_state(int rank, const std::string& key, const std::vector<uint8_t>& bytes) {
    Hdf5QuietErrors quiet;
    const std::string group_name = std::to_string(rank);
    if (!rank_group_.valid() || rank_group_rank_ != rank) {
      rank_group_.reset();
      rank_group_ = create_group(path_, ranks_.get(), group_name.c_str());
      rank_group_rank_ = rank;
    }
    write_tensor_dataset(path_, rank_group_.get(), key, Shape{int64_t(bytes.size())}, DType::u8, bytes.data());
  }

  // Flushes and closes the file, then fsyncs it.
  void close() {
    {
      Hdf5QuietErrors quiet;
      rank_group_.reset();
      ranks_.reset();
      tensors_.reset();
      TESSERA_HDF5_CHECK_AT(path_, H5Fflush(file_.get(), H5F_SCOPE_GLOBAL));  // errors surface here, not in close
      file_.reset();
    }
    fsync_path(path_, false);
  }

 private:
  std::string path_;
  Hdf5Handle file_, tensors_, ranks_, rank_group_;
  int rank_group_rank_ = -1;
};

// Removes `.step_*.tmp` directories left by crashed saves (rank 0, before writing).
void remove_stale_temporaries(const fs::path& dir) {
  std::error_code error;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error))
    if (is_temporary_name(it->path().filename().string())) stale.push_back(it->path());
  for (const fs::path& path : stale) {
    std::error_code removal;
    fs::remove_all(path, removal);
    TESSERA_CHECK(!removal, "cannot remove ", path.string(), " (left by an interrupted save): ", removal.message());
  }
}

// Moves `temporary` to `final_path`; an existing `final_path` (the same step
// saved again) is replaced atomically where the file system can swap.
void publish_directory(const fs::path& temporary, const fs::path& final_path) {
  std::error_code error;
  if (!fs::exists(final_path, error)) {
    rename_path(temporary, final_path);
    return;
  }
  if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(temporary, error);  // now the old checkpoint; a leftover is removed by the next save
    return;
  }
  std::string aside_name = ".";  // (built by appends: GCC 12 misreports `"." + string` under -Wrestrict)
  aside_name += final_path.filename().string();
  aside_name += ".replaced.tmp";
  const fs::path aside = final_path.parent_path() / aside_name;
  fs::remove_all(aside, error);
  rename_path(final_path, aside);
  rename_path(temporary, final_path);
  fs::remove_all(aside, error);
}

// Keeps the newest `keep` checkpoints and the one `latest` names; a
// checkpoint that cannot be removed is reported on stderr (the new one is
// already safe, so this is no reason to fail the save).
void prune(const fs::path& dir, int keep, const std::string& latest) {
  if (keep <= 0) return;
  std::vector<StepDirectory> steps = list_step_directories(dir);
  if (int(steps.size()) <= keep) return;
  for (size_t i = 0; i + size_t(keep) < steps.size(); ++i) {
    if (steps[i].path.filename() == latest) continue;
    std::error_code error;
    fs::remove_all(steps[i].path, error);
    if (error)
      std::fprintf(stderr, "tessera: warning: cannot remove old checkpoint %s (--keep-checkpoints %d): %s\n",
                   steps[i].path.c_str(), keep, error.message().c_str());
  }
}

// An exception's message without tessera::Error's context lines (for wrapping).
std::string message_of(const std::exception& error) {
  const auto* ours = dynamic_cast<const Error*>(&error);
  std::string message = ours ? ours->message() : error.what();
  return message.empty() ? "unknown error" : message;
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

std::vector<std::string> other_checkpoints(const fs::path& save_dir, const fs::path& except) {
  std::vector<std::string> names;
  for (const StepDirectory& found : list_step_directories(save_dir))
    if (found.path.filename() != except.filename()) names.push_back(found.path.filename().string());
  return names;
}

// What to tell a user whose checkpoint in `directory` is corrupt: the newest
// other checkpoint of the same --save directory, as the flag to resume it.
std::string corrupt_advice(const fs::path& directory) {
  const fs::path save_dir = directory.parent_path();
  const std::vector<std::string> others = other_checkpoints(save_dir, directory);
  if (others.empty())
    return "the checkpoint is corrupt and " + save_dir.string() +
           " holds no other; start afresh (another --save directory, or remove this one)";
  return "the checkpoint is corrupt; resume from an earlier one: --resume " + (save_dir / others.back()).string() +
         " (the files are left as they are)";
}

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

// A full disk, said so that a user can act: the save directory's
// filesystem, the room it has, what the checkpoint needs, what to do.
// `while_writing`: the write itself ran out of room (the partial checkpoint
// is already removed again); with bytes to spare, files (inodes) or a quota
// ran out.
std::string no_room_message(const fs::path& save_dir, int64_t needed, bool while_writing) {
  std::error_code error;
  const fs::space_info space = fs::space(save_dir, error);
  const std::string free = error ? "an unknown amount" : human_bytes(double(space.available));
  std::string text;
  if (!while_writing)
    text = "the filesystem of " + save_dir.string() + " has " + free + " free, the checkpoint needs about " +
           human_bytes(double(needed));
  else if (!error && space.available >= std::uintmax_t(needed))
    text = "the filesystem of " + save_dir.string() + " has " + free + " free but no room for more files (inodes) " +
           "or a quota is exhausted";
  else
    text = "the filesystem of " + save_dir.string() + " ran out of space while writing the checkpoint (about " +
           human_bytes(double(needed)) + "; " + free + " free without it)";
  return text + "; free space there, keep fewer checkpoints (--keep-checkpoints N), or --save to a larger filesystem";
}

// Whether the save directory's filesystem has room for `needed` bytes
// (true when it cannot tell).
bool has_room(const fs::path& save_dir, int64_t needed) {
  std::error_code error;
  const fs::space_info space = fs::space(save_dir, error);
  return error || space.available >= std::uintmax_t(needed);
}

}  // namespace

// ---------------------------------------------------------------------------
// Slices of parameter shards

TensorSlice shard_slice(const nn::ParameterShard& shard) {
  if (!shard.split) return {};
  return TensorSlice::along(shard.dim, shard.begin, shard.cut_shape());
}

TensorSlice shard_slice(const nn::ParameterShard& shard, int64_t sub_begin) {
  if (!shard.split) return TensorSlice::flat(sub_begin);
  return shard_slice(shard).with_sub_range(sub_begin, shard.length);
}

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
        if (ok()) attempt([&] { writer_->write_rank_state(r, key, bytes); });
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
  const fs::path temporary = save_dir / (std::string(".") + step_directory_name(step) + ".tmp");
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

void check_save_directory(const std::string& dir) {
  const std::string fix = "; give --save a directory this rank can create and write (it is checked at the start)";
  TESSERA_CHECK(!dir.empty(), "--save is empty", fix);
  std::error_code error;
  fs::create_directories(dir, error);
  TESSERA_CHECK(!error, "--save ", dir, ": cannot create the directory: ", error.message(), fix);
  TESSERA_CHECK(fs::is_directory(dir, error), "--save ", dir, " is not a directory", fix);
  const fs::path probe = fs::path(dir) / (".tessera-write-test." + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TESSERA_CHECK(fd >= 0, "--save ", dir, ": cannot write in it: ", errno_text(errno), fix);
  const ssize_t written = ::write(fd, "ok\n", 3);
  const int write_error = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  TESSERA_CHECK(written == 3, "--save ", dir, ": cannot write in it: ", errno_text(write_error), fix);
}

// ---------------------------------------------------------------------------
// find_latest_checkpoint

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  const fs::path save_dir(dir);
  std::error_code error;
  if (!fs::is_directory(save_dir, error)) return std::nullopt;
  const std::string latest = read_latest_name(save_dir);
  if (!latest.empty() && parse_step_name(latest) && fs::exists(save_dir / latest / kCheckpointFile, error))
    return (save_dir / latest).string();
  const std::vector<StepDirectory> steps = list_step_directories(save_dir);
  if (steps.empty()) return std::nullopt;
  return steps.back().path.string();
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> paths;
  for (const StepDirectory& found : list_step_directories(dir)) paths.push_back(found.path.string());
  return paths;
}

// ---------------------------------------------------------------------------
// CheckpointReader

struct CheckpointReader::State {
  std::string path;    // the HDF5 file
  fs::path directory;  // the step directory
  Hdf5Handle file, tensors_group;
  int64_t step = 0;
  int ranks_saved = 0;
  CheckpointMetadata metadata;
  std::vector<StoredTensor> tensors;
  std::map<std::string, size_t> index;
  std::vector<std::pair<std::string, std::string>> damaged;  // tensor name, HDF5's complaint
  // The last tensor read() read, checksum verified: pieces of one tensor are
  // read one after another, and each would otherwise read and check it whole.
  mutable std::string cached_name;
  mutable std::vector<std::byte> cached_bytes;

  // The whole tensor's verified bytes, through the one-entry cache.
  const std::vector<std::byte>& whole_verified(const StoredTensor& tensor) const {
    if (cached_name != tensor.name) {
      cached_name.clear();
      cached_bytes.clear();
      cached_bytes.shrink_to_fit();  // the old tensor goes before the new one is read
      cached_bytes = read_verified(tensor);
      cached_name = tensor.name;
    }
    return cached_bytes;
  }

  // The whole tensor's bytes, checksum verified (throws naming tensor and file).
  std::vector<std::byte> read_verified(const StoredTensor& tensor) const {
    std::vector<std::byte> bytes = read_raw(tensor);
    const uint32_t crc = crc32_of(bytes.data(), bytes.size());
    TESSERA_CHECK(crc == tensor.crc32, "checksum mismatch in tensor ", tensor.name, " of ", path, ": ",
                  corrupt_advice(directory));
    return bytes;
  }

  std::vector<std::byte> read_raw(const StoredTensor& tensor) const {
    Hdf5QuietErrors quiet;
    std::vector<std::byte> bytes(size_t(tensor.shape.numel()) * dtype_size(tensor.dtype));
    Hdf5Handle dataset =
        dataset_handle(TESSERA_HDF5_CHECK_AT(path, H5Dopen2(tensors_group.get(), tensor.name.c_str(), H5P_DEFAULT)));
    if (!bytes.empty())
      TESSERA_HDF5_CHECK_AT(
          path, H5Dread(dataset.get(), memory_type_of(tensor.dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()));
    return bytes;
  }
};

namespace {

herr_t collect_link_name(hid_t, const char* name, const H5L_info_t*, void* names) {
  static_cast<std::vector<std::string>*>(names)->emplace_back(name);
  return 0;
}

herr_t collect_attribute_name(hid_t, const char* name, const H5A_info_t*, void* names) {
  static_cast<std::vector<std::string>*>(names)->emplace_back(name);
  return 0;
}

// Whether `name` (a path relative to `object`, every parent existing or not) is a link.
bool link_exists(hid_t object, const std::string& name) {
  Hdf5QuietErrors quiet;
  size_t at = 0;
  bool exists = true;
  while (exists) {
    at = name.find('/', at + 1);
    exists = H5Lexists(object, name.substr(0, at).c_str(), H5P_DEFAULT) > 0;
    if (at == std::string::npos) break;
  }
  H5Eclear2(H5E_DEFAULT);
  return exists;
}

fs::path resolve_checkpoint_file(const std::string& path) {
  std::error_code error;
  const fs::path given(path);
  TESSERA_CHECK(fs::exists(given, error), "checkpoint ", path, " does not exist; check the path (--resume)");
  if (!fs::is_directory(given, error)) return given;
  const fs::path file = given / kCheckpointFile;
  if (fs::exists(file, error)) return file;
  const bool save_dir = fs::exists(given / kLatestFile, error) || !list_step_directories(given).empty();
  TESSERA_THROW(path, " holds no ", kCheckpointFile,
                save_dir ? ": it is a save directory; pass one of its step_* directories (or --resume auto)"
                         : ": it is not a checkpoint directory");
}

}  // namespace

namespace {

// The innermost entry of an HDF5 error message ("#5 H5B__cache_deserialize:
// wrong B-tree signature (...)"): what is damaged, without the call chain.
std::string innermost_hdf5_error(const std::string& message) {
  const size_t last = message.rfind("; #");
  return last == std::string::npos ? message : message.substr(last + 2);
}

// Runs `read` (part of opening a checkpoint); an HDF5 failure there means the
// file's metadata is damaged: said as a corrupt checkpoint is, naming `part`.
template <typename Read>
void read_part(const std::string& path, const fs::path& directory, const std::string& part, Read&& read) {
  try {
    read();
  } catch (const Error& error) {
    if (error.library() != "HDF5") throw;
    TESSERA_THROW("checkpoint ", path, " is damaged: HDF5 cannot read ", part, " (",
                  innermost_hdf5_error(error.message()), "); ", corrupt_advice(directory));
  }
}

// A tensor's stored description, from its dataset's header.
StoredTensor read_stored_tensor(const std::string& p, const fs::path& directory, hid_t tensors_group,
                                const std::string& name) {
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(p, H5Dopen2(tensors_group, name.c_str(), H5P_DEFAULT)));
  StoredTensor stored;
  stored.name = name;
  TESSERA_CHECK(has_attribute(dataset.get(), kDtypeAttribute) && has_attribute(dataset.get(), kCrcAttribute), p,
                ": tensor ", name, " lacks its '", kDtypeAttribute, "' or '", kCrcAttribute,
                "' attribute: ", corrupt_advice(directory));
  stored.dtype = parse_dtype(read_string_attribute(p, dataset.get(), kDtypeAttribute));
  stored.crc32 = uint32_t(read_int64_attribute(p, dataset.get(), kCrcAttribute));
  const std::vector<int64_t> dims = dataset_dims(p, dataset.get());
  TESSERA_CHECK(dims.size() <= size_t(Shape::kMaxDims), p, ": tensor ", name, " has ", dims.size(),
                " dimensions, more than ", Shape::kMaxDims);
  const std::optional<int64_t> count = element_count(dims);
  TESSERA_CHECK(count && *count <= std::numeric_limits<int64_t>::max() / 8, p, ": tensor ", name,
                " claims more elements than a file can hold: ", corrupt_advice(directory));
  TESSERA_CHECK(all_elements_stored(p, dataset.get()), p, ": tensor ", name,
                " has no data stored for some or all of its elements (created but not completely written): ",
                corrupt_advice(directory));
  stored.shape = Shape(dims);
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(p, H5Dget_type(dataset.get())));
  TESSERA_CHECK(
      H5Tget_class(type.get()) == type_class_of(stored.dtype) && H5Tget_size(type.get()) == dtype_size(stored.dtype), p,
      ": tensor ", name, " is tagged ", dtype_name(stored.dtype),
      " but its HDF5 type does not match: ", corrupt_advice(directory));
  return stored;
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& path) : state_(new State) {
  std::unique_ptr<State> state(state_);
  const fs::path file = resolve_checkpoint_file(path);
  state->path = file.string();
  state->directory = file.parent_path();
  check_readable_file(state->path, "checkpoint", "check the path (--resume)");
  const std::string& p = state->path;
  const fs::path& directory = state->directory;
  Hdf5QuietErrors quiet;
  read_part(p, directory, "its superblock (the file's header: it cannot be opened as an HDF5 file)", [&] {
    const hid_t id = H5Fopen(p.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (id < 0)
      throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fopen", __FILE__, __LINE__, {}},
                  tessera::detail::hdf5_error_stack());
    state->file = file_handle(id);
  });
  const hid_t root = state->file.get();
  read_part(p, directory, "its root attributes (format, step, ranks)", [&] {
    const std::optional<bool> tagged = attribute_exists(root, kFormatAttribute);
    if (!tagged) TESSERA_HDF5_CHECK_AT(p, H5Aexists(root, kFormatAttribute));  // damaged: HDF5's reason
    TESSERA_CHECK(*tagged, p, " is not a Tessera checkpoint: its root has no '", kFormatAttribute,
                  "' attribute (a dataset file? checkpoints are step_* directories written by --save); if it is one, ",
                  corrupt_advice(directory));
    const int64_t format = read_int64_attribute(p, root, kFormatAttribute);
    TESSERA_CHECK(format <= kCheckpointFormat, p, " is checkpoint format ", format,
                  ", newer than this build reads (up to ", kCheckpointFormat, "); load it with a newer tessera");
    TESSERA_CHECK(format >= 1, p, ": invalid checkpoint format ", format, "; ", corrupt_advice(directory));
    state->step = read_int64_attribute(p, root, "step");
    state->ranks_saved = int(read_int64_attribute(p, root, "ranks_saved"));
  });
  TESSERA_CHECK(link_exists(root, "tensors"), p, ": it has no /tensors group: ", corrupt_advice(directory));
  read_part(p, directory, "its metadata (/metadata)", [&] {
    if (!link_exists(root, "metadata")) return;
    Hdf5Handle group = group_handle(TESSERA_HDF5_CHECK_AT(p, H5Gopen2(root, "metadata", H5P_DEFAULT)));
    std::vector<std::string> keys;
    TESSERA_HDF5_CHECK_AT(p,
                          H5Aiterate2(group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_attribute_name, &keys));
    for (const std::string& key : keys) state->metadata[key] = read_string_attribute(p, group.get(), key.c_str());
  });
  std::vector<std::string> names;
  read_part(p, directory, "its list of tensors (/tensors)", [&] {
    state->tensors_group = group_handle(TESSERA_HDF5_CHECK_AT(p, H5Gopen2(root, "tensors", H5P_DEFAULT)));
    TESSERA_HDF5_CHECK_AT(
        p, H5Literate(state->tensors_group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_link_name, &names));
  });
  for (const std::string& name : names) {
    try {
      StoredTensor stored = read_stored_tensor(p, directory, state->tensors_group.get(), name);
      state->index[name] = state->tensors.size();
      state->tensors.push_back(std::move(stored));
    } catch (const Error& error) {
      if (error.library() != "HDF5") throw;
      state->damaged.emplace_back(name, innermost_hdf5_error(error.message()));
    }
  }
  state.release();
}

CheckpointReader::~CheckpointReader() {
  delete state_;
}

const std::string& CheckpointReader::path() const {
  return state_->path;
}
int64_t CheckpointReader::step() const {
  return state_->step;
}
const CheckpointMetadata& CheckpointReader::metadata() const {
  return state_->metadata;
}
const std::vector<StoredTensor>& CheckpointReader::tensors() const {
  return state_->tensors;
}
bool CheckpointReader::has_tensor(const std::string& name) const {
  return state_->index.count(name) > 0;
}
int CheckpointReader::ranks_saved() const {
  return state_->ranks_saved;
}
const std::vector<std::pair<std::string, std::string>>& CheckpointReader::damaged() const {
  return state_->damaged;
}

std::optional<std::vector<uint8_t>> CheckpointReader::rank_state(int world_rank, const std::string& key) const {
  const std::string& p = state_->path;
  const std::string link = "ranks/" + std::to_string(world_rank) + "/" + key;
  const hid_t root = state_->file.get();
  if (key.empty() || key.find('/') != std::string::npos || !link_exists(root, link)) return std::nullopt;
  Hdf5QuietErrors quiet;
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(p, H5Dopen2(root, link.c_str(), H5P_DEFAULT)));
  const std::vector<int64_t> dims = dataset_dims(p, dataset.get());
  TESSERA_CHECK(dims.size() == 1, p, ": rank state ", link, " must be a 1-D byte dataset");
  TESSERA_CHECK(all_elements_stored(p, dataset.get()), p, ": rank state ", link,
                " has no data stored for some or all of its bytes: ", corrupt_advice(state_->directory));
  std::vector<uint8_t> bytes(static_cast<size_t>(dims[0]));
  if (!bytes.empty())
    TESSERA_HDF5_CHECK_AT(p, H5Dread(dataset.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()));
  if (has_attribute(dataset.get(), kCrcAttribute)) {
    const uint32_t expected = uint32_t(read_int64_attribute(p, dataset.get(), kCrcAttribute));
    TESSERA_CHECK(crc32_of(bytes.data(), bytes.size()) == expected, "checksum mismatch in rank state ", link, " of ", p,
                  ": ", corrupt_advice(state_->directory));
  }
  return bytes;
}

std::vector<std::string> CheckpointReader::rank_state_keys(int world_rank) const {
  const std::string group_name = "ranks/" + std::to_string(world_rank);
  std::vector<std::string> keys;
  if (!link_exists(state_->file.get(), group_name)) return keys;
  Hdf5QuietErrors quiet;
  Hdf5Handle group =
      group_handle(TESSERA_HDF5_CHECK_AT(state_->path, H5Gopen2(state_->file.get(), group_name.c_str(), H5P_DEFAULT)));
  TESSERA_HDF5_CHECK_AT(state_->path,
                        H5Literate(group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_link_name, &keys));
  return keys;
}

void CheckpointReader::read(TensorPiece& piece) const {
  const std::string what = "loading " + state_->path;
  check_piece_local(piece, what);
  const auto found = state_->index.find(piece.name);
  for (const auto& [name, complaint] : state_->damaged)
    TESSERA_CHECK(name != piece.name, "checkpoint ", state_->path,
                  " is damaged: HDF5 cannot read the header of tensor ", name, " (", complaint, "); ",
                  corrupt_advice(state_->directory));
  if (found == state_->index.end()) {
    std::string names;
    for (size_t i = 0; i < state_->tensors.size() && i < 8; ++i) names += (i ? ", " : "") + state_->tensors[i].name;
    if (state_->tensors.size() > 8) names += ", ...";
    TESSERA_THROW(what, ": the checkpoint has no tensor ", piece.name, " (it has ", state_->tensors.size(),
                  " tensors: ", names, "); was it saved from another model? (`tessera checkpoint inspect` lists them)");
  }
  const StoredTensor& stored = state_->tensors[found->second];
  TESSERA_CHECK(stored.shape == piece.global_shape, what, ": tensor ", piece.name, " has shape ",
                stored.shape.to_string(), " in the checkpoint but ", piece.global_shape.to_string(),
                " here; the checkpoint was saved with a different model configuration");
  TESSERA_CHECK(stored.dtype == piece.dtype, what, ": tensor ", piece.name, " is ", dtype_name(stored.dtype),
                " in the checkpoint but ", dtype_name(piece.dtype),
                " here; the checkpoint was saved with a different precision (--precision)");
  const PieceLayout layout = piece_layout(piece.name, piece.global_shape, piece.slice, piece.local.shape(), what);
  const std::vector<std::byte>& whole = state_->whole_verified(stored);
  const size_t element_size = dtype_size(stored.dtype);
  if (piece.local.device().is_cpu()) {
    gather_runs(layout.runs, element_size, whole.data(), static_cast<std::byte*>(piece.local.data_ptr()));
    return;
  }
  Tensor host = piece.local.context().empty(piece.local.shape(), piece.dtype, Device::cpu());
  gather_runs(layout.runs, element_size, whole.data(), static_cast<std::byte*>(host.data_ptr()));
  piece.local.copy_(host);
}

std::vector<std::string> CheckpointReader::verify() const {
  std::vector<std::string> bad;
  for (const auto& [name, complaint] : state_->damaged) bad.push_back(name);
  for (const StoredTensor& tensor : state_->tensors) {
    try {
      const std::vector<std::byte> bytes = state_->read_raw(tensor);
      if (crc32_of(bytes.data(), bytes.size()) != tensor.crc32) bad.push_back(tensor.name);
    } catch (const Error&) {
      bad.push_back(tensor.name);  // unreadable counts as corrupt
    }
  }
  return bad;
}

}  // namespace tessera::io
