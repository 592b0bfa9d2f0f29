// The layers of nn/layers.h: each forward allocates its outputs from the
// context, calls kernels/ops.h and records in `saved` what its backward needs;
// each backward adds into the f32 parameter gradients and returns the input
// gradient in the compute dtype.
#include "nn/layers.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "core/context.h"
#include "nn/kv_cache.h"

namespace tessera::nn {
namespace {

Tensor empty_like(const Tensor& t) {
  return t.context().empty(t.shape(), t.dtype(), t.device());
}

// `shape` with one more dimension at the end.
Shape appended(const Shape& shape, int64_t last) {
  std::vector<int64_t> sizes(shape.sizes().begin(), shape.sizes().end());
  sizes.push_back(last);
  return Shape(std::span<const int64_t>(sizes));
}

// A floating activation in the model's dtype, on its device.
void check_activation(const Module& m, const Tensor& x, std::string_view what = "input") {
  TESSERA_CHECK(x.defined(), m.name(), ": the ", what, " is an undefined tensor");
  TESSERA_CHECK(x.dtype() == m.spec().dtype, m.name(), ": the ", what, " is ", dtype_name(x.dtype()),
                " but the model computes in ", dtype_name(m.spec().dtype), "; cast it first (nn::InputCast)");
  TESSERA_CHECK(x.device() == m.spec().device, m.name(), ": the ", what, " is on ", x.device().to_string(),
                " but the model lives on ", m.spec().device.to_string());
}

void check_last_dim(const Module& m, const Tensor& x, int64_t dim) {
  TESSERA_CHECK(x.ndim() >= 1 && x.shape()[-1] == dim, m.name(), ": the input has shape ", x.shape().to_string(),
                ", expected [..., ", dim, "]");
}

void check_grad(const Module& m, const Tensor& grad, const Shape& expected) {
  TESSERA_CHECK(grad.defined(), m.name(), ": backward got an undefined output gradient");
  TESSERA_CHECK(grad.numel() == expected.numel() && grad.shape()[-1] == expected[-1], m.name(),
                ": the output gradient has shape ", grad.shape().to_string(), ", the forward produced ",
                expected.to_string());
}

// Adds a gradient computed in the compute dtype into the f32 main gradient.
void add_into_grad(Parameter& p, const Tensor& grad) {
  ops::axpy(1.0f, grad, p.grad);
}

bool accumulates_directly(const Parameter& p) {
  return p.value.dtype() == DType::f32;
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t dropout_seed(const Pass& pass, const std::string& name) {
  uint64_t h = splitmix64(pass.seed);
  h = splitmix64(h ^ name_stream(name));
  h = splitmix64(h ^ pass.step);
  return splitmix64(h ^ pass.micro_batch);
}

ops::AttentionDropout attention_dropout(const Module& self, float p, int64_t head_offset, const Pass& pass) {
  if (!self.training() || pass.kv_cache || p == 0.0f) return {};
  return ops::AttentionDropout{p, dropout_seed(pass, self.name() + ".attention_dropout"), 0, head_offset};
}

void save_attention_dropout(Saved& saved, const ops::AttentionDropout& dropout) {
  saved.scalars.clear();
  if (dropout.p == 0.0f) return;
  saved.scalars = {int64_t(std::bit_cast<uint32_t>(dropout.p)), int64_t(dropout.seed), int64_t(dropout.offset),
                   dropout.head_offset};
}

ops::AttentionDropout saved_attention_dropout(const Saved& saved) {
  if (saved.scalars.size() < 4) return {};
  return ops::AttentionDropout{std::bit_cast<float>(uint32_t(saved.scalars[0])), uint64_t(saved.scalars[1]),
                               uint64_t(saved.scalars[2]), saved.scalars[3]};
}

// ---------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------
Linear::Linear(const ModelSpec& spec, std::string name, int64_t in_features, int64_t out_features, bool bias,
               ops::Activation activation)
    : Module(spec, std::move(name)), in_(in_features), out_(out_features), activation_(activation) {
  TESSERA_CHECK(in_ >= 1 && out_ >= 1, this->name(),
                ": a linear layer needs at least one input and output feature, got ", in_, " -> ", out_);
  const float bound = 1.0f / std::sqrt(float(in_));
  weight_ = &add_parameter("weight", Shape{out_, in_}, true);
  init_uniform(*weight_, bound);
  if (bias) {
    bias_ = &add_parameter("bias", Shape{out_}, false);
    init_uniform(*bias_, bound);
  }
}

Tensor linear_rows_forward(const Tensor& x, const Parameter& weight, const Parameter* bias, ops::Activation activation,
                           Tensor& kept) {
  const Tensor& w = weight.value;
  Tensor y = w.context().empty(Shape{x.size(0), w.size(0)}, w.dtype(), w.device());
  ops::MatmulOptions options;
  options.transpose_b = true;
  options.bias = bias ? &bias->value : nullptr;
  options.activation = activation;
  Tensor pre;
  if (activation == ops::Activation::gelu) {
    pre = empty_like(y);
    options.pre_activation = &pre;
  }
  ops::matmul(x, w, y, options);
  kept = activation == ops::Activation::relu ? y : pre;
  return y;
}

Tensor linear_rows_backward(const Tensor& dy, const Tensor& x, const Tensor& kept, Parameter& weight, Parameter* bias,
                            ops::Activation activation, bool input_grad, Module& owner) {
  Tensor dz = dy;  // gradient before the activation
  if (activation != ops::Activation::none) {
    dz = empty_like(dy);
    if (activation == ops::Activation::relu)
      ops::relu_backward(kept, dy, dz);
    else
      ops::gelu_backward(kept, dy, dz);
  }
  owner.add_weight_gradients([dz, x, w = &weight, bias] {
    if (bias) ops::bias_add_backward(dz, bias->grad, /*accumulate=*/true);
    ops::matmul_backward(dz, x, w->value, nullptr, &w->grad, false, true, /*accumulate=*/true);
  });
  if (!input_grad) return Tensor();
  Tensor dx = empty_like(x);
  ops::matmul_backward(dz, x, weight.value, &dx, nullptr, false, true, /*accumulate=*/false);
  return dx;
}

Tensor Linear::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  check_last_dim(*this, input, in_);
  const Tensor x = input.reshape({-1, in_});
  Tensor kept;
  const Tensor y = linear_rows_forward(x, *weight_, bias_, activation_, kept);
  saved.tensors = {x, kept};
  saved.scalars.clear();
  saved.push_shape(input.shape());
  return y.view(input.shape().with_dim(-1, out_));
}

Tensor Linear::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 2, 1);
  const Tensor x = saved.tensors[0], kept = saved.tensors[1];
  const Shape input_shape = saved.shape_at(0);
  saved.clear();
  check_grad(*this, grad_output, input_shape.with_dim(-1, out_));
  const Tensor dx =
      linear_rows_backward(grad_output.reshape({-1, out_}), x, kept, *weight_, bias_, activation_, input_grad_, *this);
  return dx.defined() ? dx.view(input_shape) : dx;
}

