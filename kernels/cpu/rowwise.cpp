// CpuBackend: softmax, cross-entropy (whole and vocabulary-parallel), LayerNorm
// and RMSNorm (functors in kernels/functors/rowwise.h). Row functors run
// through cpu_for_each_row, per-row scalars through cpu_for_each_index; the
// norms' weight/bias gradients through cpu_for_each_column_sum below, which
// splits the columns across threads and adds rows in order (vectorised across
// columns), so every total is the same whatever the thread count.
#include "kernels/functors/rowwise.h"

#include <algorithm>
#include <cstdint>

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/row_launch.h"
#include "kernels/validate.h"

namespace tessera {
namespace {

// Columns summed together by one thread; the accumulators (kTerms × this
// many floats) stay in L1.
constexpr int64_t kMaxColumnBlock = 1024;

// For every column c in [0, cols): op.store(c, Σ_rows op.term(row, c)), rows added in order.
template <typename Op>
void cpu_for_each_column_sum(int64_t rows, int64_t cols, const Op& op) {
  constexpr int kTerms = Op::kTerms;
  // Enough blocks for every thread, each a multiple of 16 columns (one AVX-512 vector).
  const int64_t threads = std::max(1, omp_get_max_threads());
  int64_t block = std::min(kMaxColumnBlock, (cols + threads - 1) / threads);
  block = std::max<int64_t>(16, (block + 15) / 16 * 16);
  const int64_t blocks = (cols + block - 1) / block;
  // Below ~32k elements a single thread is faster than waking the others.
  const int64_t grain = rows * cols < (int64_t(1) << 15) ? blocks : 1;
  parallel_for(blocks, grain, [&](int64_t block_begin, int64_t block_end) {
    alignas(64) float sums[kTerms][kMaxColumnBlock];
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t col0 = b * block, width = std::min(block, cols - col0);
      for (int k = 0; k < kTerms; ++k) std::fill_n(sums[k], width, 0.0f);
      for (int64_t row = 0; row < rows; ++row) {
        TESSERA_SIMD
        for (int64_t c = 0; c < width; ++c) {
          const ColumnSums<kTerms> term = op.term(row, col0 + c);
          for (int k = 0; k < kTerms; ++k) sums[k][c] += term.v[k];
        }
      }
      for (int64_t c = 0; c < width; ++c) {
        ColumnSums<kTerms> total;
        for (int k = 0; k < kTerms; ++k) total.v[k] = sums[k][c];
        op.store(col0 + c, total);
      }
    }
  });
}

}  // namespace

void CpuBackend::softmax_forward(const Tensor& x, Tensor& y) {
  dispatch_float(x.dtype(), "softmax_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x);
    cpu_for_each_row(ops::detail::rows(x), d, SoftmaxForward<T>{x.data<T>(), y.data<T>(), d});
  });
}

void CpuBackend::softmax_backward(const Tensor& y, const Tensor& grad_y, Tensor& grad_x) {
  dispatch_float(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(y);
    cpu_for_each_row(ops::detail::rows(y), d, SoftmaxBackward<T>{y.data<T>(), grad_y.data<T>(), grad_x.data<T>(), d});
  });
}

void CpuBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp,
                                       int64_t ignore_index) {
  dispatch_float(logits.dtype(), "cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_forward targets", [&](auto index_tag) {
      using I = decltype(index_tag);
      const int64_t v = ops::detail::last_dim(logits);
      cpu_for_each_row(ops::detail::rows(logits), v,
                       CrossEntropyForward<T, I>{logits.data<T>(), targets.data<I>(), losses.data<float>(),
                                                 logsumexp.data<float>(), v, ignore_index});
    });
  });
}

void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& logsumexp, const Tensor& targets,
                                        const Tensor& grad_losses, Tensor& grad_logits, int64_t ignore_index,
                                        int64_t vocab_begin, int64_t vocab_size) {
  dispatch_float(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_backward targets", [&](auto index_tag) {
      using I = decltype(index_tag);
      const int64_t v = ops::detail::last_dim(logits);
      cpu_for_each_row(ops::detail::rows(logits), v,
                       CrossEntropyBackward<T, I>{logits.data<T>(), logsumexp.data<float>(), targets.data<I>(),
                                                  grad_losses.data<float>(), grad_logits.data<T>(), v, ignore_index,
                                                  vocab_begin, vocab_size});
    });
  });
}

