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
// Adding an operator adds one method here and its override in
// cpu/cpu_backend.h and cuda/cuda_backend.h (see CONTRIBUTING.md).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace tessera {

enum class ReduceKind { sum, mean, max, sum_squares };

class Backend {
 public:
  virtual ~Backend() = default;

  virtual void matmul(const Tensor& a, const Tensor& b, Tensor& c, const ops::MatmulOptions& options) = 0;
  virtual void matmul_backward(const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a, Tensor* grad_b,
                               bool transpose_a, bool transpose_b, bool accumulate) = 0;
  virtual void bias_add(const Tensor& x, const Tensor& bias, Tensor& y) = 0;
  virtual void bias_add_backward(const Tensor& grad_y, Tensor& grad_bias, bool accumulate) = 0;
  virtual void relu_forward(const Tensor& x, Tensor& y) = 0;
  virtual void relu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) = 0;
  virtual void gelu_forward(const Tensor& x, Tensor& y) = 0;
  virtual void gelu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) = 0;
  virtual void softmax_forward(const Tensor& x, Tensor& y) = 0;
  virtual void softmax_backward(const Tensor& y, const Tensor& grad_y, Tensor& grad_x) = 0;
  virtual void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp,
                                     int64_t ignore_index) = 0;
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& logsumexp, const Tensor& targets,
                                      const Tensor& grad_losses, Tensor& grad_logits, int64_t ignore_index,
                                      int64_t vocab_begin, int64_t vocab_size) = 0;
  virtual void cross_entropy_shard_max(const Tensor& logits, Tensor& row_max) = 0;
  virtual void cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                        int64_t vocab_begin, Tensor& sums, int64_t ignore_index) = 0;
  virtual void cross_entropy_shard_finish(const Tensor& row_max, const Tensor& sums, const Tensor& targets,
                                          int64_t vocab_size, Tensor& losses, Tensor& logsumexp,
                                          int64_t ignore_index) = 0;
  virtual void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean,
                                 Tensor& rstd, float eps) = 0;
  virtual void layernorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias,
                                  bool accumulate) = 0;
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) = 0;
  virtual void rmsnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                Tensor& grad_x, Tensor& grad_weight, bool accumulate) = 0;
  virtual void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset) = 0;
  virtual void dropout_backward(const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset) = 0;
  // vocab_begin, vocab_size: ops::embedding_forward's (vocab_size already resolved, never 0).
  virtual void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin,
                                 int64_t vocab_size) = 0;
  virtual void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin,
                                  int64_t vocab_size) = 0;
  virtual void attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale) = 0;
  virtual void attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                                  Tensor& grad_qkv, float scale) = 0;
  virtual void attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                    float scale) = 0;
  virtual void conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                              const ops::Conv2dParams& params) = 0;
  virtual void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x,
                               Tensor* grad_weight, Tensor* grad_bias, const ops::Conv2dParams& params,
                               bool accumulate) = 0;
  virtual void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& params) = 0;
  virtual void maxpool2d_backward(const Tensor& grad_y, const Tensor& indices, Tensor& grad_x,
                                  const ops::Pool2dParams& params) = 0;
  virtual void reduce(ReduceKind kind, const Tensor& x, Tensor& out) = 0;
  virtual void reduce_backward(ReduceKind kind, const Tensor& x, const Tensor& grad_out, Tensor& grad_x) = 0;
  virtual void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const ops::AdamWParams& params,
                          Tensor* param_copy) = 0;
  virtual void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const ops::SgdParams& params,
                        Tensor* param_copy) = 0;
  virtual void cast(const Tensor& x, Tensor& y) = 0;
  virtual void scale_(Tensor& x, float alpha) = 0;
  virtual void axpy(float alpha, const Tensor& x, Tensor& y) = 0;
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;
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