// ---------------------------------------------------------------------------
// Conv2d
// ---------------------------------------------------------------------------
Conv2d::Conv2d(const ModelSpec& spec, std::string name, int64_t in_channels, int64_t out_channels, int kernel_size,
               int stride, int padding, bool bias)
    : Module(spec, std::move(name)) {
  TESSERA_CHECK(in_channels >= 1 && out_channels >= 1 && kernel_size >= 1, this->name(),
                ": channels and kernel size must be at least 1, got ", in_channels, " -> ", out_channels, ", kernel ",
                kernel_size);
  params_.stride_h = params_.stride_w = stride;
  params_.pad_h = params_.pad_w = padding;
  const float bound = 1.0f / std::sqrt(float(in_channels * kernel_size * kernel_size));
  weight_ = &add_parameter("weight", Shape{out_channels, in_channels, kernel_size, kernel_size}, true);
  init_uniform(*weight_, bound);
  if (bias) {
    bias_ = &add_parameter("bias", Shape{out_channels}, false);
    init_uniform(*bias_, bound);
  }
}

Tensor Conv2d::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  Tensor y = context().empty(ops::conv2d_output_shape(input.shape(), weight_->value.shape(), params_), spec().dtype,
                             spec().device);
  ops::conv2d_forward(input, weight_->value, bias_ ? bias_->value : Tensor(), y, params_);
  saved.tensors = {input};
  return y;
}