void CpuBackend::cross_entropy_shard_max(const Tensor& logits, Tensor& row_max) {
  dispatch_float(logits.dtype(), "cross_entropy_shard_max", [&](auto tag) {
    using T = decltype(tag);
    const int64_t v = ops::detail::last_dim(logits);
    cpu_for_each_row(ops::detail::rows(logits), v, CrossEntropyShardMax<T>{logits.data<T>(), row_max.data<float>(), v});
  });
}

void CpuBackend::cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                          int64_t vocab_begin, Tensor& sums, int64_t ignore_index) {
  dispatch_float(logits.dtype(), "cross_entropy_shard_sums", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy_shard_sums targets", [&](auto index_tag) {
      using I = decltype(index_tag);
      const int64_t v = ops::detail::last_dim(logits), rows = ops::detail::rows(logits);
      cpu_for_each_row(rows, v,
                       CrossEntropyShardSums<T, I>{logits.data<T>(), targets.data<I>(), row_max.data<float>(),
                                                   sums.data<float>(), rows, v, vocab_begin, ignore_index});
    });
  });
}

void CpuBackend::cross_entropy_shard_finish(const Tensor& row_max, const Tensor& sums, const Tensor& targets,
                                            int64_t vocab_size, Tensor& losses, Tensor& logsumexp,
                                            int64_t ignore_index) {
  dispatch_index(targets.dtype(), "cross_entropy_shard_finish targets", [&](auto index_tag) {
    using I = decltype(index_tag);
    const int64_t rows = targets.numel();
    cpu_for_each_index(rows, CrossEntropyShardFinish<I>{row_max.data<float>(), sums.data<float>(), targets.data<I>(),
                                                        losses.data<float>(), logsumexp.data<float>(), rows, vocab_size,
                                                        ignore_index});
  });
}

void CpuBackend::layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean,
                                   Tensor& rstd, float eps) {
  dispatch_float(x.dtype(), "layernorm_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x);
    cpu_for_each_row(ops::detail::rows(x), d,
                     LayerNormForward<T>{x.data<T>(), weight.data<T>(), bias.defined() ? bias.data<T>() : nullptr,
                                         y.data<T>(), mean.data<float>(), rstd.data<float>(), d, eps});
  });
}

void CpuBackend::layernorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                    const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias,
                                    bool accumulate) {
  dispatch_float(x.dtype(), "layernorm_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x), rows = ops::detail::rows(x);
    // Column sums first: they read grad_y, which grad_x may overwrite.
    cpu_for_each_column_sum(
        rows, d,
        LayerNormParamGrad<T>{grad_y.data<T>(), x.data<T>(), mean.data<float>(), rstd.data<float>(),
                              grad_weight.data<T>(), grad_bias ? grad_bias->data<T>() : nullptr, d, accumulate});
    cpu_for_each_row(rows, d,
                     LayerNormBackward<T>{grad_y.data<T>(), x.data<T>(), weight.data<T>(), mean.data<float>(),
                                          rstd.data<float>(), grad_x.data<T>(), d});
  });
}

void CpuBackend::rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) {
  dispatch_float(x.dtype(), "rmsnorm_forward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x);
    cpu_for_each_row(ops::detail::rows(x), d,
                     RmsNormForward<T>{x.data<T>(), weight.data<T>(), y.data<T>(), rstd.data<float>(), d, eps});
  });
}

void CpuBackend::rmsnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                  Tensor& grad_x, Tensor& grad_weight, bool accumulate) {
  dispatch_float(x.dtype(), "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = ops::detail::last_dim(x), rows = ops::detail::rows(x);
    // Column sums first: they read grad_y, which grad_x may overwrite.
    cpu_for_each_column_sum(
        rows, d,
        RmsNormParamGrad<T>{grad_y.data<T>(), x.data<T>(), rstd.data<float>(), grad_weight.data<T>(), d, accumulate});
    cpu_for_each_row(
        rows, d,
        RmsNormBackward<T>{grad_y.data<T>(), x.data<T>(), weight.data<T>(), rstd.data<float>(), grad_x.data<T>(), d});
  });
}

}  // namespace tessera
