// CausalLm's shared part (models/causal_lm.h).
#include "models/causal_lm.h"

#include "core/error.h"

namespace tessera::models {

CausalLm::CausalLm(const nn::ModelConfig& config, const nn::ModelSpec& spec, parallel::TensorParallelism tp,
                   const nn::StageLayers& stage)
    : Module(spec, ""), config_(config), tp_(tp), stage_(stage) {
  config_.validate();
  if (tp_.size() == 1) tp_.sequence_parallel = false;
  const std::string problem = parallel::tensor_parallel_problem(config_, tp_.size(), tp_.sequence_parallel);
  TESSERA_CHECK(problem.empty(), problem);
  if (stage_.end < 0) stage_.end = config_.num_layers;
  TESSERA_CHECK(stage_.begin >= 0 && stage_.begin <= stage_.end && stage_.end <= config_.num_layers,
                nn::model_name(config_.kind), " pipeline stage ", stage_.stage, ": blocks [", stage_.begin, ", ",
                stage_.end, ") are not among its ", config_.num_layers, " blocks");
}

Shape CausalLm::hidden_shape(int64_t batch, int64_t tokens) const {
  return Shape{batch, tp_.sequence_parallel ? tokens / tp_.size() : tokens, config_.hidden_size};
}

Shape causal_lm_stage_input(nn::Module& chunk, const nn::ModelConfig&, const nn::StageLayers&,
                            const Tensor& inputs) {
  return dynamic_cast<CausalLm&>(chunk).hidden_shape(inputs.size(0), inputs.size(1));
}

}  // namespace tessera::models
