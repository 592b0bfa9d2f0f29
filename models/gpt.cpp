// The GPT of models/gpt.h: its layers, GPT-2's initialisation, forward and
// backward through the stage it holds, and its registry row.
#include "models/gpt.h"

#include <cmath>
#include <string>
#include <string_view>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"

namespace tessera::models {

using parallel::ParallelTransformerBlock;
using parallel::SequenceParallelGradients;
using parallel::TensorParallelDropout;
using parallel::TensorParallelism;
using parallel::VocabParallelEmbedding;

Gpt::Gpt(const nn::ModelConfig& config, const nn::ModelSpec& spec, TensorParallelism tp, const nn::StageLayers& stage)
    : CausalLm(config, spec, tp, stage) {
  const int64_t c = config_.hidden_size;
  // The first stage's embedding, or the last stage's tied copy for the head.
  if (stage_.first() || stage_.last())
    wte_ = &add_child<VocabParallelEmbedding>(spec, "wte", tp_, config_.vocab_size, c);
  if (stage_.first()) {
    wpe_ = &add_child<nn::PositionEmbedding>(spec, "wpe", config_.seq_length, c);
    if (tp_.sequence_parallel) wpe_->set_sequence_shard(tp_.rank(), tp_.size());
    dropout_ = &add_child<TensorParallelDropout>(spec, "dropout", tp_, config_.dropout);
  } else if (wte_) {
    wte_->weight().tied_copy = true;
  }
  for (int64_t i = stage_.begin; i < stage_.end; ++i)
    blocks_.push_back(&add_child<ParallelTransformerBlock>(spec, "blocks." + std::to_string(i), tp_, c,
                                                           config_.num_heads, config_.ffn(), config_.dropout,
                                                           config_.attention_dropout, config_.recompute));
  if (stage_.last()) ln_f_ = &add_child<nn::LayerNorm>(spec, "ln_f", c);
  if (tp_.sequence_parallel) {
    std::vector<nn::Parameter*> partial;
    if (wpe_) partial.push_back(&wpe_->weight());
    if (ln_f_) partial.insert(partial.end(), {&ln_f_->weight(), ln_f_->bias()});
    if (!partial.empty()) partial_ = std::make_unique<SequenceParallelGradients>(partial, *tp_.group);
  }
  initialise();
}

// GPT-2 initialisation (nn/models.h): each shard draws its elements of the whole tensors.
void Gpt::initialise() {
  constexpr float kStd = 0.02f;
  const float residual_std = kStd / std::sqrt(2.0f * float(config_.num_layers));
  if (wte_) init_normal(wte_->weight(), kStd);
  if (wpe_) init_normal(wpe_->weight(), kStd);
  for (nn::Parameter* p : parameters()) {
    const std::string& n = p->name;
    const auto ends_with = [&](std::string_view tail) {
      return n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (n.rfind("blocks.", 0) != 0 || ends_with("ln1.weight") || ends_with("ln1.bias") || ends_with("ln2.weight") ||
        ends_with("ln2.bias"))
      continue;
    if (ends_with(".bias"))
      init_constant(*p, 0.0f);
    else
      init_normal(*p, ends_with("attn.proj.weight") || ends_with("mlp.proj.weight") ? residual_std : kStd);
  }
}

void Gpt::set_recompute(bool recompute) {
  config_.recompute = recompute;
  for (ParallelTransformerBlock* block : blocks_) block->set_recompute(recompute);
}

Tensor Gpt::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  const size_t head = 3 + blocks_.size();
  Tensor x = input;
  int64_t batch = 0, tokens = 0;
  if (stage_.first()) {
    TESSERA_CHECK(input.ndim() == 2, "gpt: token ids must be [batch, tokens], got shape ", input.shape().to_string());
    TESSERA_CHECK(input.size(1) <= config_.seq_length, "gpt: a sequence of ", input.size(1),
                  " tokens is longer than --seq-length ", config_.seq_length);
    TESSERA_CHECK(!tp_.sequence_parallel || input.size(1) % tp_.size() == 0, "gpt: --sequence-parallel: a sequence of ",
                  input.size(1), " tokens cannot be split over --tensor-parallel ", tp_.size());
    batch = input.size(0);
    tokens = input.size(1);
    x = wte_->forward(input, saved.child(0), pass);
    x = wpe_->forward(x, saved.child(1), pass);
    x = dropout_->forward(x, saved.child(2), pass);
  } else {
    TESSERA_CHECK(input.ndim() == 3 && input.size(2) == config_.hidden_size, "gpt pipeline stage ", stage_.stage,
                  ": the hidden states have shape ", input.shape().to_string(), ", expected [B, T, ",
                  config_.hidden_size, "]");
    batch = input.size(0);
    tokens = input.size(1) * (tp_.sequence_parallel ? tp_.size() : 1);
  }
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->forward(x, saved.child(3 + i), pass);
  if (!stage_.last()) return x;
  x = ln_f_->forward(x, saved.child(head), pass);
  return head_forward(x, batch, tokens, *wte_, saved);
}

Tensor Gpt::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  const size_t head = 3 + blocks_.size();
  // Sequence parallelism sums wpe's and ln_f's gradients over the group after
  // this whole backward: under ZeRO-2/3 their gradient buffers must exist
  // from here to there (nothing is held without parameter hooks).
  std::vector<std::unique_ptr<nn::ParametersInUse>> summed_later;
  if (partial_)
    for (nn::Module* module : {static_cast<nn::Module*>(wpe_), static_cast<nn::Module*>(ln_f_)})
      if (module) summed_later.push_back(std::make_unique<nn::ParametersInUse>(*module, nn::ParameterPhase::backward));
  if (partial_) partial_->begin();
  Tensor grad = grad_output;
  if (stage_.last()) {
    grad = head_backward(grad_output, *wte_, saved);
    grad = ln_f_->backward(grad, saved.child(head));
    // The head's use of the table is complete (a tied copy's, or the first stage's before the embedding adds its own).
    nn::Parameter& wte = wte_->weight();
    if (!stage_.first() && wte.on_grad_ready) wte.on_grad_ready(wte);
  }
  for (size_t i = blocks_.size(); i-- > 0;) grad = blocks_[i]->backward(grad, saved.child(3 + i));
  if (!stage_.first()) {
    if (partial_) partial_->end();
    saved.clear();
    return grad;
  }
  grad = dropout_->backward(grad, saved.child(2));
  grad = wpe_->backward(grad, saved.child(1));
  if (partial_) partial_->end();
  wte_->backward(grad, saved.child(0));
  saved.clear();
  return Tensor();
}


namespace {

// ln_1, attention (qkv and output projections), ln_2, the MLP's two layers; the
// first stage's wte and wpe, the last's ln_f and the head's tied copy of wte.
nn::LayerCosts gpt_costs(const nn::ModelConfig& m) {
  nn::LayerCosts costs;
  const int64_t h = m.hidden_size, f = m.ffn();
  const int64_t block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h);
  costs.layers.assign(size_t(m.num_layers), block);
  costs.first = m.vocab_size * h + m.seq_length * h;
  costs.last = m.vocab_size * h + 2 * h;
  return costs;
}

}  // namespace

ModelRow gpt_row() {
  ModelRow row;
  row.kind = nn::ModelKind::gpt;
  row.build = [](const nn::ModelConfig& config, const nn::ModelSpec& spec, const TensorParallelism& tp,
                 const nn::StageLayers& layers) -> std::unique_ptr<nn::Module> {
    return std::make_unique<Gpt>(config, spec, tp, layers);
  };
  row.pipeline_layers = [](const nn::ModelConfig& config) { return config.num_layers; };
  row.layer_costs = gpt_costs;
  row.stage_input_shape = causal_lm_stage_input;
  row.causal_lm = true;
  return row;
}

}  // namespace tessera::models
