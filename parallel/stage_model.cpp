// build_stage_model (see stage_model.h).
#include "parallel/stage_model.h"

#include "core/error.h"
#include "parallel/pipeline.h"
#include "parallel/tensor_parallel.h"

namespace tessera::parallel {
namespace {

// Pipeline stage boundaries: --pipeline-split, or balanced by parameter count.
std::vector<int64_t> stage_bounds(const nn::ModelConfig& config, const std::string& pipeline_split, int stages) {
  if (!pipeline_split.empty()) return parse_pipeline_split(pipeline_split, nn::pipeline_layers(config), stages);
  const nn::LayerCosts costs = nn::layer_costs(config);
  return partition_layers(costs.layers, costs.first, costs.last, stages);
}

// The chunks of an interleaved stage, owned; its parameters are theirs.
class StageChunks : public nn::Module {
 public:
  explicit StageChunks(const nn::ModelSpec& spec) : Module(spec, "") {}
  nn::Module& add(std::unique_ptr<nn::Module> chunk) { return adopt_child(std::move(chunk)); }
  Tensor forward_impl(const Tensor&, nn::Saved&, const nn::Pass&) override {
    TESSERA_THROW("an interleaved pipeline stage runs its chunks through the PipelineEngine, not as one module");
  }

 protected:
  Tensor backward_impl(const Tensor&, nn::Saved&) override {
    TESSERA_THROW("an interleaved pipeline stage runs its chunks through the PipelineEngine, not as one module");
  }
};

// The GPT's part on this rank: V chunks (one without interleaving), local
// chunk v holding the blocks of the model's chunk v·pp + stage, each split
// over the tensor-parallel group; with the vocabulary-parallel loss when the
// model is split, the plain one otherwise.
StageModel build_gpt_stage(const nn::ModelConfig& config, const nn::ModelSpec& spec, ProcessGrid& grid,
                           bool sequence_parallel, const std::string& pipeline_split, int virtual_stages) {
  const int p = grid.pp_size(), s = grid.pp_rank(), chunks = p * virtual_stages;
  TESSERA_CHECK(virtual_stages == 1 || config.num_layers >= chunks, "--pipeline-parallel ", p,
                " x --virtual-pipeline-stages ", virtual_stages, " = ", chunks,
                " chunks need at least one Transformer block each, the model has ", config.num_layers,
                " (--num-layers); use fewer virtual stages or more layers");
  StageModel stage;
  stage.layers.stage = s;
  stage.layers.stages = p;
  if (p > 1) stage.bounds = stage_bounds(config, pipeline_split, chunks);
  std::unique_ptr<StageChunks> holder = virtual_stages > 1 ? std::make_unique<StageChunks>(spec) : nullptr;
  for (int v = 0; v < virtual_stages; ++v) {
    nn::StageLayers layers;
    if (p > 1) {
      layers.stage = v * p + s;
      layers.stages = chunks;
      layers.begin = stage.bounds[size_t(layers.stage)];
      layers.end = stage.bounds[size_t(layers.stage) + 1];
    }
    auto chunk =
        std::make_unique<TensorParallelGpt>(config, spec, TensorParallelism{&grid.tp(), sequence_parallel}, layers);
    TensorParallelGpt* gpt = chunk.get();
    if (p > 1 && (layers.first() || layers.last())) stage.tied_table = gpt->embedding_table();
    if (v == 0) stage.input_shape = [gpt](const Tensor& ids) { return gpt->hidden_shape(ids.size(0), ids.size(1)); };
    if (holder) {
      stage.chunks.push_back(&holder->add(std::move(chunk)));
    } else {
      stage.layers.begin = layers.begin;
      stage.layers.end = layers.end;
      stage.module = std::move(chunk);
      stage.chunks = {stage.module.get()};
    }
  }
  if (holder) stage.module = std::move(holder);
  const int64_t local_vocab = config.vocab_size / grid.tp_size();
  if (grid.tp_size() > 1 || p > 1)
    stage.loss =
        std::make_unique<VocabParallelCrossEntropy>(grid.tp(), grid.tp_rank() * local_vocab, config.vocab_size);
  else
    stage.loss = std::make_unique<nn::CrossEntropyLoss>();
  return stage;
}

}  // namespace

std::unique_ptr<nn::Module> build_model(const nn::ModelConfig& config, const nn::ModelSpec& spec) {
  if (config.kind == nn::ModelKind::gpt) return std::make_unique<TensorParallelGpt>(config, spec, TensorParallelism{});
  return nn::build_model(config, spec);
}

StageModel build_stage_model(const nn::ModelConfig& config, const nn::ModelSpec& spec, ProcessGrid& grid,
                             bool sequence_parallel, const std::string& pipeline_split, int virtual_stages) {
  const std::string tp_problem = tensor_parallel_problem(config, grid.tp_size(), sequence_parallel);
  TESSERA_CHECK(tp_problem.empty(), tp_problem);
  TESSERA_CHECK(grid.pp().rank() == grid.pp_rank(), "process grid: pipeline rank ", grid.pp().rank(), " is not stage ",
                grid.pp_rank());
  TESSERA_CHECK(virtual_stages >= 1, "--virtual-pipeline-stages must be at least 1, got ", virtual_stages);
  TESSERA_CHECK(virtual_stages == 1 || grid.pp_size() > 1, "--virtual-pipeline-stages ", virtual_stages,
                " splits each pipeline stage into chunks; it needs --pipeline-parallel > 1");
  TESSERA_CHECK(virtual_stages == 1 || config.kind == nn::ModelKind::gpt, "--virtual-pipeline-stages ", virtual_stages,
                " interleaves the GPT's Transformer blocks; --model ", nn::model_name(config.kind),
                " trains with --virtual-pipeline-stages 1");
  if (config.kind == nn::ModelKind::gpt)
    return build_gpt_stage(config, spec, grid, sequence_parallel, pipeline_split, virtual_stages);
  StageModel stage;
  stage.layers.stage = grid.pp_rank();
  stage.layers.stages = grid.pp_size();
  if (grid.pp_size() > 1) {
    stage.bounds = stage_bounds(config, pipeline_split, grid.pp_size());
    stage.layers.begin = stage.bounds[size_t(stage.layers.stage)];
    stage.layers.end = stage.bounds[size_t(stage.layers.stage) + 1];
  }
  stage.module = nn::build_model(config, spec, stage.layers);
  stage.loss = std::make_unique<nn::CrossEntropyLoss>();
  const int64_t begin = stage.layers.begin;
  const int64_t width =
      begin == 0 ? config.channels * config.height * config.width : (begin > 0 ? config.hidden[size_t(begin) - 1] : 0);
  stage.input_shape = [width](const Tensor& inputs) { return Shape{inputs.size(0), width}; };
  stage.chunks = {stage.module.get()};
  return stage;
}

}  // namespace tessera::parallel
