// CudaBackend: softmax, cross-entropy (whole and vocabulary-parallel), LayerNorm
// and RMSNorm (functors in kernels/functors/rowwise.h). Row functors run one
// warp per row (cuda::for_each_row), per-row scalars one thread per row
// (cuda::for_each_index). The norms' weight/bias gradients are column sums in two
// deterministic stages: a thread per (column, chunk of rows) sums its chunk in
// row order into f32 scratch, then a thread per column adds the chunks in
// order and stores (honouring `accumulate`).
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/rowwise.h"
#include "kernels/validate.h"

namespace tessera {
namespace {

constexpr int kColumnThreads = 256;
constexpr int64_t kMaxRowChunks = 256;    // stage two adds at most this many partial sums per column
constexpr int64_t kMinRowsPerChunk = 32;  // below this, a thread's loop is too short to pay for its launch

// partial[(k·chunks + chunk)·cols + col] = Σ_{rows of chunk} op.term(row, col).v[k].
template <typename Op>
__global__ void column_partial_sums_kernel(int64_t rows, int64_t cols, int64_t rows_per_chunk, Op op, float* partial) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  const int64_t begin = chunk * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  ColumnSums<Op::kTerms> sums{};
  for (int64_t row = begin; row < end; ++row) {
    const ColumnSums<Op::kTerms> term = op.term(row, col);
#pragma unroll
    for (int k = 0; k < Op::kTerms; ++k) sums.v[k] += term.v[k];
  }
#pragma unroll
  for (int k = 0; k < Op::kTerms; ++k) partial[(k * chunks + chunk) * cols + col] = sums.v[k];
}

// op.store(col, Σ_chunks partial), chunks added in order.
template <typename Op>
__global__ void column_store_kernel(int64_t cols, int64_t chunks, Op op, const float* partial) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  ColumnSums<Op::kTerms> sums{};
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
#pragma unroll
    for (int k = 0; k < Op::kTerms; ++k) sums.v[k] += partial[(k * chunks + chunk) * cols + col];
  }
  op.store(col, sums);
}

// For every column c in [0, cols): op.store(c, Σ_rows op.term(row, c)), in a fixed order.
template <typename Op>
void for_each_column_sum(const Tensor& like, int64_t rows, int64_t cols, const Op& op, cudaStream_t stream) {
  if (cols <= 0) return;
  const int64_t rows_per_chunk = std::max(kMinRowsPerChunk, (rows + kMaxRowChunks - 1) / kMaxRowChunks);
  const int64_t chunks = std::max<int64_t>(1, (rows + rows_per_chunk - 1) / rows_per_chunk);
  // Scratch from the caching allocator: freed at return, reused only by later work on this stream.
  Tensor partial = like.context().empty(Shape{Op::kTerms * chunks * cols}, DType::f32, like.device());
  const unsigned column_blocks = unsigned((cols + kColumnThreads - 1) / kColumnThreads);
  column_partial_sums_kernel<<<dim3(column_blocks, unsigned(chunks)), kColumnThreads, 0, stream>>>(
      rows, cols, rows_per_chunk, op, partial.data<float>());
  TESSERA_CUDA_CHECK_LAUNCH();
  column_store_kernel<<<column_blocks, kColumnThreads, 0, stream>>>(cols, chunks, op, partial.data<float>());
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void CudaBackend::softmax_forward(const Tensor& x, Tensor& y) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "softmax_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x);
    cuda::for_each_row(ops::detail::rows(x), SoftmaxForward<T>{x.data<T>(), y.data<T>(), d}, stream);
  });
}

void CudaBackend::softmax_backward(const Tensor& y, const Tensor& grad_y, Tensor& grad_x) {
  const cudaStream_t stream = cuda::device_stream(y);
  dispatch_float(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(y);
    cuda::for_each_row(ops::detail::rows(y), SoftmaxBackward<T>{y.data<T>(), grad_y.data<T>(), grad_x.data<T>(), d},
                       stream);
  });
}

void CudaBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp,
                                        int64_t ignore_index) {
  const cudaStream_t stream = cuda::device_stream(logits);
  dispatch_float(logits.dtype(), "cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_forward targets", [&](auto index_tag) {
      using I = decltype(index_tag);
      const int64_t v = ops::detail::last_dim(logits);
      cuda::for_each_row(ops::detail::rows(logits),
                         CrossEntropyForward<T, I>{logits.data<T>(), targets.data<I>(), losses.data<float>(),
                                                   logsumexp.data<float>(), v, ignore_index},
                         stream);
    });
  });
}

