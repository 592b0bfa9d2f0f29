// The tensor-parallel layers of parallel/tensor_parallel.h: the region
// communication (all-reduce, sequence all-gather/reduce-scatter), the split
// linear layers and embedding, dropout by region, the sequence-parallel
// gradient sums, the parallel attention/MLP/block, which splits a model
// allows, and the vocabulary-parallel cross-entropy. The models built from
// them live on the floor above (models/).
#include "parallel/tensor_parallel.h"

#include "parallel/ring_attention.h"

#include <cmath>
#include <memory>
#include <numeric>
#include <sstream>

#include "core/context.h"
#include "kernels/ops.h"

namespace tessera::parallel {
namespace {

Tensor empty_like(const Tensor& t) {
  return t.context().empty(t.shape(), t.dtype(), t.device());
}

// dst viewed [b, a, x] ← src viewed [a, b, x] (a transpose of blocks of x elements).
void transpose_blocks(const Tensor& src, Tensor& dst, int64_t a, int64_t b) {
  const int64_t x = src.numel() / (a * b);
  const Tensor from = src.view(Shape{a * b, x});
  Tensor to = dst.view(Shape{a * b, x});
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < b; ++j) to.slice(j * a + i, j * a + i + 1).copy_(from.slice(i * b + j, i * b + j + 1));
}

void check_sequence(const Tensor& x, std::string_view what) {
  TESSERA_CHECK(x.ndim() == 3, what, ": sequence parallelism works on [batch, tokens, features], got shape ",
                x.shape().to_string());
}

// The part [rank·n/k, (rank+1)·n/k) of n things split k ways.
int64_t part(int64_t n, int k) {
  return n / k;
}

// The tensor-parallel layout of a parameter split along `dim` of `view`.
nn::ParameterShard shard_of(const Shape& global, const Shape& view, int dim, int64_t begin, int64_t length,
                            bool split) {
  nn::ParameterShard shard;
  shard.global_shape = global;
  shard.split = split;
  if (split) {
    shard.axes = {"tp"};
    shard.view = view;
    shard.dim = dim;
    shard.begin = begin;
    shard.length = length;
  }
  return shard;
}

}  // namespace

// ---------------------------------------------------------------------------
// Region communication
// ---------------------------------------------------------------------------
void tp_all_reduce(Communicator& group, Tensor& x) {
  if (group.size() == 1) return;
  group.all_reduce(x, ReduceOp::sum)->wait();
}

Tensor tp_gather_sequence(Communicator& group, const Tensor& x) {
  const int k = group.size();
  if (k == 1) return x;
  check_sequence(x, "sequence all-gather");
  const int64_t batch = x.size(0), tokens = x.size(1), features = x.size(2);
  Tensor gathered = x.context().empty(Shape{int64_t(k) * x.numel()}, x.dtype(), x.device());
  group.all_gather(x.flatten(), gathered)->wait();
  Tensor out = x.context().empty(Shape{batch, tokens * k, features}, x.dtype(), x.device());
  transpose_blocks(gathered, out, k, batch);  // [k, B, T/k·C] → [B, k, T/k·C]
  return out;
}

Tensor tp_reduce_scatter_sequence(Communicator& group, const Tensor& x) {
  const int k = group.size();
  if (k == 1) return x;
  check_sequence(x, "sequence reduce-scatter");
  const int64_t batch = x.size(0), tokens = x.size(1), features = x.size(2);
  TESSERA_CHECK(tokens % k == 0, "sequence parallelism: a sequence of ", tokens,
                " tokens cannot be split over --tensor-parallel ", k, "; use a --seq-length divisible by ", k);
  Tensor blocks = empty_like(x);
  transpose_blocks(x, blocks, batch, k);  // [B, k, T/k·C] → [k, B, T/k·C]
  Tensor out = x.context().empty(Shape{batch, tokens / k, features}, x.dtype(), x.device());
  Tensor flat = out.flatten();
  group.reduce_scatter(blocks.flatten(), flat, ReduceOp::sum)->wait();
  return out;
}