Tensor Conv2d::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 1);
  const Tensor x = saved.tensors[0];
  saved.clear();
  if (accumulates_directly(*weight_)) {
    ops::conv2d_backward(grad_output, x, weight_->value, nullptr, &weight_->grad, bias_ ? &bias_->grad : nullptr,
                         params_, /*accumulate=*/true);
  } else {
    Tensor grad_weight = empty_like(weight_->value), grad_bias = bias_ ? empty_like(bias_->value) : Tensor();
    ops::conv2d_backward(grad_output, x, weight_->value, nullptr, &grad_weight, bias_ ? &grad_bias : nullptr, params_,
                         /*accumulate=*/false);
    add_into_grad(*weight_, grad_weight);
    if (bias_) add_into_grad(*bias_, grad_bias);
  }
  if (!input_grad_) return Tensor();
  Tensor dx = empty_like(x);
  ops::conv2d_backward(grad_output, x, weight_->value, &dx, nullptr, nullptr, params_, /*accumulate=*/false);
  return dx;
}

// ---------------------------------------------------------------------------
// MaxPool2d, ReLU, GELU
// ---------------------------------------------------------------------------
MaxPool2d::MaxPool2d(const ModelSpec& spec, std::string name, int kernel_size, int stride, int padding)
    : Module(spec, std::move(name)) {
  params_.kernel_h = params_.kernel_w = kernel_size;
  params_.stride_h = params_.stride_w = stride > 0 ? stride : kernel_size;
  params_.pad_h = params_.pad_w = padding;
}

Tensor MaxPool2d::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  const Shape out = ops::maxpool2d_output_shape(input.shape(), params_);
  Tensor y = context().empty(out, input.dtype(), input.device());
  Tensor indices = context().empty(out, DType::i32, input.device());
  ops::maxpool2d_forward(input, y, indices, params_);
  saved.tensors = {indices};
  saved.scalars.clear();
  saved.push_shape(input.shape());
  return y;
}

Tensor MaxPool2d::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 1, 1);
  const Tensor indices = saved.tensors[0];
  const Shape input_shape = saved.shape_at(0);
  saved.clear();
  Tensor dx = context().empty(input_shape, grad_output.dtype(), grad_output.device());
  ops::maxpool2d_backward(grad_output, indices, dx, params_);
  return dx;
}

Tensor ReLU::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  Tensor y = empty_like(input);
  ops::relu_forward(input, y);
  saved.tensors = {y};  // relu(x) > 0 exactly where x > 0
  return y;
}

Tensor ReLU::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 1);
  const Tensor y = saved.tensors[0];
  saved.clear();
  Tensor dx = empty_like(y);
  ops::relu_backward(y, grad_output.view(y.shape()), dx);
  return dx;
}

Tensor GELU::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  Tensor y = empty_like(input);
  ops::gelu_forward(input, y);
  saved.tensors = {input};
  return y;
}

Tensor GELU::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 1);
  const Tensor x = saved.tensors[0];
  saved.clear();
  Tensor dx = empty_like(x);
  ops::gelu_backward(x, grad_output.view(x.shape()), dx);
  return dx;
}

// ---------------------------------------------------------------------------
// LayerNorm, RMSNorm
// ---------------------------------------------------------------------------
LayerNorm::LayerNorm(const ModelSpec& spec, std::string name, int64_t dim, float eps, bool bias)
    : Module(spec, std::move(name)), dim_(dim), eps_(eps) {
  TESSERA_CHECK(dim_ >= 1, this->name(), ": the normalised dimension must be at least 1, got ", dim_);
  weight_ = &add_parameter("weight", Shape{dim_}, false);
  init_constant(*weight_, 1.0f);
  if (bias) {
    bias_ = &add_parameter("bias", Shape{dim_}, false);
    init_constant(*bias_, 0.0f);
  }
}

Tensor LayerNorm::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  check_last_dim(*this, input, dim_);
  const int64_t rows = input.numel() / dim_;
  Tensor y = empty_like(input);
  Tensor mean = context().empty(Shape{rows}, DType::f32, input.device());
  Tensor rstd = context().empty(Shape{rows}, DType::f32, input.device());
  ops::layernorm_forward(input, weight_->value, bias_ ? bias_->value : Tensor(), y, mean, rstd, eps_);
  saved.tensors = {input, mean, rstd};
  return y;
}

