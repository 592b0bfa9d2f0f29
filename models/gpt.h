// The GPT (GPT-2's architecture; nn/models.h describes its layers and
// initialisation): split over a tensor-parallel group, or whole with no group
// (TensorParallelism{}: no communication, the model every layout's names and
// initial values come from, element for element). A CausalLm
// (models/causal_lm.h): forward(ids [B, T]) returns this rank's logits
// [B, T, V/K]; train it with parallel::VocabParallelCrossEntropy (with no
// group, nn::CrossEntropyLoss is the same).
//
// A pipeline stage (StageLayers) holds blocks [begin, end) and: on the first
// stage the embeddings (its forward takes the ids), on the last ln_f and the
// LM head (its forward returns the logits); a stage in between maps hidden
// states [B, T, C] ([B, T/K, C] under sequence parallelism) to hidden states,
// and its backward returns their gradient. The last stage of several holds a
// tied copy of wte (Parameter::tied_copy) for the head, initialised like the
// first stage's; the pipeline sums the two gradients after the flush.
#pragma once

#include <memory>
#include <vector>

#include "models/causal_lm.h"
#include "models/registry.h"

namespace tessera::models {

class Gpt : public CausalLm {
 public:
  Gpt(const nn::ModelConfig& config, const nn::ModelSpec& spec, parallel::TensorParallelism tp,
      const nn::StageLayers& stage = {});
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  void set_recompute(bool recompute) override;
  int64_t vocab_begin() const override { return wte_->vocab_begin(); }
  nn::Parameter* embedding_table() override { return wte_ ? &wte_->weight() : nullptr; }

 private:
  void initialise();
  parallel::VocabParallelEmbedding* wte_ = nullptr;
  nn::PositionEmbedding* wpe_ = nullptr;
  parallel::TensorParallelDropout* dropout_ = nullptr;
  std::vector<parallel::ParallelTransformerBlock*> blocks_;
  nn::LayerNorm* ln_f_ = nullptr;
  std::unique_ptr<parallel::SequenceParallelGradients> partial_;  // wpe and ln_f under sequence parallelism
};

// The GPT's registry row (models/registry.h).
ModelRow gpt_row();

}  // namespace tessera::models
