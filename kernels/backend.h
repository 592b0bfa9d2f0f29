// Backend: the one interface every device implements (CpuBackend in
// kernels/cpu/, CudaBackend in kernels/cuda/). ops:: functions validate their
// arguments and then call the backend of the tensors' device; a backend
// method may assume shapes, dtypes and devices are consistent.
//
// Backends hold no state: handles, streams and memory come from the tensors'
// Context. Which backends exist is decided by which files CMake compiles:
// without the CUDA backend, kernels/no_cuda/ provides a cuda_backend() that
// reports how to get one.
//
// Adding an operator adds one line to TESSERA_BACKEND_OPERATORS below, which
// declares it here and in both backends (cpu/cpu_backend.h,
// cuda/cuda_backend.h), and its definition in each (see CONTRIBUTING.md).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace tessera {

enum class ReduceKind { sum, mean, max, sum_squares };

// The operators, the one list of them: X(name, (parameters)) for each. Every
// operator returns void. The Backend declares each pure virtual, and each
// backend's class body overrides them all with TESSERA_BACKEND_OVERRIDES.
// (clang-format would read `(Tensor& x` as a product: left as written.)
// clang-format off
#define TESSERA_BACKEND_OPERATORS(X)                                                                                   \
  X(matmul, (const Tensor& a, const Tensor& b, Tensor& c, const ops::MatmulOptions& options))                          \
  X(matmul_backward, (const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a, Tensor* grad_b,          \
                      bool transpose_a, bool transpose_b, bool accumulate))                                            \
  X(bias_add, (const Tensor& x, const Tensor& bias, Tensor& y))                                                        \
  X(bias_add_backward, (const Tensor& grad_y, Tensor& grad_bias, bool accumulate))                                     \
  X(relu_forward, (const Tensor& x, Tensor& y))                                                                        \
  X(relu_backward, (const Tensor& x, const Tensor& grad_y, Tensor& grad_x))                                            \
  X(gelu_forward, (const Tensor& x, Tensor& y))                                                                        \
  X(gelu_backward, (const Tensor& x, const Tensor& grad_y, Tensor& grad_x))                                            \
  X(swiglu_forward, (const Tensor& x, Tensor& y))                                                                      \
  X(swiglu_backward, (const Tensor& x, const Tensor& grad_y, Tensor& grad_x))                                          \
  X(softmax_forward, (const Tensor& x, Tensor& y))                                                                     \
  X(softmax_backward, (const Tensor& y, const Tensor& grad_y, Tensor& grad_x))                                         \
  X(cross_entropy_forward,                                                                                             \
    (const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp, int64_t ignore_index))            \
  X(cross_entropy_backward,                                                                                            \
    (const Tensor& logits, const Tensor& logsumexp, const Tensor& targets, const Tensor& grad_losses,                  \
     Tensor& grad_logits, int64_t ignore_index, int64_t vocab_begin, int64_t vocab_size))                              \
  X(cross_entropy_shard_max, (const Tensor& logits, Tensor& row_max))                                                  \
  X(cross_entropy_shard_sums, (const Tensor& logits, const Tensor& targets, const Tensor& row_max,                     \
                               int64_t vocab_begin, Tensor& sums, int64_t ignore_index))                               \
  X(cross_entropy_shard_finish, (const Tensor& row_max, const Tensor& sums, const Tensor& targets, int64_t vocab_size, \
                                 Tensor& losses, Tensor& logsumexp, int64_t ignore_index))                             \
  X(layernorm_forward,                                                                                                 \
    (const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean, Tensor& rstd, float eps))     \
  X(layernorm_backward, (const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,              \
                         const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias, bool accumulate)) \
  X(rmsnorm_forward, (const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps))                      \
  X(rmsnorm_backward, (const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd,                \
                       Tensor& grad_x, Tensor& grad_weight, bool accumulate))                                          \
  X(dropout_forward, (const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset))                            \
  X(dropout_backward, (const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset))                 \
  /* vocab_begin, vocab_size: ops::embedding_forward's (vocab_size already resolved, never 0). */                      \
  X(embedding_forward, (const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin, int64_t vocab_size)) \
  X(embedding_backward,                                                                                                \
    (const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin, int64_t vocab_size))          \
  X(attention_forward,                                                                                                 \
    (const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale, const ops::AttentionDropout& dropout))            \
  X(attention_backward, (const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,        \
                         Tensor& grad_qkv, float scale, const ops::AttentionDropout& dropout))                         \
  X(attention_with_cache,                                                                                              \
    (const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out, float scale))                     \
  X(grouped_attention_forward,                                                                                         \
    (const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale, const ops::AttentionDropout& dropout))            \
  X(grouped_attention_backward, (const Tensor& grad_out, const Tensor& qkv, const Tensor& out,                         \
                                 const Tensor& logsumexp, Tensor& grad_qkv, float scale,                               \
                                 const ops::AttentionDropout& dropout))                                                \
  X(grouped_attention_with_cache,                                                                                      \
    (const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out, float scale))                     \
  X(attention_block_forward, (const Tensor& q, const Tensor& kv, const Tensor& q_positions,                          \
                              const Tensor& k_positions, Tensor& out, Tensor& logsumexp, float scale))                 \
  X(attention_block_merge,                                                                                             \
    (const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out, Tensor& logsumexp))                          \
  X(attention_block_backward, (const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,           \
                               const Tensor& logsumexp, const Tensor& q_positions, const Tensor& k_positions,          \
                               Tensor& grad_q, Tensor& grad_kv, float scale))                                          \
  X(rotary_forward, (const Tensor& qkv, const Tensor& positions, Tensor& out, float base))                             \
  X(rotary_backward, (const Tensor& grad_out, const Tensor& positions, Tensor& grad_qkv, float base))                  \
  X(split_qkv, (const Tensor& qkv, bool grouped, Tensor& q, Tensor& kv))                                               \
  X(join_qkv, (const Tensor& grad_q, const Tensor& grad_kv, bool grouped, Tensor& grad_qkv))                           \
  X(moe_route, (const Tensor& logits, Tensor& probs, Tensor& experts, Tensor& weights, Tensor& logsumexp))            \
  X(moe_route_backward, (const Tensor& probs, const Tensor& experts, const Tensor& weights,                            \
                         const Tensor& grad_weights, const Tensor* grad_probs, const Tensor* grad_logsumexp,           \
                         Tensor& grad_logits))                                                                         \
  X(moe_permute, (const Tensor& x, const Tensor& pairs, int64_t top_k, Tensor& out))                                  \
  X(moe_permute_backward, (const Tensor& grad_slots, const Tensor& slot_of, Tensor& grad_x))                           \
  X(moe_combine, (const Tensor& ys, const Tensor& slot_of, const Tensor& weights, Tensor& out))                        \
  X(moe_combine_backward, (const Tensor& grad_out, const Tensor& ys, const Tensor& pairs, const Tensor& slot_of,       \
                           const Tensor& weights, Tensor& grad_ys, Tensor& grad_weights))                              \
  X(conv2d_forward,                                                                                                    \
    (const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, const ops::Conv2dParams& params))           \
  X(conv2d_backward, (const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x,                     \
                      Tensor* grad_weight, Tensor* grad_bias, const ops::Conv2dParams& params, bool accumulate))       \
  X(maxpool2d_forward, (const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& params))                 \
  X(maxpool2d_backward,                                                                                                \
    (const Tensor& grad_y, const Tensor& indices, Tensor& grad_x, const ops::Pool2dParams& params))                    \
  X(reduce, (ReduceKind kind, const Tensor& x, Tensor& out))                                                           \
  X(reduce_backward, (ReduceKind kind, const Tensor& x, const Tensor& grad_out, Tensor& grad_x))                       \
  X(adamw_step,                                                                                                        \
    (Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const ops::AdamWParams& params, Tensor* param_copy))    \
  X(sgd_step,                                                                                                          \
    (Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const ops::SgdParams& params, Tensor* param_copy))   \
  X(cast, (const Tensor& x, Tensor& y))                                                                                \
  X(scale_, (Tensor& x, float alpha))                                                                                 \
  X(axpy, (float alpha, const Tensor& x, Tensor& y))                                                                   \
  X(add, (const Tensor& a, const Tensor& b, Tensor& out))
// clang-format on

#define TESSERA_BACKEND_DECLARE_PURE(name, parameters) virtual void name parameters = 0;
#define TESSERA_BACKEND_DECLARE_OVERRIDE(name, parameters) void name parameters override;
// Inside a backend's class body (public): its override of every operator.
#define TESSERA_BACKEND_OVERRIDES TESSERA_BACKEND_OPERATORS(TESSERA_BACKEND_DECLARE_OVERRIDE)

class Backend {
 public:
  virtual ~Backend() = default;

  TESSERA_BACKEND_OPERATORS(TESSERA_BACKEND_DECLARE_PURE)
};

Backend& cpu_backend();
Backend& cuda_backend();  // throws when the CUDA backend was not built
// The backend that runs work on `device`: CUDA's for CUDA devices, the CPU's
// for the CPU and for the emulated accelerator (whose memory is host memory).
Backend& backend_for(Device device);
// The same for `on`'s device, noting `op` there as the last operation
// dispatched (named in reports of asynchronous device faults).
Backend& backend_for(const Tensor& on, const char* op);

}  // namespace tessera