Tensor tp_gather_last_dim(Communicator& group, const Tensor& x) {
  const int k = group.size();
  if (k == 1) return x;
  const int64_t n = x.shape()[-1], rows = x.numel() / n;
  Tensor gathered = x.context().empty(Shape{int64_t(k) * x.numel()}, x.dtype(), x.device());
  group.all_gather(x.flatten(), gathered)->wait();
  Tensor out = x.context().empty(x.shape().with_dim(-1, n * k), x.dtype(), x.device());
  transpose_blocks(gathered, out, k, rows);  // [k, rows, n] → [rows, k, n]
  return out;
}

Tensor tp_split_last_dim(Communicator& group, const Tensor& x) {
  const int k = group.size();
  if (k == 1) return x;
  const int64_t n = x.shape()[-1], rows = x.numel() / n;
  TESSERA_CHECK(n % k == 0, "tensor parallelism: ", n, " features cannot be split over ", k, " ranks");
  const int64_t local = n / k;
  Tensor out = x.context().empty(x.shape().with_dim(-1, local), x.dtype(), x.device());
  const Tensor blocks = x.view(Shape{rows * k, local});
  Tensor to = out.view(Shape{rows, local});
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t from = r * k + group.rank();
    to.slice(r, r + 1).copy_(blocks.slice(from, from + 1));
  }
  return out;
}

void all_reduce_in(const TensorParallelism& tp, Tensor& x) {
  if (tp.size() > 1) tp_all_reduce(*tp.group, x);
}
Tensor gather_sequence_in(const TensorParallelism& tp, const Tensor& x) {
  return tp.size() > 1 ? tp_gather_sequence(*tp.group, x) : x;
}
Tensor reduce_scatter_sequence_in(const TensorParallelism& tp, const Tensor& x) {
  return tp.size() > 1 ? tp_reduce_scatter_sequence(*tp.group, x) : x;
}

// ---------------------------------------------------------------------------
// ColumnParallelLinear
// ---------------------------------------------------------------------------
ColumnParallelLinear::ColumnParallelLinear(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                           int64_t in_features, int64_t out_features, bool bias,
                                           ops::Activation activation, OutputSplit split, bool gather_output)
    : Module(spec, std::move(name)),
      tp_(tp),
      in_(in_features),
      out_(out_features),
      activation_(activation),
      gather_output_(gather_output) {
  const int k = tp_.size(), r = tp_.rank();
  TESSERA_CHECK(in_ >= 1 && out_ >= 1, this->name(),
                ": a linear layer needs at least one input and output feature, got ", in_, " -> ", out_);
  Shape weight_view, bias_view;
  int64_t begin = 0, length = 0;
  if (split.heads > 0) {
    TESSERA_CHECK(out_ % (split.groups * split.heads) == 0, this->name(), ": ", out_, " output features are not ",
                  split.groups, " groups of ", split.heads, " heads");
    TESSERA_CHECK(split.heads % k == 0, this->name(), ": ", split.heads,
                  " attention heads cannot be split over --tensor-parallel ", k, "; use a head count divisible by ", k);
    TESSERA_CHECK(!gather_output_, this->name(), ": gather_output needs a plain split, not a split by heads");
    const int64_t head_dim = out_ / (split.groups * split.heads);
    weight_view = Shape{split.groups, split.heads, head_dim * in_};
    bias_view = Shape{split.groups, split.heads, head_dim};
    length = split.heads / k;
    begin = r * length;
    local_out_ = split.groups * length * head_dim;
  } else {
    TESSERA_CHECK(out_ % k == 0, this->name(), ": ", out_, " output features cannot be split over --tensor-parallel ",
                  k);
    local_out_ = part(out_, k);
    length = local_out_;
    begin = r * length;
  }
  const float bound = 1.0f / std::sqrt(float(in_));
  weight_ = &add_parameter("weight", Shape{local_out_, in_}, true);
  weight_->shard = shard_of(Shape{out_, in_}, weight_view, split.heads > 0 ? 1 : 0, begin, length, k > 1);
  init_uniform(*weight_, bound);
  if (bias) {
    bias_ = &add_parameter("bias", Shape{local_out_}, false);
    bias_->shard = shard_of(Shape{out_}, bias_view, split.heads > 0 ? 1 : 0, begin, length, k > 1);
    init_uniform(*bias_, bound);
  }
}

