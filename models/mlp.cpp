// The MLP classifier (nn/models.h describes it) and its registry row: a
// Sequential of linear layers with fused ReLUs, cut into pipeline stages by
// layer (a stage holds layers [begin, end), the first the input cast and flatten).
#include <string>

#include "core/error.h"
#include "models/registry.h"
#include "nn/layers.h"

namespace tessera::models {
namespace {

int64_t mlp_layers(const nn::ModelConfig& config) {
  return int64_t(config.hidden.size()) + 1;
}

std::unique_ptr<nn::Module> build_mlp(const nn::ModelConfig& config, const nn::ModelSpec& spec,
                                      const nn::StageLayers& stage) {
  config.validate();
  const int64_t layers = mlp_layers(config), end = stage.end < 0 ? layers : stage.end;
  TESSERA_CHECK(stage.begin >= 0 && stage.begin <= end && end <= layers, "pipeline stage ", stage.stage,
                " of mlp: layers [", stage.begin, ", ", end, ") are not among its ", layers, " layers");
  auto model = std::make_unique<nn::Sequential>(spec, "");
  if (stage.first()) {
    model->add<nn::InputCast>(spec, "input_cast");
    model->add<nn::Flatten>(spec, "flatten");
  }
  int64_t in = config.channels * config.height * config.width;
  for (int64_t index = 0; index < layers; ++index) {
    const bool head = index + 1 == layers;
    const int64_t width = head ? config.num_classes : config.hidden[size_t(index)];
    if (index >= stage.begin && index < end) {
      nn::Linear& layer = model->add<nn::Linear>(spec, "layers." + std::to_string(index), in, width, true,
                                                 head ? ops::Activation::none : ops::Activation::relu);
      if (index == 0) layer.set_input_grad(false);  // the data needs no gradient
    }
    in = width;
  }
  return model;
}

nn::LayerCosts mlp_costs(const nn::ModelConfig& m) {
  nn::LayerCosts costs;
  const int64_t layers = mlp_layers(m);
  int64_t in = m.channels * m.height * m.width;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t out = i + 1 == layers ? m.num_classes : m.hidden[size_t(i)];
    costs.layers.push_back(in * out + out);
    in = out;
  }
  return costs;
}

// A stage's input rows: the flattened features on the first, the previous layer's width after.
Shape mlp_stage_input(nn::Module&, const nn::ModelConfig& config, const nn::StageLayers& layers,
                      const Tensor& inputs) {
  const int64_t begin = layers.begin;
  const int64_t width = begin <= 0 ? config.channels * config.height * config.width : config.hidden[size_t(begin) - 1];
  return Shape{inputs.size(0), width};
}

}  // namespace

ModelRow mlp_row() {
  ModelRow row;
  row.kind = nn::ModelKind::mlp;
  row.build = [](const nn::ModelConfig& config, const nn::ModelSpec& spec, const parallel::TensorParallelism&,
                 const nn::StageLayers& layers) { return build_mlp(config, spec, layers); };
  row.pipeline_layers = mlp_layers;
  row.layer_costs = mlp_costs;
  row.stage_input_shape = mlp_stage_input;
  return row;
}

}  // namespace tessera::models
