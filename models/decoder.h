// Decoder: the decoder-only transformer both language models are (GPT-2's
// and the Llama family's; nn/models.h), with the architectural choices of
// its nn::ModelConfig (nn::DecoderChoices: Megatron's switches, each working
// on its own), split over a tensor-parallel group and cut into pipeline
// stages. A CausalLm (models/causal_lm.h).
//
//   ids [B, T] → wte [V, C] (+ wpe [T, C] with learned positions) → dropout →
//   blocks.<i> (parallel::ParallelTransformerBlock: pre-norm, attention with
//   H heads over G key/value groups, rotary when chosen, GELU or SwiGLU MLP)
//   → ln_f → logits [B, T, V/K] = x·tableᵀ, the table being wte (tied) or
//   lm_head [V, C] (--untie-embeddings-and-output-weights).
//
// Parameters (logical tensors, as checkpoints store them): wte.weight,
// wpe.weight (learned positions), blocks.<i>.{ln1, attn.qkv, attn.proj, ln2,
// mlp.fc, mlp.proj}.{weight, bias (when there are biases; norms: LayerNorm's)},
// ln_f.{weight, bias}, lm_head.weight (untied). attn.qkv's rows are GPT-2's
// [3, H, Dh] or Megatron's grouped [G, R+2, Dh] (ModelConfig::grouped_attention);
// mlp.fc's are [F] (GELU) or [gate F; up F] (SwiGLU).
//
// Initialisation (GPT-2's and Megatron's): normal(0, 0.02) for matrices and
// embeddings, the residual projections (attn.proj, mlp.proj) normal(0,
// 0.02/√(2·layers)), zero biases, unit norm weights.
//
// A pipeline stage (StageLayers) holds blocks [begin, end) and: on the first
// stage the embeddings (its forward takes the ids), on the last ln_f and the
// head (its forward returns the logits); a stage in between maps hidden
// states [B, T, C] ([B, T/K, C] under sequence parallelism) to hidden states.
// With a tied head, the last of several stages holds a copy of wte
// (Parameter::tied_copy) initialised like the first stage's; the pipeline
// sums the two gradients after the flush. Under a V (zbv) the last chunk sits
// beside the first on stage 0 and its head uses the first chunk's wte.
#pragma once

#include <memory>
#include <vector>

#include "models/causal_lm.h"
#include "models/registry.h"

namespace tessera::parallel {
class ParallelTransformerBlock;
}

namespace tessera::models {

class Decoder : public CausalLm {
 public:
  Decoder(const nn::ModelConfig& config, const nn::ModelSpec& spec, parallel::TensorParallelism tp,
          const nn::StageLayers& stage = {});
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  void set_recompute(bool recompute) override;
  int64_t vocab_begin() const override { return head_ ? head_->vocab_begin() : wte_->vocab_begin(); }
  nn::Parameter* embedding_table() override;
  nn::Module* embedding() override { return stage_.first() ? wte_ : nullptr; }

 private:
  void initialise();
  Tensor embed(const Tensor& ids, nn::Saved& saved, const nn::Pass& pass);
  parallel::VocabParallelEmbedding* wte_ = nullptr;   // first stage (and a tied head's copy on the last)
  nn::PositionEmbedding* wpe_ = nullptr;              // first stage, learned positions
  parallel::TensorParallelDropout* dropout_ = nullptr;
  std::vector<parallel::ParallelTransformerBlock*> blocks_;
  nn::Module* ln_f_ = nullptr;
  parallel::VocabParallelEmbedding* head_ = nullptr;  // last stage: lm_head, or wte when tied
  bool head_shares_first_chunk_ = false;  // a V's last chunk: head_ is the first chunk's wte on this rank
  std::unique_ptr<parallel::SequenceParallelGradients> partial_;  // wpe and ln_f under sequence parallelism
};

// A decoder's registry row (models/gpt.cpp and models/llama.cpp give theirs
// this row with their kind): building, pipeline layers and their costs.
ModelRow decoder_row(nn::ModelKind kind);
// A decoder's parameter count per block, and on the first and last stages.
nn::LayerCosts decoder_costs(const nn::ModelConfig& m);

}  // namespace tessera::models
