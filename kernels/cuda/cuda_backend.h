// CudaBackend: the operators on CUDA devices. Method definitions are spread
// over kernels/cuda/*.cu and *.cpp, one file per operator family; thin
// launchers of the functors in kernels/functors/ (the same math as the CPU),
// plus cuBLASLt for matrix products and cuDNN for convolutions.
#pragma once

#include "kernels/backend.h"

namespace tessera {

class CudaBackend final : public Backend {
 public:
  void matmul(const Tensor& a, const Tensor& b, Tensor& c, const ops::MatmulOptions& options) override;
  void matmul_backward(const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a, Tensor* grad_b,
                       bool transpose_a, bool transpose_b, bool accumulate) override;
  void bias_add(const Tensor& x, const Tensor& bias, Tensor& y) override;
  void bias_add_backward(const Tensor& grad_y, Tensor& grad_bias, bool accumulate) override;
  void relu_forward(const Tensor& x, Tensor& y) override;
  void relu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) override;
  void gelu_forward(const Tensor& x, Tensor& y) override;
  void gelu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) override;
  void softmax_forward(const Tensor& x, Tensor& y) override;
  void softmax_backward(const Tensor& y, const Tensor& grad_y, Tensor& grad_x) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp,
                             int64_t ignore_index) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& logsumexp, const Tensor& targets,
                              const Tensor& grad_losses, Tensor& grad_logits, int64_t ignore_index, int64_t vocab_begin,
                              int64_t vocab_size) override;
  void cross_entropy_shard_max(const Tensor& logits, Tensor& row_max) override;
  void cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets, const Tensor& row_max, int64_t vocab_begin,
                                Tensor& sums, int64_t ignore_index) override;
  void cross_entropy_shard_finish(const Tensor& row_max, const Tensor& sums, const Tensor& targets, int64_t vocab_size,
                                  Tensor& losses, Tensor& logsumexp, int64_t ignore_index) override;
  void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean,
                         Tensor& rstd, float eps) override;
  void layernorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias,
                          bool accumulate) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) override;
  void rmsnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& grad_x,
                        Tensor& grad_weight, bool accumulate) override;
  void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset) override;
  void dropout_backward(const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset) override;
  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin,
                         int64_t vocab_size) override;
  void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin,
                          int64_t vocab_size) override;
  void attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale) override;
  void attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                          Tensor& grad_qkv, float scale) override;
  void attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                            float scale) override;
  void conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                      const ops::Conv2dParams& params) override;
  void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x, Tensor* grad_weight,
                       Tensor* grad_bias, const ops::Conv2dParams& params, bool accumulate) override;
  void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& params) override;
  void maxpool2d_backward(const Tensor& grad_y, const Tensor& indices, Tensor& grad_x,
                          const ops::Pool2dParams& params) override;
  void reduce(ReduceKind kind, const Tensor& x, Tensor& out) override;
  void reduce_backward(ReduceKind kind, const Tensor& x, const Tensor& grad_out, Tensor& grad_x) override;
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const ops::AdamWParams& params,
                  Tensor* param_copy) override;
  void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const ops::SgdParams& params,
                Tensor* param_copy) override;
  void cast(const Tensor& x, Tensor& y) override;
  void scale_(Tensor& x, float alpha) override;
  void axpy(float alpha, const Tensor& x, Tensor& y) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
};

}  // namespace tessera
