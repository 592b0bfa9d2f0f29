// The decoder of models/decoder.h: its layers by the choices, the
// initialisation, forward and backward through the stage it holds, its
// parameter counts and the registry row GPT and Llama share.
#include "models/decoder.h"

#include <cmath>
#include <string>
#include <string_view>

#include "core/error.h"
#include "parallel/ring_attention.h"
#include "parallel/transformer_block.h"

namespace tessera::models {

using parallel::ParallelTransformerBlock;
using parallel::SequenceParallelGradients;
using parallel::TensorParallelDropout;
using parallel::TensorParallelism;
using parallel::VocabParallelEmbedding;

namespace {

// Saved-state slots: the embeddings' three, then each block's, then ln_f's.
constexpr size_t kWte = 0, kWpe = 1, kDropout = 2, kFirstBlock = 3;

bool ends_with(std::string_view name, std::string_view tail) {
  return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

bool is_norm_parameter(std::string_view name) {
  for (std::string_view norm : {"ln1.", "ln2.", "ln_f."}) {
    const size_t at = name.rfind(norm);
    if (at != std::string_view::npos && (at == 0 || name[at - 1] == '.') &&
        name.find('.', at + norm.size()) == std::string_view::npos)
      return true;
  }
  return false;
}

}  // namespace

Decoder::Decoder(const nn::ModelConfig& config, const nn::ModelSpec& spec, TensorParallelism tp,
                 const nn::StageLayers& stage)
    : CausalLm(config, spec, tp, stage) {
  const int64_t c = config_.hidden_size;
  const nn::DecoderChoices choices = config_.decoder();
  const bool tied = !choices.untie_embeddings;
  auto* shared = dynamic_cast<VocabParallelEmbedding*>(stage.shared_embedding);
  head_shares_first_chunk_ = tied && stage_.last() && shared;
  // The first stage's embedding, or the last stage's tied copy for the head.
  if (stage_.first() || (stage_.last() && tied && !head_shares_first_chunk_))
    wte_ = &add_child<VocabParallelEmbedding>(spec, "wte", tp_, config_.vocab_size, c);
  if (stage_.first()) {
    if (!choices.rotary) {
      wpe_ = &add_child<nn::PositionEmbedding>(spec, "wpe", config_.seq_length, c);
      if (tp_.sequence_parallel) wpe_->set_sequence_shard(tp_.rank(), tp_.size());
    }
    dropout_ = &add_child<TensorParallelDropout>(spec, "dropout", tp_, config_.dropout);
  } else if (wte_) {
    wte_->weight().tied_copy = true;
  }
  for (int64_t i = stage_.begin; i < stage_.end; ++i)
    blocks_.push_back(&add_child<ParallelTransformerBlock>(spec, "blocks." + std::to_string(i), tp_, config_, i));
  if (stage_.last()) {
    ln_f_ = &adopt_child(parallel::make_norm(spec, "ln_f", c, config_));
    head_ = head_shares_first_chunk_ ? shared
            : tied                   ? wte_
                                     : &add_child<VocabParallelEmbedding>(spec, "lm_head", tp_, config_.vocab_size, c);
  }
  if (tp_.sequence_parallel) {
    std::vector<nn::Parameter*> partial;
    if (wpe_) partial.push_back(&wpe_->weight());
    if (ln_f_)
      for (nn::Parameter* p : ln_f_->parameters()) partial.push_back(p);
    if (!partial.empty()) partial_ = std::make_unique<SequenceParallelGradients>(partial, *tp_.group);
  }
  initialise();
}

// Each shard draws its elements of the whole tensors (nn::Module's initialisers).
void Decoder::initialise() {
  constexpr float kStd = 0.02f;
  const float residual_std = kStd / std::sqrt(2.0f * float(config_.num_layers));
  for (nn::Parameter* p : parameters()) {
    const std::string& n = p->name;
    if (is_norm_parameter(n)) continue;  // ones and zeros, as built
    if (ends_with(n, ".bias"))
      init_constant(*p, 0.0f);
    else
      init_normal(*p, ends_with(n, ".proj.weight") ? residual_std : kStd);  // attn, mlp and experts' output layers
  }
}

nn::Parameter* Decoder::embedding_table() {
  return config_.untied() || !wte_ ? nullptr : &wte_->weight();
}

void Decoder::set_recompute(bool recompute) {
  config_.recompute = recompute;
  for (ParallelTransformerBlock* block : blocks_) block->set_recompute(recompute);
}

Tensor Decoder::embed(const Tensor& ids, nn::Saved& saved, const nn::Pass& pass) {
  const std::string_view model = nn::model_name(config_.kind);
  TESSERA_CHECK(ids.ndim() == 2, model, ": token ids must be [batch, tokens], got shape ", ids.shape().to_string());
  TESSERA_CHECK(ids.size(1) <= config_.seq_length, model, ": a sequence of ", ids.size(1),
                " tokens is longer than --seq-length ", config_.seq_length);
  TESSERA_CHECK(!tp_.sequence_parallel || ids.size(1) % tp_.size() == 0, model, ": --sequence-parallel: a sequence of ",
                ids.size(1), " tokens cannot be split over --tensor-parallel ", tp_.size());
  Tensor x = wte_->forward(ids, saved.child(kWte), pass);
  if (wpe_ && tp_.context_size() > 1) wpe_->set_positions(parallel::held_positions(tp_, ids.size(1)));
  if (wpe_) x = wpe_->forward(x, saved.child(kWpe), pass);
  return dropout_->forward(x, saved.child(kDropout), pass);
}

Tensor Decoder::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  Tensor x = input;
  int64_t batch = input.size(0), tokens = 0;
  if (stage_.first()) {
    tokens = input.ndim() == 2 ? input.size(1) : 0;
    x = embed(input, saved, pass);
  } else {
    TESSERA_CHECK(input.ndim() == 3 && input.size(2) == config_.hidden_size, nn::model_name(config_.kind),
                  " pipeline stage ", stage_.stage, ": the hidden states have shape ", input.shape().to_string(),
                  ", expected [B, T, ", config_.hidden_size, "]");
    tokens = input.size(1) * (tp_.sequence_parallel ? tp_.size() : 1);
  }
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->forward(x, saved.child(kFirstBlock + i), pass);
  if (!stage_.last()) return x;
  x = ln_f_->forward(x, saved.child(kFirstBlock + blocks_.size()), pass);
  return head_forward(x, batch, tokens, *head_, saved);
}

Tensor Decoder::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  // Sequence parallelism sums wpe's and ln_f's gradients over the group after
  // this whole backward: under ZeRO-2/3 their gradient buffers must exist
  // from here to there (nothing is held without parameter hooks).
  // (Weight-gradient work: in the W step of a backward in two halves.)
  auto summed_later = std::make_shared<std::vector<std::unique_ptr<nn::ParametersInUse>>>();
  if (partial_)
    add_weight_gradients([this, summed_later, phase = weight_gradient_phase()] {
      for (nn::Module* module : {static_cast<nn::Module*>(wpe_), ln_f_})
        if (module) summed_later->push_back(std::make_unique<nn::ParametersInUse>(*module, phase));
      partial_->begin();
    });
  const auto end_partial = [this, summed_later] {
    if (!partial_) return;
    add_weight_gradients([this, summed_later] {
      partial_->end();
      summed_later->clear();
    });
  };
  Tensor grad = grad_output;
  if (stage_.last()) {
    grad = head_backward(grad_output, *head_, saved);
    grad = ln_f_->backward(grad, saved.child(kFirstBlock + blocks_.size()));
    // The head's use of its table is complete (its own, a tied copy's, or the
    // first stage's table before the embedding adds its own use).
    nn::Parameter& table = head_->weight();
    if (!head_shares_first_chunk_ && (head_ != wte_ || !stage_.first()))
      add_weight_gradients([&table] {
        if (table.on_grad_ready) table.on_grad_ready(table);
      });
  }
  for (size_t i = blocks_.size(); i-- > 0;) grad = blocks_[i]->backward(grad, saved.child(kFirstBlock + i));
  if (!stage_.first()) {
    end_partial();
    saved.clear();
    return grad;
  }
  grad = dropout_->backward(grad, saved.child(kDropout));
  if (wpe_) grad = wpe_->backward(grad, saved.child(kWpe));
  end_partial();
  wte_->backward(grad, saved.child(kWte));
  saved.clear();
  return Tensor();
}

