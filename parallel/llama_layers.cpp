// The Llama family's tensor-parallel layers (parallel/llama_layers.h).
#include "parallel/llama_layers.h"

#include <numeric>
#include <vector>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "nn/kv_cache.h"

namespace tessera::parallel {
namespace {

Tensor empty_like(const Tensor& t) {
  return t.context().empty(t.shape(), t.dtype(), t.device());
}

}  // namespace

// ---------------------------------------------------------------------------
// ParallelGroupedAttention
// ---------------------------------------------------------------------------
ParallelGroupedAttention::ParallelGroupedAttention(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                                   int64_t hidden, int64_t heads, int64_t groups, float rotary_base,
                                                   float dropout, float attention_dropout, bool bias)
    : Module(spec, std::move(name)), hidden_(hidden), rotary_base_(rotary_base), attention_dropout_(attention_dropout) {
  TESSERA_CHECK(attention_dropout_ >= 0.0f && attention_dropout_ < 1.0f, this->name(),
                ": the attention dropout probability must be in [0, 1), got ", attention_dropout_,
                "; check --attention-dropout");
  TESSERA_CHECK(heads >= 1 && hidden_ % heads == 0, this->name(), ": ", heads, " heads do not divide hidden size ",
                hidden_, "; check --num-heads and --hidden-size");
  TESSERA_CHECK(groups >= 1 && heads % groups == 0, this->name(), ": --num-query-groups ", groups,
                " does not divide --num-heads ", heads);
  TESSERA_CHECK(groups % tp.size() == 0, this->name(), ": --num-query-groups ", groups,
                " is not divisible by --tensor-parallel ", tp.size(),
                ": each rank holds whole key/value groups (with their query heads)");
  if (tp.context_size() > 1) context_ = tp.context;
  TESSERA_CHECK(!context_ || attention_dropout_ == 0.0f, this->name(), ": --attention-dropout ", attention_dropout_,
                " is not available with --context-parallel-size ", tp.context_size(),
                " yet (ring attention has no dropout); drop one of them");
  head_dim_ = hidden_ / heads;
  per_group_ = heads / groups;
  local_groups_ = groups / tp.size();
  first_head_ = tp.rank() * local_groups_ * per_group_;
  const int64_t qkv_features = groups * (per_group_ + 2) * head_dim_;
  // A plain split of the grouped layout's rows is a split by whole groups.
  qkv_ = &add_child<ColumnParallelLinear>(spec, child_name("qkv"), tp, hidden_, qkv_features, bias);
  proj_ = &add_child<RowParallelLinear>(spec, child_name("proj"), tp, heads * head_dim_, hidden_, bias);
  dropout_ = &add_child<TensorParallelDropout>(spec, child_name("dropout"), tp, dropout);
}

Tensor ParallelGroupedAttention::positions(int64_t first, int64_t tokens) const {
  std::vector<int64_t> values(static_cast<size_t>(tokens));
  std::iota(values.begin(), values.end(), first);
  return context().from_vector(Shape{tokens}, values, spec().device);
}

Tensor ParallelGroupedAttention::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  const Tensor packed = qkv_->forward(input, saved.child(0), pass);  // [B, T, G'·(R+2)·Dh], the whole sequence
  TESSERA_CHECK(packed.ndim() == 3, name(), ": the input must be [B, T, ", hidden_, "], got ",
                input.shape().to_string());
  const int64_t batch = packed.size(0), tokens = packed.size(1), heads = local_groups_ * per_group_;
  const Tensor qkv = packed.view(Shape{batch, tokens, local_groups_, per_group_ + 2, head_dim_});
  const int64_t first = pass.kv_cache ? pass.kv_cache->position() : 0;
  TESSERA_CHECK(!context_ || !pass.kv_cache, name(), ": generation runs without context parallelism");
  const Tensor where = context_ ? context_positions(*context_, tokens, context(), spec().device) : positions(first, tokens);
  Tensor rotated = qkv;
  if (rotary_base_ > 0.0f) {
    rotated = empty_like(qkv);
    ops::rotary_forward(qkv, where, rotated, rotary_base_);
  }
  if (pass.kv_cache) return attend_with_cache(rotated, saved, pass);
  if (context_) return attend_over_ring(rotated, where, saved, pass);
  Tensor out = context().empty(Shape{batch, tokens, heads, head_dim_}, spec().dtype, spec().device);
  Tensor logsumexp = context().empty(Shape{batch, heads, tokens}, DType::f32, spec().device);
  const ops::AttentionDropout attention_dropout = nn::attention_dropout(*this, attention_dropout_, first_head_, pass);
  ops::grouped_attention_forward(rotated, out, logsumexp, 0.0f, attention_dropout);
  Tensor y = proj_->forward(out.view(Shape{batch, tokens, heads * head_dim_}), saved.child(1), pass);
  y = dropout_->forward(y, saved.child(2), pass);
  saved.tensors = {rotated, out, logsumexp, where};
  nn::save_attention_dropout(saved, attention_dropout);
  return y;
}

Tensor ParallelGroupedAttention::attend_with_cache(const Tensor& rotated, nn::Saved& saved, const nn::Pass& pass) {
  const int64_t batch = rotated.size(0), tokens = rotated.size(1), heads = local_groups_ * per_group_;
  nn::KvCache& cache = *pass.kv_cache;
  TESSERA_CHECK(cache.batch() == batch, name(), ": the KV cache is for ", cache.batch(), " sequences, the input has ",
                batch);
  nn::KvCache::Layer& layer = cache.layer(*this, local_groups_, head_dim_);  // G' heads cached, not H'
  Tensor out = context().empty(Shape{batch, tokens, heads, head_dim_}, spec().dtype, spec().device);
  ops::grouped_attention_with_cache(rotated, layer.keys, layer.values, cache.position(), out, 0.0f);
  Tensor y = proj_->forward(out.view(Shape{batch, tokens, heads * head_dim_}), saved.child(1), pass);
  return dropout_->forward(y, saved.child(2), pass);
}