Tensor ColumnParallelLinear::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass&) {
  Tensor whole = input;
  if (tp_.sequence_parallel) whole = gather_sequence_in(tp_, input);
  TESSERA_CHECK(whole.ndim() >= 1 && whole.shape()[-1] == in_, name(), ": the input has shape ",
                whole.shape().to_string(), ", expected [..., ", in_, "]");
  const Tensor x = whole.reshape({-1, in_});
  Tensor kept;
  Tensor y = nn::linear_rows_forward(x, *weight_, bias_, activation_, kept);
  saved.tensors = {x, kept};
  saved.scalars.clear();
  saved.push_shape(whole.shape());
  if (gather_output_ && tp_.size() > 1) y = tp_gather_last_dim(*tp_.group, y);
  return y.view(whole.shape().with_dim(-1, gather_output_ ? out_ : local_out_));
}

Tensor ColumnParallelLinear::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  nn::check_saved(*this, saved, 2, 1);
  const Tensor x = saved.tensors[0], kept = saved.tensors[1];
  const Shape input_shape = saved.shape_at(0);
  saved.clear();
  TESSERA_CHECK(grad_output.defined(), name(), ": backward got an undefined output gradient");
  Tensor dy = grad_output;
  if (gather_output_ && tp_.size() > 1) dy = tp_split_last_dim(*tp_.group, dy);
  Tensor dx =
      nn::linear_rows_backward(dy.reshape({-1, local_out_}), x, kept, *weight_, bias_, activation_, true, *this);
  dx = dx.view(input_shape);
  // The input was the same on every rank: its gradient is the sum of every rank's part.
  if (tp_.sequence_parallel) return reduce_scatter_sequence_in(tp_, dx);
  all_reduce_in(tp_, dx);
  return dx;
}

// ---------------------------------------------------------------------------
// RowParallelLinear
// ---------------------------------------------------------------------------
RowParallelLinear::RowParallelLinear(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                     int64_t in_features, int64_t out_features, bool bias)
    : Module(spec, std::move(name)), tp_(tp), in_(in_features), out_(out_features) {
  const int k = tp_.size();
  TESSERA_CHECK(in_ >= 1 && out_ >= 1, this->name(),
                ": a linear layer needs at least one input and output feature, got ", in_, " -> ", out_);
  TESSERA_CHECK(in_ % k == 0, this->name(), ": ", in_, " input features cannot be split over --tensor-parallel ", k);
  local_in_ = part(in_, k);
  const float bound = 1.0f / std::sqrt(float(in_));
  weight_ = &add_parameter("weight", Shape{out_, local_in_}, true);
  weight_->shard = shard_of(Shape{out_, in_}, Shape{}, 1, tp_.rank() * local_in_, local_in_, k > 1);
  init_uniform(*weight_, bound);
  if (bias) {
    bias_ = &add_parameter("bias", Shape{out_}, false);
    init_uniform(*bias_, bound);
  }
}