nn::LayerCosts decoder_costs(const nn::ModelConfig& m) {
  const nn::DecoderChoices choices = m.decoder();
  const int64_t h = m.hidden_size, f = m.ffn(), dh = h / m.num_heads, bias = choices.bias ? 1 : 0;
  const int64_t norm = choices.normalization == nn::Normalization::layer_norm ? 2 * h : h;
  const int64_t qkv_rows = (m.num_heads + 2 * m.query_groups()) * dh;
  const int64_t attention = qkv_rows * h + bias * qkv_rows + h * h + bias * h;
  const int64_t mlp_rows = choices.swiglu ? 2 * f : f;
  const int64_t mlp = mlp_rows * h + bias * mlp_rows + f * h + bias * h;
  // A mixture of experts: the router [E, C] and E SwiGLU experts without biases.
  const int64_t experts = m.num_experts * h + m.num_experts * 3 * m.moe_ffn() * h;
  nn::LayerCosts costs;
  for (int64_t layer = 0; layer < m.num_layers; ++layer)
    costs.layers.push_back(2 * norm + attention + (m.moe_layer(layer) ? experts : mlp));
  costs.first = m.vocab_size * h + (choices.rotary ? 0 : m.seq_length * h);
  costs.last = m.vocab_size * h + norm;  // the head: its own table or the tied copy
  return costs;
}

ModelRow decoder_row(nn::ModelKind kind) {
  ModelRow row;
  row.kind = kind;
  row.build = [](const nn::ModelConfig& config, const nn::ModelSpec& spec, const TensorParallelism& tp,
                 const nn::StageLayers& layers) -> std::unique_ptr<nn::Module> {
    return std::make_unique<Decoder>(config, spec, tp, layers);
  };
  row.pipeline_layers = [](const nn::ModelConfig& config) { return config.num_layers; };
  row.layer_costs = decoder_costs;
  row.stage_input_shape = causal_lm_stage_input;
  row.causal_lm = true;
  return row;
}

}  // namespace tessera::models