// Under context parallelism: attention over the whole sequence by the ring.
Tensor ParallelGroupedAttention::attend_over_ring(const Tensor& rotated, const Tensor& where, nn::Saved& saved,
                                                  const nn::Pass& pass) {
  const int64_t batch = rotated.size(0), tokens = rotated.size(1), heads = local_groups_ * per_group_;
  saved.tensors = {where};
  const Tensor out = ring_attention_forward(*context_, rotated, true, saved.tensors);
  Tensor y = proj_->forward(out.view(Shape{batch, tokens, heads * head_dim_}), saved.child(1), pass);
  return dropout_->forward(y, saved.child(2), pass);
}

Tensor ParallelGroupedAttention::ring_backward(const Tensor& grad_out, nn::Saved& saved) {
  nn::check_saved(*this, saved, 5);
  const Tensor where = saved.tensors[0];
  const int64_t batch = saved.tensors[1].size(0), tokens = saved.tensors[1].size(1);
  Tensor grad_rotated =
      ring_attention_backward(*context_, grad_out, true, Shape{batch, tokens, local_groups_, per_group_ + 2, head_dim_},
                              {saved.tensors.begin() + 1, saved.tensors.end()});
  saved.tensors.clear();
  if (rotary_base_ > 0.0f) ops::rotary_backward(grad_rotated, where, grad_rotated, rotary_base_);  // in place
  Tensor dx = qkv_->backward(grad_rotated.view(Shape{batch, tokens, grad_rotated.numel() / (batch * tokens)}),
                             saved.child(0));
  saved.clear();
  return dx;
}

Tensor ParallelGroupedAttention::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  if (context_) {
    Tensor grad = dropout_->backward(grad_output, saved.child(2));
    return ring_backward(proj_->backward(grad, saved.child(1)), saved);
  }
  nn::check_saved(*this, saved, 4);
  Tensor grad = dropout_->backward(grad_output, saved.child(2));
  grad = proj_->backward(grad, saved.child(1));
  const Tensor rotated = saved.tensors[0], out = saved.tensors[1], logsumexp = saved.tensors[2];
  const Tensor where = saved.tensors[3];
  const ops::AttentionDropout attention_dropout = nn::saved_attention_dropout(saved);
  saved.tensors.clear();
  Tensor grad_rotated = empty_like(rotated);
  ops::grouped_attention_backward(grad.view(out.shape()), rotated, out, logsumexp, grad_rotated, 0.0f,
                                  attention_dropout);
  if (rotary_base_ > 0.0f) ops::rotary_backward(grad_rotated, where, grad_rotated, rotary_base_);  // in place
  const int64_t batch = rotated.size(0), tokens = rotated.size(1);
  Tensor dx = qkv_->backward(grad_rotated.view(Shape{batch, tokens, rotated.numel() / (batch * tokens)}),
                             saved.child(0));
  saved.clear();
  return dx;
}

// ---------------------------------------------------------------------------
// ParallelGatedMlp
// ---------------------------------------------------------------------------
ParallelGatedMlp::ParallelGatedMlp(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden,
                                   int64_t ffn_hidden, float dropout, bool bias)
    : Module(spec, std::move(name)) {
  TESSERA_CHECK(ffn_hidden % tp.size() == 0, this->name(), ": --ffn-hidden-size ", ffn_hidden,
                " is not divisible by --tensor-parallel ", tp.size());
  // [gate; up] split as two groups of F rows: each rank holds F/K rows of each.
  fc_ = &add_child<ColumnParallelLinear>(spec, child_name("fc"), tp, hidden, 2 * ffn_hidden, bias,
                                         ops::Activation::none, OutputSplit{2, ffn_hidden});
  proj_ = &add_child<RowParallelLinear>(spec, child_name("proj"), tp, ffn_hidden, hidden, bias);
  dropout_ = &add_child<TensorParallelDropout>(spec, child_name("dropout"), tp, dropout);
}

Tensor ParallelGatedMlp::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  const Tensor gate_up = fc_->forward(input, saved.child(0), pass);  // [..., 2F/K]
  Tensor gated = context().empty(gate_up.shape().with_dim(-1, gate_up.shape()[-1] / 2), spec().dtype, spec().device);
  ops::swiglu_forward(gate_up, gated);
  Tensor y = proj_->forward(gated, saved.child(1), pass);
  y = dropout_->forward(y, saved.child(2), pass);
  if (!pass.kv_cache) saved.tensors = {gate_up};
  return y;
}

Tensor ParallelGatedMlp::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  nn::check_saved(*this, saved, 1);
  const Tensor gate_up = saved.tensors[0];
  saved.tensors.clear();
  Tensor grad = dropout_->backward(grad_output, saved.child(2));
  grad = proj_->backward(grad, saved.child(1));
  Tensor grad_gate_up = empty_like(gate_up);
  ops::swiglu_backward(gate_up, grad, grad_gate_up);
  Tensor dx = fc_->backward(grad_gate_up, saved.child(0));
  saved.clear();
  return dx;
}

}  // namespace tessera::parallel