Tensor RowParallelLinear::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass&) {
  TESSERA_CHECK(input.ndim() >= 1 && input.shape()[-1] == local_in_, name(), ": the input has shape ",
                input.shape().to_string(), ", expected [..., ", local_in_, "] (this rank's ", local_in_, " of ", in_,
                " features)");
  const Tensor x = input.reshape({-1, local_in_});
  Tensor kept;  // bias and reduction come after the matmul
  Tensor y =
      nn::linear_rows_forward(x, *weight_, nullptr, ops::Activation::none, kept).view(input.shape().with_dim(-1, out_));
  if (tp_.sequence_parallel)
    y = reduce_scatter_sequence_in(tp_, y);
  else
    all_reduce_in(tp_, y);
  if (bias_) {
    Tensor rows = y.view(Shape{y.numel() / out_, out_});
    ops::bias_add(rows, bias_->value, rows);
  }
  saved.tensors = {x};
  saved.scalars.clear();
  saved.push_shape(input.shape());
  return y;
}

Tensor RowParallelLinear::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  nn::check_saved(*this, saved, 1, 1);
  const Tensor x = saved.tensors[0];
  const Shape input_shape = saved.shape_at(0);
  saved.clear();
  TESSERA_CHECK(
      grad_output.defined() && grad_output.shape()[-1] == out_, name(), ": backward got an output gradient of shape ",
      grad_output.defined() ? grad_output.shape().to_string() : "(undefined)", ", expected [..., ", out_, "]");
  if (bias_)
    add_weight_gradients(
        [this, dy = grad_output.reshape({-1, out_})] { ops::bias_add_backward(dy, bias_->grad, /*accumulate=*/true); });
  Tensor dy = grad_output;
  if (tp_.sequence_parallel) dy = gather_sequence_in(tp_, grad_output);
  return nn::linear_rows_backward(dy.reshape({-1, out_}), x, Tensor(), *weight_, nullptr, ops::Activation::none, true,
                                  *this)
      .view(input_shape);
}

// ---------------------------------------------------------------------------
// VocabParallelEmbedding
// ---------------------------------------------------------------------------
VocabParallelEmbedding::VocabParallelEmbedding(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                               int64_t vocab_size, int64_t dim)
    : Module(spec, std::move(name)), tp_(tp), vocab_(vocab_size), dim_(dim) {
  const int k = tp_.size();
  TESSERA_CHECK(vocab_ >= 1 && dim_ >= 1, this->name(), ": vocabulary size and dimension must be at least 1, got ",
                vocab_, " x ", dim_);
  TESSERA_CHECK(vocab_ % k == 0, this->name(), ": a vocabulary of ", vocab_, " cannot be split over --tensor-parallel ",
                k, "; use a --vocab-size divisible by ", k);
  local_vocab_ = part(vocab_, k);
  vocab_begin_ = tp_.rank() * local_vocab_;
  weight_ = &add_parameter("weight", Shape{local_vocab_, dim_}, true);
  weight_->shard = shard_of(Shape{vocab_, dim_}, Shape{}, 0, vocab_begin_, local_vocab_, k > 1);
  init_normal(*weight_, 1.0f);
}

Tensor VocabParallelEmbedding::forward_impl(const Tensor& ids, nn::Saved& saved, const nn::Pass&) {
  TESSERA_CHECK(ids.dtype() == DType::i32 || ids.dtype() == DType::i64, name(), ": ids must be i32 or i64, got ",
                dtype_name(ids.dtype()));
  std::vector<int64_t> sizes(ids.shape().sizes().begin(), ids.shape().sizes().end());
  sizes.push_back(dim_);
  Tensor out = context().empty(Shape(std::span<const int64_t>(sizes)), spec().dtype, spec().device);
  // Rows of ids held elsewhere are zeros here: the sum over the group is the lookup.
  ops::embedding_forward(ids, weight_->value, out, vocab_begin_, tp_.size() > 1 ? vocab_ : 0);
  saved.tensors = {ids};
  if (tp_.sequence_parallel) return reduce_scatter_sequence_in(tp_, out);
  all_reduce_in(tp_, out);
  return out;
}

