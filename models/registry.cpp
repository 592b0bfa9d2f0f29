// The registry's table (models/registry.h): one row per model kind, in
// nn::ModelKind's order. A new model adds its row function's declaration and
// its line here.
#include "models/registry.h"

#include <vector>

#include "core/error.h"

namespace tessera::models {

ModelRow mlp_row();  // models/mlp.cpp
ModelRow cnn_row();  // models/cnn.cpp
ModelRow gpt_row();    // models/gpt.cpp
ModelRow llama_row();  // models/llama.cpp

namespace {

std::vector<ModelRow> make_rows() {
  std::vector<ModelRow> rows = {mlp_row(), cnn_row(), gpt_row(), llama_row()};
  for (size_t i = 0; i < rows.size(); ++i)
    TESSERA_CHECK(size_t(rows[i].kind) == i, "model registry: row ", i, " is --model ", nn::model_name(rows[i].kind),
                  "; rows must follow nn::ModelKind's order");
  return rows;
}

}  // namespace

const ModelRow& model_row(nn::ModelKind kind) {
  static const std::vector<ModelRow> rows = make_rows();  // immutable once built
  TESSERA_CHECK(size_t(kind) < rows.size(), "model registry: --model ", nn::model_name(kind), " has no row");
  return rows[size_t(kind)];
}

std::unique_ptr<nn::Module> build_model(const nn::ModelConfig& config, const nn::ModelSpec& spec) {
  return model_row(config.kind).build(config, spec, parallel::TensorParallelism{}, nn::StageLayers{});
}

int64_t pipeline_layers(const nn::ModelConfig& config) {
  return model_row(config.kind).pipeline_layers(config);
}

nn::LayerCosts layer_costs(const nn::ModelConfig& config) {
  return model_row(config.kind).layer_costs(config);
}

}  // namespace tessera::models
