// CausalLm's shared part (models/causal_lm.h).
#include "models/causal_lm.h"

#include <optional>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"

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

Tensor CausalLm::head_forward(Tensor x, int64_t batch, int64_t tokens, parallel::VocabParallelEmbedding& table,
                              nn::Saved& saved) {
  const int64_t c = config_.hidden_size, local_vocab = table.weight().value.size(0);
  if (tp_.sequence_parallel) x = parallel::gather_sequence_in(tp_, x);
  const Tensor features = x.view(Shape{batch * tokens, c});
  Tensor logits = context().empty(Shape{batch * tokens, local_vocab}, spec().dtype, spec().device);
  ops::MatmulOptions options;
  options.transpose_b = true;
  {
    const nn::ParametersInUse in_use(table, nn::ParameterPhase::forward);  // the head outside the table's own calls
    ops::matmul(features, table.weight().value, logits, options);
  }
  saved.tensors = {features};
  saved.scalars = {batch, tokens};
  return logits.view(Shape{batch, tokens, local_vocab});
}

Tensor CausalLm::head_backward(const Tensor& grad_logits, parallel::VocabParallelEmbedding& table, nn::Saved& saved) {
  const std::string_view model = nn::model_name(config_.kind);
  TESSERA_CHECK(saved.tensors.size() == 1 && saved.scalars.size() == 2, model, ": backward without a matching forward");
  const Tensor features = saved.tensors[0];
  const int64_t batch = saved.scalars[0], tokens = saved.scalars[1];
  saved.tensors.clear();
  saved.scalars.clear();
  nn::Parameter& weight = table.weight();
  const int64_t rows = batch * tokens, c = config_.hidden_size, local_vocab = weight.value.size(0);
  TESSERA_CHECK(grad_logits.numel() == rows * local_vocab, model, ": the logits gradient has shape ",
                grad_logits.shape().to_string(), ", expected ", rows, " rows of ", local_vocab);
  const Tensor dlogits = grad_logits.view(Shape{rows, local_vocab});
  Tensor grad = context().empty(features.shape(), spec().dtype, spec().device);
  {
    // The head uses the table outside the table's own calls: held for both
    // gradients, or, in a backward in two halves, for each half.
    const bool halves = defers_weight_gradients();
    const nn::ParametersInUse in_use(table, halves ? nn::ParameterPhase::input_gradient : nn::ParameterPhase::backward);
    add_weight_gradients([&table, dlogits, features, halves] {
      std::optional<nn::ParametersInUse> held;
      if (halves) held.emplace(table, nn::ParameterPhase::weight_gradient);
      nn::Parameter& w = table.weight();
      ops::matmul_backward(dlogits, features, w.value, nullptr, &w.grad, false, true, /*accumulate=*/true);
    });
    ops::matmul_backward(dlogits, features, weight.value, &grad, nullptr, false, true, /*accumulate=*/false);
  }
  grad = grad.view(Shape{batch, tokens, c});
  // The features were the same on every rank: sum the ranks' parts of their gradient.
  if (tp_.sequence_parallel) return parallel::reduce_scatter_sequence_in(tp_, grad);
  parallel::all_reduce_in(tp_, grad);
  return grad;
}

Shape causal_lm_stage_input(nn::Module& chunk, const nn::ModelConfig&, const nn::StageLayers&,
                            const Tensor& inputs) {
  return dynamic_cast<CausalLm&>(chunk).hidden_shape(inputs.size(0), inputs.size(1));
}

}  // namespace tessera::models
