// CpuBackend: blockwise causal attention with global positions (context
// parallelism's ring; ops::attention_block_*). Runs the shared row functors
// of kernels/functors/block_attention.h with one lane per row (SerialGroup),
// OpenMP over the rows: the same math the CUDA backend runs a warp per row,
// so the CPU tests check the GPU's formulas. Rows are independent (one
// writer per output row, no atomics), so the results are deterministic.
#include "kernels/functors/block_attention.h"

#include <algorithm>

#include "core/context.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/row_launch.h"

namespace tessera {
void CpuBackend::attention_block_forward(const Tensor& q, const Tensor& kv, const Tensor& q_positions,
                                         const Tensor& k_positions, Tensor& out, Tensor& logsumexp, float scale) {
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  dispatch_float(q.dtype(), "attention_block_forward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_attention_head_dim(rows.head_dim, [&](auto max_head_dim) {
      cpu_for_each_row(
          rows.query_rows(), rows.keys * rows.head_dim,
          block_forward_row<T, decltype(max_head_dim)::value>(q, kv, q_positions, k_positions, out, logsumexp, scale));
    });
  });
}

void CpuBackend::attention_block_merge(const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out,
                                       Tensor& logsumexp) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / out.size(3));
  cpu_for_each_index(block_rows_of(out.shape()).query_rows(), block_merge(block_out, block_logsumexp, out, logsumexp),
                     grain);
}

void CpuBackend::attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,
                                          const Tensor& logsumexp, const Tensor& q_positions, const Tensor& k_positions,
                                          Tensor& grad_q, Tensor& grad_kv, float scale) {
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  Tensor delta = q.context().empty(Shape{rows.batch, rows.heads, rows.queries}, DType::f32);
  dispatch_float(q.dtype(), "attention_block_backward", [&](auto tag) {
    using T = decltype(tag);
    const AttentionDelta<T> delta_op{grad_out.data<T>(), out.data<T>(), delta.data<float>(),
                                     rows.queries,       rows.heads,    rows.head_dim};
    cpu_for_each_index(rows.query_rows(), delta_op, std::max<int64_t>(1, (int64_t(1) << 14) / rows.head_dim));
    const auto args =
        block_backward_args<T>(grad_out, q, kv, logsumexp, delta, q_positions, k_positions, grad_q, grad_kv, scale);
    dispatch_attention_head_dim(rows.head_dim, [&](auto max_head_dim) {
      constexpr int kMaxHeadDim = decltype(max_head_dim)::value;
      cpu_for_each_row(rows.query_rows(), rows.keys * rows.head_dim, BlockAttentionGradQueryRow<T, kMaxHeadDim>{args});
      const int64_t per_key = rows.queries * rows.head_dim * (rows.heads / rows.groups);
      cpu_for_each_row(rows.key_rows(), per_key, BlockAttentionGradKeyValueRow<T, kMaxHeadDim>{args});
    });
  });
}

}  // namespace tessera
