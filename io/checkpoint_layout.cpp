// Where a piece lies in its tensor (io/checkpoint_internal.h): every piece,
// whatever its slice, reduced to runs of consecutive elements of the piece's
// and the tensor's row-major flattenings; scatter and gather over them; the
// checks of a piece; the slices of parameter shards (checkpoint.h).
#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint_internal.h"

namespace tessera::io {
namespace checkpoint_detail {



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

// An exception's message without tessera::Error's context lines (for wrapping).
std::string message_of(const std::exception& error) {
  const auto* ours = dynamic_cast<const Error*>(&error);
  std::string message = ours ? ours->message() : error.what();
  return message.empty() ? "unknown error" : message;
}


}  // namespace checkpoint_detail

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


}  // namespace tessera::io
