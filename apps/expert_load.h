// ExpertLoad: a component of the training loop (io/training_events.h) that
// reports how a mixture-of-experts model routed each step: per layer the
// tokens its experts received (fewest, most, and the imbalance most / mean),
// the share of choices dropped over capacity, and the load-balancing and z
// losses (mean per micro-batch over the data-parallel ranks, summed over the
// layers). One all-reduce of two small buffers over the world per step
// gathers the layers of every pipeline stage; each token counts once (the
// tensor-parallel ranks of one sequence share it unless sequence parallelism
// splits it). The figures go into the step's record ("moe_*"), where the
// metrics file, the progress line and the Prometheus exporter find them.
#pragma once

#include <cstdint>
#include <vector>

#include "core/context.h"
#include "io/training_events.h"
#include "nn/models.h"
#include "parallel/layout.h"
#include "parallel/moe.h"

namespace tessera::app {

class ExpertLoad : public io::TrainingComponent {
 public:
  // `model`: this rank's part of the model (its MoE layers found in it);
  // `micro_batches`: per step on each data-parallel rank.
  ExpertLoad(Context& context, nn::Module& model, parallel::Layout& layout, const nn::ModelConfig& config,
             bool sequence_parallel, int64_t micro_batches);
  void on_step_end(io::StepEnd& end) override;

 private:
  Context& context_;
  parallel::Layout& layout_;
  std::vector<parallel::MixtureOfExperts*> layers_;
  std::vector<int64_t> layer_index_;  // each layer's block number
  int64_t num_layers_, num_experts_, micro_batches_;
  bool counts_tokens_, counts_losses_;  // whether this rank's tokens and losses are counted
};

}  // namespace tessera::app