void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& logsumexp, const Tensor& targets,
                                         const Tensor& grad_losses, Tensor& grad_logits, int64_t ignore_index,
                                         int64_t vocab_begin, int64_t vocab_size) {
  const cudaStream_t stream = cuda::device_stream(logits);
  dispatch_float(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_backward targets", [&](auto index_tag) {
      using I = decltype(index_tag);
      const int64_t v = ops::detail::last_dim(logits);
      cuda::for_each_row(ops::detail::rows(logits),
                         CrossEntropyBackward<T, I>{logits.data<T>(), logsumexp.data<float>(), targets.data<I>(),
                                                    grad_losses.data<float>(), grad_logits.data<T>(), v, ignore_index,
                                                    vocab_begin, vocab_size},
                         stream);
    });
  });
}

void CudaBackend::cross_entropy_shard_max(const Tensor& logits, Tensor& row_max) {
  const cudaStream_t stream = cuda::device_stream(logits);
  dispatch_float(logits.dtype(), "cross_entropy_shard_max", [&](auto tag) {
    using T = decltype(tag);
    const int64_t v = ops::detail::last_dim(logits);
    cuda::for_each_row(ops::detail::rows(logits), CrossEntropyShardMax<T>{logits.data<T>(), row_max.data<float>(), v},
                       stream);
  });
}

void CudaBackend::cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                           int64_t vocab_begin, Tensor& sums, int64_t ignore_index) {
  const cudaStream_t stream = cuda::device_stream(logits);
  dispatch_float(logits.dtype(), "cross_entropy_shard_sums", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_shard_sums targets", [&](auto index_tag) {
      using I = decltype(index_tag);
      const int64_t v = ops::detail::last_dim(logits), rows = ops::detail::rows(logits);
      cuda::for_each_row(rows,
                         CrossEntropyShardSums<T, I>{logits.data<T>(), targets.data<I>(), row_max.data<float>(),
                                                     sums.data<float>(), rows, v, vocab_begin, ignore_index},
                         stream);
    });
  });
}

void CudaBackend::cross_entropy_shard_finish(const Tensor& row_max, const Tensor& sums, const Tensor& targets,
                                             int64_t vocab_size, Tensor& losses, Tensor& logsumexp,
                                             int64_t ignore_index) {
  const cudaStream_t stream = cuda::device_stream(targets);
  dispatch_index(targets.dtype(), "cross_entropy_shard_finish targets", [&](auto index_tag) {
    using I = decltype(index_tag);
    const int64_t rows = targets.numel();
    cuda::for_each_index(
        rows,
        CrossEntropyShardFinish<I>{row_max.data<float>(), sums.data<float>(), targets.data<I>(), losses.data<float>(),
                                   logsumexp.data<float>(), rows, vocab_size, ignore_index},
        stream);
  });
}

void CudaBackend::layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean,
                                    Tensor& rstd, float eps) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "layernorm_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x);
    cuda::for_each_row(ops::detail::rows(x),
                       LayerNormForward<T>{x.data<T>(), weight.data<T>(), bias.defined() ? bias.data<T>() : nullptr,
                                           y.data<T>(), mean.data<float>(), rstd.data<float>(), d, eps},
                       stream);
  });
}

void CudaBackend::layernorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                     const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias,
                                     bool accumulate) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "layernorm_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x), rows = ops::detail::rows(x);
    // Column sums first: they read grad_y, which grad_x may overwrite.
    for_each_column_sum(
        x, rows, d,
        LayerNormParamGrad<T>{grad_y.data<T>(), x.data<T>(), mean.data<float>(), rstd.data<float>(),
                              grad_weight.data<T>(), grad_bias ? grad_bias->data<T>() : nullptr, d, accumulate},
        stream);
    cuda::for_each_row(rows,
                       LayerNormBackward<T>{grad_y.data<T>(), x.data<T>(), weight.data<T>(), mean.data<float>(),
                                            rstd.data<float>(), grad_x.data<T>(), d},
                       stream);
  });
}

void CudaBackend::rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "rmsnorm_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x);
    cuda::for_each_row(ops::detail::rows(x),
                       RmsNormForward<T>{x.data<T>(), weight.data<T>(), y.data<T>(), rstd.data<float>(), d, eps},
                       stream);
  });
}

void CudaBackend::rmsnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                   Tensor& grad_x, Tensor& grad_weight, bool accumulate) {
  const cudaStream_t stream = cuda::device_stream(x);
  dispatch_float(x.dtype(), "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x), rows = ops::detail::rows(x);
    // Column sums first: they read grad_y, which grad_x may overwrite.
    for_each_column_sum(
        x, rows, d,
        RmsNormParamGrad<T>{grad_y.data<T>(), x.data<T>(), rstd.data<float>(), grad_weight.data<T>(), d, accumulate},
        stream);
    cuda::for_each_row(
        rows,
        RmsNormBackward<T>{grad_y.data<T>(), x.data<T>(), weight.data<T>(), rstd.data<float>(), grad_x.data<T>(), d},
        stream);
  });
}

}  // namespace tessera
