// CausalLm: what a decoder-only language model split over a tensor-parallel
// group and cut into pipeline stages offers the rest of the house. The
// pipeline, generation (models/generation.h), samples during training and
// export use a model through this interface only, so a new causal LM (GPT,
// Llama, a mixture of experts) is a class deriving from it, its file and its
// registry row (models/registry.h), and nothing else changes.
//
// Contract of every CausalLm (the GPT's and the Llama's):
//   forward(ids [B, T]) on the first stage; hidden states [B, T, C] (or
//   [B, T/K, C] under sequence parallelism, hidden_shape) between stages; on
//   the last stage this rank's logits [B, T, V/K], columns [vocab_begin,
//   vocab_begin + V/K) of the vocabulary, trained with
//   parallel::VocabParallelCrossEntropy. With Pass::kv_cache set (a whole
//   model, pp = 1), forward appends the tokens to the cache and attends over
//   everything cached (generation); each attention layer keeps its own
//   key/value heads there (the GPT's heads, the Llama's query groups).
#pragma once

#include <cstdint>

#include "nn/models.h"
#include "nn/module.h"
#include "parallel/tensor_parallel.h"

namespace tessera::models {

class CausalLm : public nn::Module {
 public:
  CausalLm(const nn::ModelConfig& config, const nn::ModelSpec& spec, parallel::TensorParallelism tp,
           const nn::StageLayers& stage);

  const nn::ModelConfig& config() const { return config_; }
  const parallel::TensorParallelism& parallelism() const { return tp_; }
  const nn::StageLayers& stage() const { return stage_; }
  // The first vocabulary id of this rank's logits columns.
  virtual int64_t vocab_begin() const = 0;
  // The embedding table the LM head shares on this stage (the first stage's,
  // or the last stage's tied copy), null when untied or on stages in between:
  // the pipeline sums the two copies' gradients.
  virtual nn::Parameter* embedding_table() = 0;
  // The token embedding module this chunk holds (the first's), null elsewhere.
  virtual nn::Module* embedding() = 0;
  virtual void set_recompute(bool recompute) = 0;
  // The hidden states between stages for `batch` sequences of `tokens`.
  Shape hidden_shape(int64_t batch, int64_t tokens) const;

 protected:
  // The LM head on the last stage: `x` [B, T, C] after the final norm (this
  // rank's positions under sequence parallelism) → this rank's logits
  // [B, T, V/K] = x·tableᵀ with `table`'s vocabulary rows (a tied embedding
  // or the head's own), keeping what head_backward needs in `saved`.
  Tensor head_forward(Tensor x, int64_t batch, int64_t tokens, parallel::VocabParallelEmbedding& table,
                      nn::Saved& saved);
  // The logits' gradient → the table's gradient (added) and x's, summed over
  // the group (reduce-scattered under sequence parallelism).
  Tensor head_backward(const Tensor& grad_logits, parallel::VocabParallelEmbedding& table, nn::Saved& saved);

  nn::ModelConfig config_;
  parallel::TensorParallelism tp_;
  nn::StageLayers stage_;
};

// The hidden states a causal LM's chunk receives (its registry row's
// stage_input_shape): chunk.hidden_shape for the inputs' [B, T].
Shape causal_lm_stage_input(nn::Module& chunk, const nn::ModelConfig& config, const nn::StageLayers& layers,
                            const Tensor& inputs);

}  // namespace tessera::models