Tensor VocabParallelEmbedding::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  nn::check_saved(*this, saved, 1, 0);
  const Tensor ids = saved.tensors[0];
  saved.clear();
  Tensor dy = grad_output;
  if (tp_.sequence_parallel) dy = gather_sequence_in(tp_, grad_output);
  add_weight_gradients([this, ids, dy = dy.reshape({-1, dim_})]() mutable {
    if (dy.dtype() != DType::f32) {
      Tensor wide = context().empty(dy.shape(), DType::f32, dy.device());
      ops::cast(dy, wide);
      dy = wide;
    }
    ops::embedding_backward(ids, dy, weight_->grad, vocab_begin_, tp_.size() > 1 ? vocab_ : 0);
  });
  return Tensor();
}

std::vector<int64_t> held_positions(const TensorParallelism& tp, int64_t tokens) {
  std::vector<int64_t> held(size_t(tokens), 0);
  if (tp.context_size() > 1)
    held = context_share(*tp.context, tokens);
  else
    std::iota(held.begin(), held.end(), int64_t{0});
  if (!tp.sequence_parallel || tp.size() == 1) return held;
  TESSERA_CHECK(tokens % tp.size() == 0, "--sequence-parallel: ", tokens, " tokens do not split over --tensor-parallel ",
                tp.size());
  const int64_t part = tokens / tp.size(), begin = tp.rank() * part;
  return std::vector<int64_t>(held.begin() + begin, held.begin() + begin + part);
}

// ---------------------------------------------------------------------------
// TensorParallelDropout
// ---------------------------------------------------------------------------
TensorParallelDropout::TensorParallelDropout(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, float p,
                                             Region region)
    : Module(spec, std::move(name)), tp_(tp), p_(p), region_(region) {
  TESSERA_CHECK(p_ >= 0.0f && p_ < 1.0f, this->name(), ": the dropout probability must be in [0, 1), got ", p_,
                "; check --dropout");
}

Tensor TensorParallelDropout::apply(const Tensor& x, uint64_t seed, int64_t tokens) const {
  Tensor y = empty_like(x);
  const bool sequence_split = (tp_.sequence_parallel && tp_.size() > 1) || tp_.context_size() > 1;
  if (region_ == Region::split || tokens == 0 || !sequence_split) {
    ops::dropout_forward(x, y, p_, seed, 0);
    return y;
  }
  // This rank's tokens take the mask of their global positions in the whole
  // [B, T, C] mask (sequence parallelism: its part of the sequence; context
  // parallelism: its zigzag share), one call per run of consecutive positions.
  const int64_t per_context_rank = tp_.sequence_parallel ? tokens * tp_.size() : tokens;
  const int64_t whole_tokens = per_context_rank * tp_.context_size(), batch = x.size(0), features = x.size(2);
  const std::vector<int64_t> positions = held_positions(tp_, per_context_rank);
  const Tensor rows = x.view(Shape{batch * tokens, features});
  Tensor out = y.view(Shape{batch * tokens, features});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0, run = 1; i < tokens; i += run) {
      for (run = 1; i + run < tokens && positions[size_t(i + run)] == positions[size_t(i)] + run;) ++run;
      const uint64_t offset = uint64_t((b * whole_tokens + positions[size_t(i)]) * features);
      Tensor part = out.slice(b * tokens + i, b * tokens + i + run);
      ops::dropout_forward(rows.slice(b * tokens + i, b * tokens + i + run), part, p_, seed, offset);
    }
  return y;
}

Tensor TensorParallelDropout::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  saved.clear();
  if (!training() || p_ == 0.0f) return input;
  if (tp_.sequence_parallel && region_ == Region::replicated) check_sequence(input, name());
  const uint64_t seed = region_ == Region::split ? nn::dropout_seed(pass, name() + "#tp" + std::to_string(tp_.rank()))
                                                 : nn::dropout_seed(pass, name());
  saved.scalars = {int64_t(seed), input.ndim() == 3 ? input.size(1) : 0};
  return apply(input, seed, saved.scalars[1]);
}