Tensor LayerNorm::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 3);
  const Tensor x = saved.tensors[0], mean = saved.tensors[1], rstd = saved.tensors[2];
  saved.clear();
  check_grad(*this, grad_output, x.shape());
  const Tensor dy = grad_output.view(x.shape());
  Tensor dx = empty_like(x);
  // One pass gives dx and the weight's gradient: the W step adds the latter.
  Tensor grad_weight = empty_like(weight_->value), grad_bias = bias_ ? empty_like(bias_->value) : Tensor();
  ops::layernorm_backward(dy, x, weight_->value, mean, rstd, dx, grad_weight, bias_ ? &grad_bias : nullptr,
                          /*accumulate=*/false);
  add_weight_gradients([this, grad_weight, grad_bias] {
    add_into_grad(*weight_, grad_weight);
    if (bias_) add_into_grad(*bias_, grad_bias);
  });
  return dx;
}

RMSNorm::RMSNorm(const ModelSpec& spec, std::string name, int64_t dim, float eps)
    : Module(spec, std::move(name)), dim_(dim), eps_(eps) {
  TESSERA_CHECK(dim_ >= 1, this->name(), ": the normalised dimension must be at least 1, got ", dim_);
  weight_ = &add_parameter("weight", Shape{dim_}, false);
  init_constant(*weight_, 1.0f);
}

Tensor RMSNorm::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  check_activation(*this, input);
  check_last_dim(*this, input, dim_);
  Tensor y = empty_like(input);
  Tensor rstd = context().empty(Shape{input.numel() / dim_}, DType::f32, input.device());
  ops::rmsnorm_forward(input, weight_->value, y, rstd, eps_);
  saved.tensors = {input, rstd};
  return y;
}

Tensor RMSNorm::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 2);
  const Tensor x = saved.tensors[0], rstd = saved.tensors[1];
  saved.clear();
  check_grad(*this, grad_output, x.shape());
  const Tensor dy = grad_output.view(x.shape());
  Tensor dx = empty_like(x);
  Tensor grad_weight = empty_like(weight_->value);
  ops::rmsnorm_backward(dy, x, weight_->value, rstd, dx, grad_weight, /*accumulate=*/false);
  add_weight_gradients([this, grad_weight] { add_into_grad(*weight_, grad_weight); });
  return dx;
}

// ---------------------------------------------------------------------------
// Dropout, Embedding, Flatten, InputCast
// ---------------------------------------------------------------------------
Dropout::Dropout(const ModelSpec& spec, std::string name, float p) : Module(spec, std::move(name)), p_(p) {
  TESSERA_CHECK(p_ >= 0.0f && p_ < 1.0f, this->name(), ": the dropout probability must be in [0, 1), got ", p_,
                "; check --dropout");
}

Tensor Dropout::forward_impl(const Tensor& input, Saved& saved, const Pass& pass) {
  saved.clear();
  if (!training() || p_ == 0.0f) return input;  // no state saved: backward is the identity too
  check_activation(*this, input);
  const uint64_t seed = dropout_seed(pass, name());
  Tensor y = empty_like(input);
  ops::dropout_forward(input, y, p_, seed, 0);
  saved.scalars = {int64_t(seed)};
  return y;
}

Tensor Dropout::backward_impl(const Tensor& grad_output, Saved& saved) {
  if (saved.scalars.empty()) return grad_output;
  const uint64_t seed = uint64_t(saved.scalars[0]);
  saved.clear();
  Tensor dx = empty_like(grad_output);
  ops::dropout_backward(grad_output, dx, p_, seed, 0);
  return dx;
}

Embedding::Embedding(const ModelSpec& spec, std::string name, int64_t vocab_size, int64_t dim)
    : Module(spec, std::move(name)), vocab_(vocab_size), dim_(dim) {
  TESSERA_CHECK(vocab_ >= 1 && dim_ >= 1, this->name(), ": vocabulary size and dimension must be at least 1, got ",
                vocab_, " x ", dim_);
  weight_ = &add_parameter("weight", Shape{vocab_, dim_}, true);
  init_normal(*weight_, 1.0f);
}

Tensor Embedding::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  TESSERA_CHECK(input.dtype() == DType::i32 || input.dtype() == DType::i64, name(), ": ids must be i32 or i64, got ",
                dtype_name(input.dtype()));
  TESSERA_CHECK(input.device() == spec().device, name(), ": ids are on ", input.device().to_string(),
                " but the model lives on ", spec().device.to_string());
  Tensor out = context().empty(appended(input.shape(), dim_), spec().dtype, spec().device);
  ops::embedding_forward(input, weight_->value, out);
  saved.tensors = {input};
  return out;
}

