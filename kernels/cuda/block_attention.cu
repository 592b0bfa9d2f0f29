// CudaBackend: blockwise causal attention with global positions (context
// parallelism's ring; ops::attention_block_*). The row functors of
// kernels/functors/block_attention.h, a warp per row as the training
// attention's (kernels/cuda/attention.cu): forward and dQ a warp per query
// row over the block's visible keys, dK/dV a warp per key row of a key/value
// head over its query heads' queries that see it; delta = rowsum(dO∘O) and
// the log-sum-exp merge a thread per row. Every output element has one
// writer: no atomics, deterministic results.
#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/block_attention.h"

namespace tessera {
void CudaBackend::attention_block_forward(const Tensor& q, const Tensor& kv, const Tensor& q_positions,
                                          const Tensor& k_positions, Tensor& out, Tensor& logsumexp, float scale) {
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  dispatch_float(q.dtype(), "attention_block_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_attention_head_dim(rows.head_dim, [&](auto max_head_dim) {
      cuda::for_each_row(
          rows.query_rows(),
          block_forward_row<T, decltype(max_head_dim)::value>(q, kv, q_positions, k_positions, out, logsumexp, scale),
          cuda::device_stream(q));
    });
  });
}

void CudaBackend::attention_block_merge(const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out,
                                        Tensor& logsumexp) {
  cuda::for_each_index(block_rows_of(out.shape()).query_rows(), block_merge(block_out, block_logsumexp, out, logsumexp),
                       cuda::device_stream(out));
}

void CudaBackend::attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,
                                           const Tensor& logsumexp, const Tensor& q_positions,
                                           const Tensor& k_positions, Tensor& grad_q, Tensor& grad_kv, float scale) {
  const cudaStream_t stream = cuda::device_stream(q);
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  Tensor delta = q.context().empty(Shape{rows.batch, rows.heads, rows.queries}, DType::f32, q.device());
  dispatch_float(q.dtype(), "attention_block_backward", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(rows.query_rows(),
                         AttentionDelta<T>{grad_out.data<T>(), out.data<T>(), delta.data<float>(), rows.queries,
                                           rows.heads, rows.head_dim},
                         stream);
    const auto args =
        block_backward_args<T>(grad_out, q, kv, logsumexp, delta, q_positions, k_positions, grad_q, grad_kv, scale);
    dispatch_attention_head_dim(rows.head_dim, [&](auto max_head_dim) {
      constexpr int kMaxHeadDim = decltype(max_head_dim)::value;
      cuda::for_each_row(rows.query_rows(), BlockAttentionGradQueryRow<T, kMaxHeadDim>{args}, stream);
      cuda::for_each_row(rows.key_rows(), BlockAttentionGradKeyValueRow<T, kMaxHeadDim>{args}, stream);
    });
  });
}

}  // namespace tessera