Tensor TensorParallelDropout::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  if (saved.scalars.empty()) return grad_output;
  const uint64_t seed = uint64_t(saved.scalars[0]);
  const int64_t tokens = saved.scalars[1];
  saved.clear();
  // The mask is a pure function of (seed, element): backward multiplies by the same one.
  return apply(grad_output, seed, tokens);
}

// ---------------------------------------------------------------------------
// SequenceParallelGradients
// ---------------------------------------------------------------------------
SequenceParallelGradients::SequenceParallelGradients(std::vector<nn::Parameter*> parameters, Communicator& group)
    : parameters_(std::move(parameters)), group_(group) {}

void SequenceParallelGradients::begin() {
  int64_t total = 0;
  for (nn::Parameter* p : parameters_) total += p->grad.numel();
  if (!scratch_.defined() && !parameters_.empty()) {
    const Tensor& first = parameters_.front()->grad;
    scratch_ = first.context().empty(Shape{total}, DType::f32, first.device());
  }
  if (scratch_.defined()) scratch_.fill_(0.0);
  grads_.clear();
  hooks_.clear();
  int64_t offset = 0;
  for (nn::Parameter* p : parameters_) {
    grads_.push_back(p->grad);
    hooks_.push_back(std::move(p->on_grad_ready));
    p->on_grad_ready = nullptr;
    const int64_t n = p->grad.numel();
    p->grad = scratch_.slice(offset, offset + n).view(p->grad.shape());
    offset += n;
  }
}

void SequenceParallelGradients::end() {
  if (scratch_.defined()) tp_all_reduce(group_, scratch_);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    nn::Parameter* p = parameters_[i];
    ops::axpy(1.0f, p->grad, grads_[i]);
    p->grad = grads_[i];
    p->on_grad_ready = std::move(hooks_[i]);
  }
  for (nn::Parameter* p : parameters_)
    if (p->on_grad_ready) p->on_grad_ready(*p);
  grads_.clear();
  hooks_.clear();
}

// ---------------------------------------------------------------------------
// Attention, MLP, block
// ---------------------------------------------------------------------------
ParallelSelfAttention::ParallelSelfAttention(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                             int64_t hidden, int64_t heads, float dropout, float attention_dropout,
                                             bool bias)
    : Module(spec, std::move(name)), hidden_(hidden), attention_dropout_(attention_dropout) {
  TESSERA_CHECK(attention_dropout_ >= 0.0f && attention_dropout_ < 1.0f, this->name(),
                ": the attention dropout probability must be in [0, 1), got ", attention_dropout_,
                "; check --attention-dropout");
  TESSERA_CHECK(heads >= 1 && hidden_ % heads == 0, this->name(), ": ", heads, " heads do not divide hidden size ",
                hidden_, "; check --num-heads and --hidden-size");
  TESSERA_CHECK(heads % tp.size() == 0, this->name(), ": --num-heads ", heads,
                " is not divisible by --tensor-parallel ", tp.size());
  local_heads_ = heads / tp.size();
  first_head_ = tp.rank() * local_heads_;
  if (tp.context_size() > 1) context_ = tp.context;
  TESSERA_CHECK(!context_ || attention_dropout_ == 0.0f, this->name(), ": --attention-dropout ", attention_dropout_,
                " is not available with --context-parallel-size ", tp.context_size(),
                " yet (ring attention has no dropout); drop one of them");
  head_dim_ = hidden_ / heads;
  qkv_ = &add_child<ColumnParallelLinear>(spec, child_name("qkv"), tp, hidden_, 3 * hidden_, bias,
                                          ops::Activation::none, OutputSplit{3, heads});
  proj_ = &add_child<RowParallelLinear>(spec, child_name("proj"), tp, hidden_, hidden_, bias);
  dropout_ = &add_child<TensorParallelDropout>(spec, child_name("dropout"), tp, dropout);
}

