// build_stage_model: this rank's part of any model for a layout, built in one
// place from the model's registry row (models/registry.h). Under pipeline
// parallelism the layers of this rank's stage (balanced by parameter count,
// the row's layer_costs, or --pipeline-split); under tensor parallelism split
// over its group (parallel/tensor_parallel.h: the same parameter names and
// values as the whole model); with the loss that goes with it (the
// vocabulary-parallel cross-entropy for a causal LM split over tp or pp).
// With virtual pipeline stages (interleaved 1F1B, causal LMs only) the layers
// are cut into pp·V chunks, this rank holding chunks stage, stage + pp, ...;
// under the V-shaped zbv schedule chunks stage and 2·pp − 1 − stage
// (parallel/pipeline_schedule.h: ChunkMap).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/loss.h"
#include "nn/models.h"
#include "nn/module.h"
#include "models/registry.h"
#include "parallel/layout.h"
#include "parallel/pipeline_schedule.h"

namespace tessera::models {

struct StageModel {
  // This rank's stage (and shard) of the model; under interleaving a module
  // holding the chunks (its parameters are theirs, in chunk order; it is run
  // through the pipeline engine, chunk by chunk, not called itself).
  std::unique_ptr<nn::Module> module;
  std::vector<nn::Module*> chunks;  // this rank's chunks in local order (one: `module` itself)
  std::unique_ptr<nn::Loss> loss;   // used on the last stage
  // pp > 1, first and last stage: this stage's copy of the tied embedding
  // table, whose gradients are summed between the two; null otherwise. Under
  // a V (zbv) stage 0 holds the first and the last chunk: the last chunk's
  // head uses the first's table (no copy), and only stage 0 has one.
  nn::Parameter* tied_table = nullptr;
  // What a stage after the first receives for a micro-batch's inputs (the
  // activation's shape); for the first stage, the shape of its own input rows.
  std::function<Shape(const Tensor& inputs)> input_shape;
  nn::StageLayers layers;  // which layers this stage holds
  // A causal LM's first chunk here (generation, samples, export use it); null for classifiers.
  class CausalLm* causal_lm = nullptr;
  // pp > 1: every chunk's first layer (chunk c of pp·V on stage c mod pp),
  // then the layer count; empty otherwise.
  std::vector<int64_t> bounds;
};

// This rank's stage of `config` on `layout` (its pp rank's layers, split over
// its tp group), parameters on spec.device in spec.dtype. `pipeline_split`:
// --pipeline-split ("" to balance by parameter count; pp·V + 1 boundaries
// under interleaving); `virtual_stages`: --virtual-pipeline-stages V. Throws
// naming the flag when the layout does not fit the model (heads or
// vocabulary not divisible by tp, fewer layers than chunks, a model that
// cannot be split or interleaved).
StageModel build_stage_model(const nn::ModelConfig& config, const nn::ModelSpec& spec, parallel::Layout& layout,
                             bool sequence_parallel, const std::string& pipeline_split, int virtual_stages = 1,
                             parallel::ChunkPlacement placement = parallel::ChunkPlacement::loop);

}  // namespace tessera::models