Tensor Embedding::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 1);
  const Tensor ids = saved.tensors[0];
  saved.clear();
  check_grad(*this, grad_output, appended(ids.shape(), dim_));
  add_weight_gradients([this, ids, dy = grad_output.reshape({-1, dim_})]() mutable {
    if (dy.dtype() != DType::f32) {  // the table gradient is f32: widen the rows, then scatter-add them
      Tensor wide = context().empty(dy.shape(), DType::f32, dy.device());
      ops::cast(dy, wide);
      dy = wide;
    }
    ops::embedding_backward(ids, dy, weight_->grad);
  });
  return Tensor();
}

PositionEmbedding::PositionEmbedding(const ModelSpec& spec, std::string name, int64_t max_tokens, int64_t dim)
    : Module(spec, std::move(name)), max_tokens_(max_tokens), dim_(dim) {
  TESSERA_CHECK(max_tokens_ >= 1 && dim_ >= 1, this->name(), ": positions and dimension must be at least 1, got ",
                max_tokens_, " x ", dim_);
  weight_ = &add_parameter("weight", Shape{max_tokens_, dim_}, true);
  init_normal(*weight_, 1.0f);
}

// Adding weight[:T] to every sequence is a bias add over rows of T·C values.
Tensor PositionEmbedding::forward_impl(const Tensor& input, Saved& saved, const Pass& pass) {
  check_activation(*this, input);
  TESSERA_CHECK(input.ndim() == 3 && input.size(2) == dim_, name(), ": the input has shape ", input.shape().to_string(),
                ", expected [B, T, ", dim_, "]");
  if (!positions_.empty() && !pass.kv_cache) return forward_at_positions(input, saved);
  const int64_t tokens = input.size(1);
  const int64_t first = pass.kv_cache ? pass.kv_cache->position() : int64_t(shard_) * tokens;
  TESSERA_CHECK(first + tokens <= max_tokens_, name(), ": a sequence of ", first + tokens * shards_,
                " tokens is longer than the ", max_tokens_, " positions the model was built for; check --seq-length");
  const Shape rows{input.size(0), tokens * dim_};
  Tensor y = empty_like(input);
  Tensor y_rows = y.view(rows);
  ops::bias_add(input.view(rows), weight_->value.slice(first, first + tokens).view(Shape{tokens * dim_}), y_rows);
  saved.clear();
  saved.scalars = {tokens, first};
  return y;
}

// Rows weight[positions] [T, C] gathered (an embedding lookup of the
// positions), added to every sequence.
Tensor PositionEmbedding::forward_at_positions(const Tensor& input, Saved& saved) {
  const int64_t tokens = input.size(1);
  TESSERA_CHECK(tokens == int64_t(positions_.size()), name(), ": the input holds ", tokens, " tokens of each sequence, ",
                "but the layer was given ", positions_.size(), " positions");
  const Tensor where = context().from_vector(Shape{tokens}, positions_, spec().device);
  Tensor rows = context().empty(Shape{tokens, dim_}, spec().dtype, spec().device);
  ops::embedding_forward(where, weight_->value, rows);
  Tensor y = empty_like(input);
  Tensor y_rows = y.view(Shape{input.size(0), tokens * dim_});
  ops::bias_add(input.view(Shape{input.size(0), tokens * dim_}), rows.view(Shape{tokens * dim_}), y_rows);
  saved.clear();
  saved.tensors = {where};
  return y;
}

Tensor PositionEmbedding::backward_at_positions(const Tensor& grad_output, Saved& saved) {
  const Tensor where = saved.tensors[0];
  saved.clear();
  const int64_t tokens = where.size(0);
  add_weight_gradients([this, where, tokens, grad_output] {
    Tensor summed = context().empty(Shape{tokens * dim_}, DType::f32, spec().device);
    ops::bias_add_backward(grad_output.view(Shape{grad_output.size(0), tokens * dim_}), summed);
    ops::embedding_backward(where, summed.view(Shape{tokens, dim_}), weight_->grad);
  });
  return grad_output;
}

Tensor PositionEmbedding::backward_impl(const Tensor& grad_output, Saved& saved) {
  if (saved.tensors.size() == 1) return backward_at_positions(grad_output, saved);
  check_saved(*this, saved, 0, 2);
  const int64_t tokens = saved.scalars[0], first = saved.scalars[1];
  saved.clear();
  TESSERA_CHECK(grad_output.ndim() == 3 && grad_output.size(1) == tokens && grad_output.size(2) == dim_, name(),
                ": the output gradient has shape ", grad_output.shape().to_string(), ", expected [B, ", tokens, ", ",
                dim_, "]");
  add_weight_gradients([this, first, tokens, grad_output] {
    Tensor grad_rows = weight_->grad.slice(first, first + tokens).view(Shape{tokens * dim_});
    ops::bias_add_backward(grad_output.view(Shape{grad_output.size(0), tokens * dim_}), grad_rows,
                           /*accumulate=*/true);
  });
  return grad_output;
}