Tensor ParallelSelfAttention::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  Tensor packed = qkv_->forward(input, saved.child(0), pass);  // [B, T, 3·H'·Dh], whole sequence
  TESSERA_CHECK(packed.ndim() == 3, name(), ": the input must be [B, T, ", hidden_, "], got ",
                input.shape().to_string());
  if (context_) {  // the whole sequence's attention by the ring (parallel/ring_attention.h)
    TESSERA_CHECK(!pass.kv_cache, name(), ": generation runs without context parallelism");
    const int64_t batch = packed.size(0), tokens = packed.size(1);
    saved.tensors.clear();
    const Tensor out = ring_attention_forward(
        *context_, packed.view(Shape{batch, tokens, 3, local_heads_, head_dim_}), false, saved.tensors);
    Tensor y = proj_->forward(out.view(Shape{batch, tokens, local_heads_ * head_dim_}), saved.child(1), pass);
    return dropout_->forward(y, saved.child(2), pass);
  }
  return nn::attention_from_qkv(*this, packed, local_heads_, head_dim_, *proj_, *dropout_, saved, pass,
                                nn::attention_dropout(*this, attention_dropout_, first_head_, pass));
}

Tensor ParallelSelfAttention::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  if (context_) {
    nn::check_saved(*this, saved, 4);
    const int64_t batch = saved.tensors[0].size(0), tokens = saved.tensors[0].size(1);
    Tensor grad = proj_->backward(dropout_->backward(grad_output, saved.child(2)), saved.child(1));
    const Tensor grad_packed = ring_attention_backward(
        *context_, grad, false, Shape{batch, tokens, 3, local_heads_, head_dim_}, saved.tensors);
    saved.tensors.clear();
    Tensor dx = qkv_->backward(grad_packed.view(Shape{batch, tokens, 3 * local_heads_ * head_dim_}), saved.child(0));
    saved.clear();
    return dx;
  }
  const Tensor grad_packed = nn::attention_from_qkv_backward(*this, *proj_, *dropout_, grad_output, saved);
  Tensor dx = qkv_->backward(grad_packed, saved.child(0));
  saved.clear();
  return dx;
}

ParallelMlp::ParallelMlp(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden,
                         int64_t ffn_hidden, float dropout, bool bias)
    : Module(spec, std::move(name)) {
  fc_ = &add_child<ColumnParallelLinear>(spec, child_name("fc"), tp, hidden, ffn_hidden, bias, ops::Activation::gelu);
  proj_ = &add_child<RowParallelLinear>(spec, child_name("proj"), tp, ffn_hidden, hidden, bias);
  dropout_ = &add_child<TensorParallelDropout>(spec, child_name("dropout"), tp, dropout);
}

Tensor ParallelMlp::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  Tensor y = fc_->forward(input, saved.child(0), pass);
  y = proj_->forward(y, saved.child(1), pass);
  return dropout_->forward(y, saved.child(2), pass);
}

Tensor ParallelMlp::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  Tensor grad = dropout_->backward(grad_output, saved.child(2));
  grad = proj_->backward(grad, saved.child(1));
  grad = fc_->backward(grad, saved.child(0));
  saved.clear();
  return grad;
}

