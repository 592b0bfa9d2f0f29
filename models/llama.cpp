// The Llama decoder of models/llama.h: its block, initialisation, forward and
// backward through the stage it holds, and its registry row.
#include "models/llama.h"

#include <cmath>
#include <string>
#include <string_view>

#include "core/error.h"
#include "parallel/llama_layers.h"

namespace tessera::models {

using parallel::ParallelGatedMlp;
using parallel::ParallelGroupedAttention;
using parallel::SequenceParallelGradients;
using parallel::TensorParallelDropout;
using parallel::TensorParallelism;
using parallel::VocabParallelEmbedding;

// Pre-norm block (recomputation as every PreLnBlock's): RMSNorm, grouped
// attention, RMSNorm, SwiGLU MLP. Under sequence parallelism its norms'
// gradients are summed over the group after its backward.
class LlamaBlock : public nn::PreLnBlock {
 public:
  LlamaBlock(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, const nn::ModelConfig& m)
      : PreLnBlock(spec, std::move(name), m.recompute) {
    ln1_ = &add_child<nn::RMSNorm>(spec, child_name("ln1"), m.hidden_size, m.norm_epsilon);
    auto& attn = add_child<ParallelGroupedAttention>(spec, child_name("attn"), tp, m.hidden_size, m.num_heads,
                                                     m.query_groups(), m.rotary_base, m.dropout, m.attention_dropout);
    ln2_ = &add_child<nn::RMSNorm>(spec, child_name("ln2"), m.hidden_size, m.norm_epsilon);
    auto& mlp = add_child<ParallelGatedMlp>(spec, child_name("mlp"), tp, m.hidden_size, m.ffn(), m.dropout);
    set_parts(*ln1_, attn, *ln2_, mlp);
    if (tp.sequence_parallel && tp.size() > 1)
      partial_ = std::make_unique<SequenceParallelGradients>(
          std::vector<nn::Parameter*>{&ln1_->weight(), &ln2_->weight()}, *tp.group);
  }