Tensor Flatten::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  TESSERA_CHECK(input.ndim() >= 1, name(), ": cannot flatten a scalar");
  saved.clear();
  saved.push_shape(input.shape());
  return input.view(Shape{input.size(0), input.numel() / std::max<int64_t>(1, input.size(0))});
}

Tensor Flatten::backward_impl(const Tensor& grad_output, Saved& saved) {
  check_saved(*this, saved, 0, 1);
  const Shape shape = saved.shape_at(0);
  saved.clear();
  return grad_output.defined() ? grad_output.view(shape) : Tensor();
}

Tensor InputCast::forward_impl(const Tensor& input, Saved& saved, const Pass&) {
  saved.clear();
  if (input.dtype() == spec().dtype) return input;
  TESSERA_CHECK(is_floating(input.dtype()), name(), ": the input is ", dtype_name(input.dtype()),
                "; a model over data takes f32, bf16 or f16 values (convert the batch first)");
  Tensor y = context().empty(input.shape(), spec().dtype, input.device());
  ops::cast(input, y);
  saved.scalars = {int64_t(input.dtype())};
  return y;
}

Tensor InputCast::backward_impl(const Tensor& grad_output, Saved& saved) {
  if (saved.scalars.empty() || !grad_output.defined()) return grad_output;
  const DType input_dtype = DType(saved.scalars[0]);
  saved.clear();
  Tensor dx = context().empty(grad_output.shape(), input_dtype, grad_output.device());
  ops::cast(grad_output, dx);
  return dx;
}

// ---------------------------------------------------------------------------
// The attention between its projections, and the pre-LN block
// ---------------------------------------------------------------------------
namespace {

// Generation: the new tokens' keys and values join the cache, their queries
// attend to it; nothing is kept for a backward.
Tensor attention_with_cache(Module& self, const Tensor& qkv, Module& proj, Module& dropout, Saved& saved,
                            const Pass& pass) {
  const int64_t batch = qkv.size(0), tokens = qkv.size(1), heads = qkv.size(3), head_dim = qkv.size(4);
  KvCache& cache = *pass.kv_cache;
  TESSERA_CHECK(cache.batch() == batch, self.name(), ": the KV cache is for ", cache.batch(),
                " sequences, the input has ", batch);
  KvCache::Layer& layer = cache.layer(self, heads, head_dim);
  Tensor out = self.context().empty(Shape{batch, tokens, heads, head_dim}, self.spec().dtype, self.spec().device);
  ops::attention_with_cache(qkv, layer.keys, layer.values, cache.position(), out);
  Tensor y = proj.forward(out.view(Shape{batch, tokens, heads * head_dim}), saved.child(1), pass);
  return dropout.forward(y, saved.child(2), pass);
}

}  // namespace

Tensor attention_from_qkv(Module& self, const Tensor& packed, int64_t heads, int64_t head_dim, Module& proj,
                          Module& dropout, Saved& saved, const Pass& pass,
                          const ops::AttentionDropout& attention_dropout) {
  const int64_t batch = packed.size(0), tokens = packed.size(1);
  const Tensor qkv = packed.view(Shape{batch, tokens, 3, heads, head_dim});
  if (pass.kv_cache) return attention_with_cache(self, qkv, proj, dropout, saved, pass);
  Context& ctx = self.context();
  Tensor out = ctx.empty(Shape{batch, tokens, heads, head_dim}, self.spec().dtype, self.spec().device);
  Tensor logsumexp = ctx.empty(Shape{batch, heads, tokens}, DType::f32, self.spec().device);
  ops::attention_forward(qkv, out, logsumexp, 0.0f, attention_dropout);
  Tensor y = proj.forward(out.view(Shape{batch, tokens, heads * head_dim}), saved.child(1), pass);
  y = dropout.forward(y, saved.child(2), pass);
  saved.tensors = {qkv, out, logsumexp};
  save_attention_dropout(saved, attention_dropout);
  return y;
}