// ---------------------------------------------------------------------------
// Which splits a model allows
// ---------------------------------------------------------------------------
std::string tensor_parallel_problem(const nn::ModelConfig& config, int tp, bool sequence_parallel) {
  std::ostringstream out;
  if (tp < 1) {
    out << "--tensor-parallel " << tp << " must be at least 1";
  } else if (tp == 1) {
    return {};
  } else if (!nn::model_traits(config.kind).splits_over_tensor_parallel) {
    out << "--tensor-parallel " << tp << " splits the layers of --model gpt or llama; --model " << nn::model_name(config.kind)
        << " trains with data parallelism only (use --tensor-parallel 1)";
  } else if (config.num_heads % tp != 0) {
    out << "--num-heads " << config.num_heads << " is not divisible by --tensor-parallel " << tp
        << ": each rank must hold whole attention heads; use a head count that is a multiple of " << tp;
  } else if (config.vocab_size % tp != 0) {
    out << "--vocab-size " << config.vocab_size << " is not divisible by --tensor-parallel " << tp
        << ": the embedding is split by vocabulary rows; pad the vocabulary to --vocab-size "
        << (config.vocab_size + tp - 1) / tp * tp;
  } else if (config.query_groups() % tp != 0) {
    out << "--num-query-groups " << config.query_groups() << " is not divisible by --tensor-parallel " << tp
        << ": each rank holds whole key/value groups (fewer groups than ranks would replicate them, which "
        << "Tessera does not do); use --tensor-parallel " << nn::nearest_divisor(config.query_groups(), tp)
        << " or a multiple of " << tp << " groups";
  } else if (config.ffn() % tp != 0) {
    out << "--ffn-hidden-size " << config.ffn() << " is not divisible by --tensor-parallel " << tp;
  } else if (sequence_parallel && config.seq_length % tp != 0) {
    out << "--sequence-parallel: --seq-length " << config.seq_length << " is not divisible by --tensor-parallel " << tp;
  }
  return out.str();
}

std::vector<int> tensor_parallel_sizes(const nn::ModelConfig& config) {
  std::vector<int> sizes = {1};
  for (int64_t tp = 2; tp <= config.num_heads; ++tp)
    if (tensor_parallel_problem(config, int(tp), false).empty()) sizes.push_back(int(tp));
  return sizes;
}

// ---------------------------------------------------------------------------
// VocabParallelCrossEntropy
// ---------------------------------------------------------------------------
VocabParallelCrossEntropy::VocabParallelCrossEntropy(Communicator& group, int64_t vocab_begin, int64_t vocab_size,
                                                     int64_t ignore_index)
    : group_(group), vocab_begin_(vocab_begin), vocab_size_(vocab_size), ignore_index_(ignore_index) {}

nn::LossValue VocabParallelCrossEntropy::forward(const Tensor& logits, const Tensor& targets, nn::Saved& saved) const {
  TESSERA_CHECK(logits.defined() && targets.defined() && logits.ndim() >= 2,
                "vocab-parallel cross-entropy: logits must be [N, V/K] or [B, T, V/K]");
  Context& ctx = logits.context();
  const int64_t local = logits.shape()[-1], rows = logits.numel() / local;
  TESSERA_CHECK(targets.numel() == rows, "vocab-parallel cross-entropy: ", targets.numel(), " targets for ", rows,
                " rows of logits");
  const Tensor logits_2d = logits.view(Shape{rows, local});
  const Tensor targets_1d = targets.view(Shape{rows});
  // The row max over the whole vocabulary, then Σ exp(x − max) and the target's logit.
  Tensor row_max = ctx.empty(Shape{rows}, DType::f32, logits.device());
  ops::cross_entropy_shard_max(logits_2d, row_max);
  if (group_.size() > 1) group_.all_reduce(row_max, ReduceOp::max)->wait();
  Tensor sums = ctx.empty(Shape{2, rows}, DType::f32, logits.device());
  ops::cross_entropy_shard_sums(logits_2d, targets_1d, row_max, vocab_begin_, sums, ignore_index_);
  tp_all_reduce(group_, sums);
  Tensor losses = ctx.empty(Shape{rows}, DType::f32, logits.device());
  Tensor logsumexp = ctx.empty(Shape{rows}, DType::f32, logits.device());
  ops::cross_entropy_shard_finish(row_max, sums, targets_1d, vocab_size_, losses, logsumexp, ignore_index_);
  return nn::finish_cross_entropy_forward(losses, logsumexp, targets_1d, ignore_index_, saved);
}

void VocabParallelCrossEntropy::backward(Tensor& logits, const Tensor& targets, float scale, nn::Saved& saved) const {
  nn::cross_entropy_backward_in_place(logits, targets, scale, saved, ignore_index_, "vocab-parallel cross-entropy",
                                      vocab_begin_, vocab_size_);
}

}  // namespace tessera::parallel
