// Layers: the Modules that MLPs, CNNs and GPTs are built from, each an
// explicit forward/backward over kernels/ops.h. Parameters are named
// "<module name>.weight" / ".bias".
//
// Conventions shared by every layer here:
//   - Activations (inputs, outputs, input gradients) are in the model's compute
//     dtype (ModelSpec::dtype: f32, bf16 or f16); per-row statistics are f32.
//   - Parameter gradients ACCUMULATE (+=) into the f32 Parameter::grad, so
//     micro-batches add up; the trainer zeroes them once per optimizer step.
//     Where an op can write f32 gradients itself (matmul_backward, bias_add_backward,
//     embedding_backward on an f32 gradient), it accumulates directly; otherwise
//     (conv, norms in bf16/f16) the gradient is computed in the compute dtype and
//     added with ops::axpy into the f32 gradient.
//   - A forward's outputs must not be modified in place before the matching
//     backward (a layer may keep its output, e.g. Linear with ReLU).
//   - backward releases what `saved` holds once it is used.
//   - Default initialisation is PyTorch's (documented per layer); model builders
//     re-initialise where a model prescribes otherwise (GPT-2).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "nn/module.h"

namespace tessera::nn {

// The dropout seed of one module in one pass: a 64-bit mix (splitmix64
// finaliser, chained) of (pass.seed, name_stream(name), pass.step,
// pass.micro_batch). The mask of element i is then
//   keep(i) = philox_uniform(seed, ops::kDropoutRngStream, i) >= p   (offset 0),
// a function of the pass and the module's name only: a recomputed forward and
// its backward draw the same mask, and different steps, micro-batches and
// modules draw independent ones.
uint64_t dropout_seed(const Pass& pass, const std::string& name);

// The dropout on the attention probabilities of attention layer `self` in
// this pass (ops::AttentionDropout): probability p in training mode, none in
// evaluation or with a KV cache (generation); the seed dropout_seed(pass,
// self.name() + ".attention_dropout"), the same on every tensor-parallel rank,
// whose mask is told apart by the global head: `head_offset` is the whole
// model's index of this rank's first query head. A recomputed forward draws
// the same mask.
ops::AttentionDropout attention_dropout(const Module& self, float p, int64_t head_offset, const Pass& pass);
// Keeps `dropout` as saved.scalars (none when p = 0) for the backward, which reads it back.
void save_attention_dropout(Saved& saved, const ops::AttentionDropout& dropout);
ops::AttentionDropout saved_attention_dropout(const Saved& saved);

// The arithmetic of Linear on rows, shared with the tensor-parallel layers
// (parallel/tensor_parallel.h): y [R, out] = act(x [R, in]·Wᵀ + b) in the
// weight's dtype (bias may be null); `kept` receives what the backward needs
// (the output for ReLU, the pre-activation for GELU, nothing otherwise).
Tensor linear_rows_forward(const Tensor& x, const Parameter& weight, const Parameter* bias, ops::Activation activation,
                           Tensor& kept);
// From dy [R, out]: adds into weight.grad (and bias->grad) through
// owner.add_weight_gradients (deferred to the W step in a backward in two
// halves) and returns dx [R, in], or an undefined Tensor when !input_grad.
Tensor linear_rows_backward(const Tensor& dy, const Tensor& x, const Tensor& kept, Parameter& weight, Parameter* bias,
                            ops::Activation activation, bool input_grad, Module& owner);

// y = act(x·Wᵀ + b) over the last dimension: x [..., in] → y [..., out].
// weight [out, in] (PyTorch's layout), bias [out]. The activation is fused into
// the matmul epilogue; backward needs the value before it: for GELU the
// pre-activation is saved, for ReLU the output itself (relu(z) > 0 exactly when
// z > 0, and the output is kept anyway as the next layer's input).
// Init (PyTorch): weight and bias uniform(±1/√in).
class Linear : public Module {
 public:
  Linear(const ModelSpec& spec, std::string name, int64_t in_features, int64_t out_features, bool bias = true,
         ops::Activation activation = ops::Activation::none);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  bool splits_backward() const override { return true; }

