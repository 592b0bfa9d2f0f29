// The CNN classifier (LeNet-style; nn/models.h describes it) and its registry
// row: one piece, not split into pipeline stages or over tensor parallelism.
#include "core/error.h"
#include "models/registry.h"
#include "nn/layers.h"

namespace tessera::models {
namespace {

std::unique_ptr<nn::Module> build_cnn(const nn::ModelConfig& config, const nn::ModelSpec& spec,
                                      const nn::StageLayers& stage) {
  config.validate();
  TESSERA_CHECK(stage.stages == 1, "--pipeline-parallel ", stage.stages,
                ": --model cnn is not split into pipeline stages; it trains with --pipeline-parallel 1");
  auto model = std::make_unique<nn::Sequential>(spec, "");
  model->add<nn::InputCast>(spec, "input_cast");
  model->add<nn::Conv2d>(spec, "conv1", config.channels, 32, 5, 1, 2).set_input_grad(false);
  model->add<nn::ReLU>(spec, "relu1");
  model->add<nn::MaxPool2d>(spec, "pool1", 2);
  model->add<nn::Conv2d>(spec, "conv2", 32, 64, 5, 1, 2);
  model->add<nn::ReLU>(spec, "relu2");
  model->add<nn::MaxPool2d>(spec, "pool2", 2);
  model->add<nn::Flatten>(spec, "flatten");
  const int64_t features = 64 * (config.height / 2 / 2) * (config.width / 2 / 2);
  model->add<nn::Linear>(spec, "fc1", features, 1024, true, ops::Activation::relu);
  model->add<nn::Linear>(spec, "fc2", 1024, config.num_classes);
  return model;
}

}  // namespace

ModelRow cnn_row() {
  ModelRow row;
  row.kind = nn::ModelKind::cnn;
  row.build = [](const nn::ModelConfig& config, const nn::ModelSpec& spec, const parallel::TensorParallelism&,
                 const nn::StageLayers& layers) { return build_cnn(config, spec, layers); };
  row.pipeline_layers = [](const nn::ModelConfig&) { return int64_t(0); };
  row.layer_costs = [](const nn::ModelConfig&) { return nn::LayerCosts{}; };
  row.stage_input_shape = [](nn::Module&, const nn::ModelConfig& config, const nn::StageLayers&,
                             const Tensor& inputs) {
    return Shape{inputs.size(0), config.channels * config.height * config.width};
  };
  return row;
}

}  // namespace tessera::models