Tensor attention_from_qkv_backward(const Module& self, Module& proj, Module& dropout, const Tensor& grad_output,
                                   Saved& saved) {
  check_saved(self, saved, 3);
  Tensor grad = dropout.backward(grad_output, saved.child(2));
  grad = proj.backward(grad, saved.child(1));
  const Tensor qkv = saved.tensors[0], out = saved.tensors[1], logsumexp = saved.tensors[2];
  const ops::AttentionDropout attention_dropout = saved_attention_dropout(saved);
  saved.tensors.clear();
  saved.scalars.clear();
  Tensor grad_qkv = empty_like(qkv);
  ops::attention_backward(grad.view(out.shape()), qkv, out, logsumexp, grad_qkv, 0.0f, attention_dropout);
  return grad_qkv.view(Shape{qkv.size(0), qkv.size(1), 3 * qkv.size(3) * qkv.size(4)});
}

Tensor PreLnBlock::forward_all(const Tensor& input, Saved& saved, const Pass& pass) {
  Module& ln1 = *parts_[0];
  Module& attn = *parts_[1];
  Module& ln2 = *parts_[2];
  Module& mlp = *parts_[3];
  Tensor a = ln1.forward(input, saved.child(0), pass);
  a = attn.forward(a, saved.child(1), pass);
  Tensor h = empty_like(input);
  ops::add(input, a, h);
  a = Tensor();
  Tensor m = ln2.forward(h, saved.child(2), pass);
  m = mlp.forward(m, saved.child(3), pass);
  Tensor y = empty_like(h);
  ops::add(h, m, y);
  return y;
}

Tensor PreLnBlock::backward_all(const Tensor& grad_output, Saved& saved) {
  add_weight_gradients([this] { before_backward(); });
  const Tensor& dy = grad_output;
  Tensor grad = parts_[3]->backward(dy, saved.child(3));
  grad = parts_[2]->backward(grad, saved.child(2));
  Tensor dh = empty_like(grad);
  ops::add(dy, grad, dh);
  grad = parts_[1]->backward(dh, saved.child(1));
  grad = parts_[0]->backward(grad, saved.child(0));
  Tensor dx = empty_like(grad);
  ops::add(dh, grad, dx);
  saved.clear();
  add_weight_gradients([this] { after_backward(); });
  return dx;
}

Tensor PreLnBlock::forward_impl(const Tensor& input, Saved& saved, const Pass& pass) {
  saved.clear();
  if (!recompute_) return forward_all(input, saved, pass);
  Tensor y;
  {
    Saved discarded;  // freed here: only the input and the pass are kept
    y = forward_all(input, discarded, pass);
  }
  saved.tensors = {input};
  saved.scalars = {int64_t(pass.seed), int64_t(pass.step), int64_t(pass.micro_batch),
                   int64_t(std::bit_cast<uint32_t>(pass.loss_gradient_scale))};
  return y;
}

Tensor PreLnBlock::backward_impl(const Tensor& grad_output, Saved& saved) {
  if (saved.scalars.empty()) return backward_all(grad_output, saved);  // recompute was off at forward time
  check_saved(*this, saved, 1, 4);
  const Tensor input = saved.tensors[0];
  const Pass pass{uint64_t(saved.scalars[0]), uint64_t(saved.scalars[1]), uint64_t(saved.scalars[2]), nullptr,
                  std::bit_cast<float>(uint32_t(saved.scalars[3]))};  // the pass of the forward, scale included
  saved.clear();
  Saved fresh;
  // The same calls on the same input: the same activations, dropout masks
  // and (tensor-parallel) collectives in the same order on every rank.
  forward_all(input, fresh, pass);
  return backward_all(grad_output, fresh);
}

// ---------------------------------------------------------------------------
// Sequential
// ---------------------------------------------------------------------------
Tensor Sequential::forward_impl(const Tensor& input, Saved& saved, const Pass& pass) {
  Tensor x = input;
  for (size_t i = 0; i < layers_.size(); ++i) x = layers_[i]->forward(x, saved.child(i), pass);
  return x;
}

Tensor Sequential::backward_impl(const Tensor& grad_output, Saved& saved) {
  Tensor grad = grad_output;
  for (size_t i = layers_.size(); i-- > 0;) {
    grad = layers_[i]->backward(grad, saved.child(i));
    if (!grad.defined()) break;
  }
  saved.clear();
  return grad;
}

}  // namespace tessera::nn
