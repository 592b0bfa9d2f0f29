// The model registry: one row per model kind (--model), saying everything the
// rest of the house asks of a model, so that adding one is its file under
// models/ (the class and its row function) and one line in registry.cpp's
// table, plus its name in nn/model_kind (the command line's list of kinds and
// their traits, which the CLI checks without building layers).
//
// A row: how to build a pipeline chunk of the model split over a
// tensor-parallel group; how many partitionable layers it has and what each
// costs (pipeline balancing); what the stages after the first receive; and
// which loss trains it. models/stage_model.h builds a rank's part of any
// model from its row; models/generation.h runs any CausalLm.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "nn/loss.h"
#include "nn/models.h"
#include "nn/module.h"
#include "parallel/tensor_parallel.h"

namespace tessera::models {

struct ModelRow {
  nn::ModelKind kind = nn::ModelKind::mlp;
  // Chunk `layers` of the model (StageLayers{}: the whole model) on spec's
  // device and dtype, split over `tp` (size 1 for models that do not split;
  // parallel::tensor_parallel_problem has refused the others before).
  std::function<std::unique_ptr<nn::Module>(const nn::ModelConfig&, const nn::ModelSpec&,
                                            const parallel::TensorParallelism&, const nn::StageLayers&)>
      build;
  // Its partitionable layers (0: the model is not split into stages).
  std::function<int64_t(const nn::ModelConfig&)> pipeline_layers;
  // What each partitionable layer and the first/last stage's extras cost.
  std::function<nn::LayerCosts(const nn::ModelConfig&)> layer_costs;
  // What chunk `layers` (built as `chunk`) receives for a micro-batch whose
  // first-stage inputs are `inputs`: the shape of its input activations.
  std::function<Shape(nn::Module& chunk, const nn::ModelConfig&, const nn::StageLayers&, const Tensor& inputs)>
      stage_input_shape;
  // Causal LMs (CausalLm) train with the vocabulary-parallel cross-entropy,
  // can be interleaved (--virtual-pipeline-stages) and generate text.
  bool causal_lm = false;
};

// The row of `kind`.
const ModelRow& model_row(nn::ModelKind kind);

// The whole model on one process, parameters on spec.device in spec.dtype
// (the model every layout's names and initial values come from).
std::unique_ptr<nn::Module> build_model(const nn::ModelConfig& config, const nn::ModelSpec& spec);

// The number of partitionable layers, and their costs (model_row's).
int64_t pipeline_layers(const nn::ModelConfig& config);
nn::LayerCosts layer_costs(const nn::ModelConfig& config);

}  // namespace tessera::models
