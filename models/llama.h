// The Llama family's decoder (Llama 2/3, Mistral, Qwen without biases;
// `--model llama`): token embedding → blocks.<i> (pre-norm: x += attn(RMSNorm(x));
// x += mlp(RMSNorm(x))) → RMSNorm ln_f → LM head of its own (untied; tied
// to the embedding when the config says so). Attention is grouped-query
// (G = --num-query-groups key/value heads shared by H/G query heads each)
// with rotary position embeddings (Hugging Face's half-split pairs, base
// --rotary-base), the MLP SwiGLU (F = --ffn-hidden-size), no biases anywhere;
// the layers are parallel/llama_layers.h's, split over tensor parallelism.
//
// Parameters (logical tensors, as checkpoints store them): wte.weight [V, C],
// blocks.<i>.ln1.weight [C], blocks.<i>.attn.qkv.weight [G·(R+2)·Dh, C] in
// Megatron's grouped layout (per group: R query heads, its key, its value),
// blocks.<i>.attn.proj.weight [C, H·Dh], blocks.<i>.ln2.weight [C],
// blocks.<i>.mlp.fc.weight [2F, C] (gate rows, then up rows),
// blocks.<i>.mlp.proj.weight [C, F], ln_f.weight [C], lm_head.weight [V, C]
// (untied). Initialisation as Megatron's: normal(0, 0.02) for matrices and
// embeddings, the residual projections (attn.proj, mlp.proj) normal(0,
// 0.02/√(2·layers)), norm weights 1.
//
// Pipeline stages, sequence parallelism, the KV cache (G' key/value heads
// per rank cached, not H') and the head work as the GPT's (models/gpt.h).
#pragma once

#include <memory>
#include <vector>

#include "models/causal_lm.h"
#include "models/registry.h"

namespace tessera::models {

class LlamaBlock;

class Llama : public CausalLm {
 public:
  Llama(const nn::ModelConfig& config, const nn::ModelSpec& spec, parallel::TensorParallelism tp,
        const nn::StageLayers& stage = {});
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  void set_recompute(bool recompute) override;
  int64_t vocab_begin() const override { return head_ ? head_->vocab_begin() : wte_->vocab_begin(); }
  nn::Parameter* embedding_table() override;

 private:
  void initialise();
  parallel::VocabParallelEmbedding* wte_ = nullptr;   // first stage (and a tied head's copy on the last)
  parallel::VocabParallelEmbedding* head_ = nullptr;  // last stage: the LM head (the table itself when tied)
  parallel::TensorParallelDropout* dropout_ = nullptr;
  std::vector<LlamaBlock*> blocks_;
  nn::RMSNorm* ln_f_ = nullptr;
  std::unique_ptr<parallel::SequenceParallelGradients> partial_;  // ln_f under sequence parallelism
};

// The Llama's registry row (models/registry.h).
ModelRow llama_row();

}  // namespace tessera::models