  // False: backward returns no input gradient (the first layer of a network
  // over data), saving one GEMM.
  void set_input_grad(bool needed) { input_grad_ = needed; }
  Parameter& weight() { return *weight_; }
  Parameter* bias() { return bias_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  int64_t in_, out_;
  ops::Activation activation_;
  bool input_grad_ = true;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

// 2-D convolution, NCHW: x [N, C, H, W] → y [N, K, P, Q]; weight [K, C, R, R],
// bias [K]. Init (PyTorch): uniform(±1/√(C·R·R)) for weight and bias.
class Conv2d : public Module {
 public:
  Conv2d(const ModelSpec& spec, std::string name, int64_t in_channels, int64_t out_channels, int kernel_size,
         int stride = 1, int padding = 0, bool bias = true);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  void set_input_grad(bool needed) { input_grad_ = needed; }
  Parameter& weight() { return *weight_; }
  Parameter* bias() { return bias_; }

 private:
  ops::Conv2dParams params_;
  bool input_grad_ = true;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

// Max pooling, NCHW (stride defaults to the kernel size).
class MaxPool2d : public Module {
 public:
  MaxPool2d(const ModelSpec& spec, std::string name, int kernel_size, int stride = 0, int padding = 0);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;

 private:
  ops::Pool2dParams params_;
};

class ReLU : public Module {
 public:
  ReLU(const ModelSpec& spec, std::string name) : Module(spec, std::move(name)) {}
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
};

// GELU, tanh approximation (ops::gelu_forward).
class GELU : public Module {
 public:
  GELU(const ModelSpec& spec, std::string name) : Module(spec, std::move(name)) {}
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
};

// LayerNorm over the last dimension: x [..., D]; weight [D] (init 1), bias [D] (init 0).
class LayerNorm : public Module {
 public:
  LayerNorm(const ModelSpec& spec, std::string name, int64_t dim, float eps = 1e-5f, bool bias = true);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  bool splits_backward() const override { return true; }
  Parameter& weight() { return *weight_; }
  Parameter* bias() { return bias_; }

 private:
  int64_t dim_;
  float eps_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

// RMSNorm over the last dimension: x [..., D]; weight [D] (init 1).
class RMSNorm : public Module {
 public:
  RMSNorm(const ModelSpec& spec, std::string name, int64_t dim, float eps = 1e-5f);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  bool splits_backward() const override { return true; }
  Parameter& weight() { return *weight_; }

 private:
  int64_t dim_;
  float eps_;
  Parameter* weight_;
};

// Dropout with probability p in [0, 1): in training, y = mask·x/(1 − p) with the
// mask of dropout_seed(pass, name()) at offset 0; the identity in eval mode or
// when p == 0 (the input tensor itself is returned).
class Dropout : public Module {
 public:
  Dropout(const ModelSpec& spec, std::string name, float p);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  float p() const { return p_; }

 private:
  float p_;
};

// Token embedding: ids [...] (i32/i64) → out [..., dim]; weight [vocab, dim].
// Init (PyTorch): normal(0, 1). Returns no input gradient.
class Embedding : public Module {
 public:
  Embedding(const ModelSpec& spec, std::string name, int64_t vocab_size, int64_t dim);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  bool splits_backward() const override { return true; }
  Parameter& weight() { return *weight_; }

 private:
  int64_t vocab_, dim_;
  Parameter* weight_;
};

// Learned positions: x [B, T, C] → x + weight[t] for t < T; weight [max_tokens, C].
// Init (PyTorch's Embedding): normal(0, 1). The input gradient passes through.
class PositionEmbedding : public Module {
 public:
  PositionEmbedding(const ModelSpec& spec, std::string name, int64_t max_tokens, int64_t dim);
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  bool splits_backward() const override { return true; }
  Parameter& weight() { return *weight_; }
  // Sequence parallelism: the input holds positions [r·T', (r+1)·T') of each
  // sequence (T' its length), r = `shard` of `shards`.
  void set_sequence_shard(int shard, int shards) {
    shard_ = shard;
    shards_ = shards;
  }
  // Context parallelism: the input's tokens are at these positions of each
  // sequence (any order, e.g. a zigzag share), which the rows of the table
  // added to them follow (overrides the sequence shard).
  void set_positions(std::vector<int64_t> positions) { positions_ = std::move(positions); }

 private:
  Tensor forward_at_positions(const Tensor& input, Saved& saved);
  Tensor backward_at_positions(const Tensor& grad_output, Saved& saved);
  int64_t max_tokens_, dim_;
  int shard_ = 0, shards_ = 1;
  std::vector<int64_t> positions_;
  Parameter* weight_;
};

// [N, ...] → [N, rest] (a view).
class Flatten : public Module {
 public:
  Flatten(const ModelSpec& spec, std::string name) : Module(spec, std::move(name)) {}
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
};

// Converts a floating input (e.g. f32 images) to the model's compute dtype;
// the identity when it already has it. Backward casts the gradient back.
class InputCast : public Module {
 public:
  InputCast(const ModelSpec& spec, std::string name) : Module(spec, std::move(name)) {}
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
};

// The causal self-attention between its input projection and its output, of
// the tensor-parallel attention (parallel/tensor_parallel.h; with a group of
// one it is the whole layer): `packed` [B, T, 3·H·Dh] (what the QKV
// projection returned: q, k, v of H heads of Dh) → the fused attention (with
// `attention_dropout` on its probabilities, see attention_dropout above) →
// `proj` (child 1 of `saved`) → `dropout` (child 2). Keeps what backward
// needs in saved.tensors and saved.scalars.
Tensor attention_from_qkv(Module& self, const Tensor& packed, int64_t heads, int64_t head_dim, Module& proj,
                          Module& dropout, Saved& saved, const Pass& pass,
                          const ops::AttentionDropout& attention_dropout = {});
// Its backward: the gradient of `packed` (for the QKV projection's backward).
Tensor attention_from_qkv_backward(const Module& self, Module& proj, Module& dropout, const Tensor& grad_output,
                                   Saved& saved);

// The pre-LN residual arithmetic on x [B, T, C], for any four parts:
//   h = x + attn(ln1(x)),  y = h + mlp(ln2(h)).
// With `recompute`, forward keeps only its input (and the pass); backward
// re-runs the same forward into a fresh Saved, then the ordinary backward, so
// its gradients are bit-identical to recompute off, at the cost of one more
// forward. Subclasses make the parts (the tensor-parallel blocks of
// parallel/, whole with a group of one) as children 0..3 and hand them to set_parts().
class PreLnBlock : public Module {
 public:
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  void set_recompute(bool recompute) { recompute_ = recompute; }
  bool recompute() const { return recompute_; }
  bool shards_as_one_unit() const override { return true; }  // ZeRO-3 gathers a block at once

 protected:
  PreLnBlock(const ModelSpec& spec, std::string name, bool recompute)
      : Module(spec, std::move(name)), recompute_(recompute) {}
  void set_parts(Module& ln1, Module& attn, Module& ln2, Module& mlp) { parts_ = {&ln1, &attn, &ln2, &mlp}; }
  // Around every backward through the parts (sequence parallelism sums some gradients there).
  virtual void before_backward() {}
  virtual void after_backward() {}

 private:
  Tensor forward_all(const Tensor& input, Saved& saved, const Pass& pass);  // keeps everything
  Tensor backward_all(const Tensor& grad_output, Saved& saved);

  bool recompute_;
  std::array<Module*, 4> parts_{};  // ln1, attn, ln2, mlp
};

// Children run in the order added; saved.child(i) holds child i's state. A
// child whose backward returns no input gradient (an undefined Tensor) ends
// the backward pass: the children before it must have nothing to learn.
class Sequential : public Module {
 public:
  Sequential(const ModelSpec& spec, std::string name) : Module(spec, std::move(name)) {}
  template <typename M, typename... Args>
  M& add(Args&&... args) {
    M& child = add_child<M>(std::forward<Args>(args)...);
    layers_.push_back(&child);
    return child;
  }
  Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, Saved& saved) override;
  size_t size() const { return layers_.size(); }
  Module& operator[](size_t index) { return *layers_.at(index); }

 private:
  std::vector<Module*> layers_;
};

}  // namespace tessera::nn