 private:
  void before_backward() override {
    if (partial_) partial_->begin();
  }
  void after_backward() override {
    if (partial_) partial_->end();
  }
  nn::RMSNorm* ln1_;
  nn::RMSNorm* ln2_;
  std::unique_ptr<SequenceParallelGradients> partial_;
};

Llama::Llama(const nn::ModelConfig& config, const nn::ModelSpec& spec, TensorParallelism tp,
             const nn::StageLayers& stage)
    : CausalLm(config, spec, tp, stage) {
  const int64_t c = config_.hidden_size;
  const bool tied = !config_.untie_embeddings;
  if (stage_.first() || (stage_.last() && tied))
    wte_ = &add_child<VocabParallelEmbedding>(spec, "wte", tp_, config_.vocab_size, c);
  if (stage_.first()) {
    dropout_ = &add_child<TensorParallelDropout>(spec, "dropout", tp_, config_.dropout);
  } else if (wte_) {
    wte_->weight().tied_copy = true;
  }
  for (int64_t i = stage_.begin; i < stage_.end; ++i)
    blocks_.push_back(&add_child<LlamaBlock>(spec, "blocks." + std::to_string(i), tp_, config_));
  if (stage_.last()) {
    ln_f_ = &add_child<nn::RMSNorm>(spec, "ln_f", c, config_.norm_epsilon);
    head_ = tied ? wte_ : &add_child<VocabParallelEmbedding>(spec, "lm_head", tp_, config_.vocab_size, c);
    if (tp_.sequence_parallel) partial_ = std::make_unique<SequenceParallelGradients>(
        std::vector<nn::Parameter*>{&ln_f_->weight()}, *tp_.group);
  }
  initialise();
}

// Megatron's initialisation; each shard draws its elements of the whole tensors.
void Llama::initialise() {
  constexpr float kStd = 0.02f;
  const float residual_std = kStd / std::sqrt(2.0f * float(config_.num_layers));
  for (nn::Parameter* p : parameters()) {
    const std::string& n = p->name;
    const auto ends_with = [&](std::string_view tail) {
      return n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (ends_with("ln1.weight") || ends_with("ln2.weight") || n == "ln_f.weight") continue;  // ones
    init_normal(*p, ends_with("attn.proj.weight") || ends_with("mlp.proj.weight") ? residual_std : kStd);
  }
}

nn::Parameter* Llama::embedding_table() {
  return config_.untie_embeddings || !wte_ ? nullptr : &wte_->weight();
}

void Llama::set_recompute(bool recompute) {
  config_.recompute = recompute;
  for (LlamaBlock* block : blocks_) block->set_recompute(recompute);
}

Tensor Llama::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  const size_t head = 2 + blocks_.size();
  Tensor x = input;
  int64_t batch = 0, tokens = 0;
  if (stage_.first()) {
    TESSERA_CHECK(input.ndim() == 2, "llama: token ids must be [batch, tokens], got shape ",
                  input.shape().to_string());
    TESSERA_CHECK(input.size(1) <= config_.seq_length, "llama: a sequence of ", input.size(1),
                  " tokens is longer than --seq-length ", config_.seq_length);
    TESSERA_CHECK(!tp_.sequence_parallel || input.size(1) % tp_.size() == 0,
                  "llama: --sequence-parallel: a sequence of ", input.size(1),
                  " tokens cannot be split over --tensor-parallel ", tp_.size());
    batch = input.size(0);
    tokens = input.size(1);
    x = wte_->forward(input, saved.child(0), pass);
    x = dropout_->forward(x, saved.child(1), pass);
  } else {
    TESSERA_CHECK(input.ndim() == 3 && input.size(2) == config_.hidden_size, "llama pipeline stage ", stage_.stage,
                  ": the hidden states have shape ", input.shape().to_string(), ", expected [B, T, ",
                  config_.hidden_size, "]");
    batch = input.size(0);
    tokens = input.size(1) * (tp_.sequence_parallel ? tp_.size() : 1);
  }
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->forward(x, saved.child(2 + i), pass);
  if (!stage_.last()) return x;
  x = ln_f_->forward(x, saved.child(head), pass);
  return head_forward(x, batch, tokens, *head_, saved);
}

Tensor Llama::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  const size_t head = 2 + blocks_.size();
  // Under ZeRO-2/3 ln_f's gradient buffer must exist until the sequence-parallel sum after this backward.
  std::unique_ptr<nn::ParametersInUse> summed_later;
  if (partial_) summed_later = std::make_unique<nn::ParametersInUse>(*ln_f_, nn::ParameterPhase::backward);
  if (partial_) partial_->begin();
  Tensor grad = grad_output;
  if (stage_.last()) {
    grad = head_backward(grad_output, *head_, saved);
    grad = ln_f_->backward(grad, saved.child(head));
    // A tied head's use of the table is complete (its copy's, or the first stage's before the embedding adds its own).
    nn::Parameter& table = head_->weight();
    if ((head_ != wte_ || !stage_.first()) && table.on_grad_ready) table.on_grad_ready(table);
  }
  if (partial_) partial_->end();
  summed_later.reset();
  for (size_t i = blocks_.size(); i-- > 0;) grad = blocks_[i]->backward(grad, saved.child(2 + i));
  if (!stage_.first()) {
    saved.clear();
    return grad;
  }
  grad = dropout_->backward(grad, saved.child(1));
  wte_->backward(grad, saved.child(0));
  saved.clear();
  return Tensor();
}

namespace {

// Per block: two norms, qkv (H + 2G heads of Dh), proj, the SwiGLU's three
// matrices; the first stage's table, the last's ln_f and head (its own or the tied copy).
nn::LayerCosts llama_costs(const nn::ModelConfig& m) {
  nn::LayerCosts costs;
  const int64_t h = m.hidden_size, f = m.ffn(), dh = h / m.num_heads;
  const int64_t qkv = (m.num_heads + 2 * m.query_groups()) * dh * h;
  const int64_t block = 2 * h + qkv + m.num_heads * dh * h + 3 * h * f;
  costs.layers.assign(size_t(m.num_layers), block);
  costs.first = m.vocab_size * h;
  costs.last = m.vocab_size * h + h;
  return costs;
}

}  // namespace

ModelRow llama_row() {
  ModelRow row;
  row.kind = nn::ModelKind::llama;
  row.build = [](const nn::ModelConfig& config, const nn::ModelSpec& spec, const TensorParallelism& tp,
                 const nn::StageLayers& layers) -> std::unique_ptr<nn::Module> {
    return std::make_unique<Llama>(config, spec, tp, layers);
  };
  row.pipeline_layers = [](const nn::ModelConfig& config) { return config.num_layers; };
  row.layer_costs = llama_costs;
  row.stage_input_shape = causal_lm_stage_input;
  row.causal_lm = true;
  return row;
}

}  // namespace tessera::models
