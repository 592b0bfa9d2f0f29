// build_stage_model (see stage_model.h): any model's part on this rank, from its registry row.
#include "models/stage_model.h"

#include "core/error.h"
#include "models/causal_lm.h"
#include "models/registry.h"
#include "parallel/pipeline.h"

namespace tessera::models {
namespace {

using parallel::Layout;
using parallel::TensorParallelism;

// Pipeline stage boundaries: --pipeline-split, or balanced by parameter count.
std::vector<int64_t> stage_bounds(const nn::ModelConfig& config, const std::string& pipeline_split, int stages) {
  if (!pipeline_split.empty())
    return parallel::parse_pipeline_split(pipeline_split, pipeline_layers(config), stages);
  const nn::LayerCosts costs = layer_costs(config);
  return parallel::partition_layers(costs.layers, costs.first, costs.last, stages);
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

// The layers of local chunk v: the model's chunk map.model_chunk(stage, v)
// (v·pp + stage, or a V's) of pp·V (all of them for pp = 1).
nn::StageLayers chunk_layers(const StageModel& stage, int v, const parallel::ChunkMap& map, int s) {
  nn::StageLayers layers;
  if (map.stages > 1) {
    layers.stage = map.model_chunk(s, v);
    layers.stages = map.model_chunks();
    layers.begin = stage.bounds[size_t(layers.stage)];
    layers.end = stage.bounds[size_t(layers.stage) + 1];
  }
  return layers;
}

// The loss of the last stage: a causal LM split over tp or pp takes the
// vocabulary-parallel cross-entropy (over the tp group), anything else the plain one.
std::unique_ptr<nn::Loss> stage_loss(const ModelRow& row, const nn::ModelConfig& config, Layout& layout) {
  if (!row.causal_lm || (layout.size("tp") == 1 && layout.size("pp") == 1)) return std::make_unique<nn::CrossEntropyLoss>();
  const int64_t local_vocab = config.vocab_size / layout.size("tp");
  return std::make_unique<parallel::VocabParallelCrossEntropy>(layout.group("tp"), layout.rank("tp") * local_vocab,
                                                               config.vocab_size);
}

void check_layout_fits(const nn::ModelConfig& config, const ModelRow& row, Layout& layout, bool sequence_parallel,
                       int virtual_stages, parallel::ChunkPlacement placement) {
  // What asked for the chunks, as the user wrote it.
  const std::string asked = placement == parallel::ChunkPlacement::v_shape
                                ? "--pipeline-schedule zbv (2 chunks per stage)"
                                : "--virtual-pipeline-stages " + std::to_string(virtual_stages);
  const std::string fewer =
      placement == parallel::ChunkPlacement::v_shape ? "use --pipeline-schedule zb-h1" : "use fewer virtual stages";
  const std::string tp_problem = parallel::tensor_parallel_problem(config, layout.size("tp"), sequence_parallel);
  TESSERA_CHECK(tp_problem.empty(), tp_problem);
  TESSERA_CHECK(layout.group("pp").rank() == layout.rank("pp"), "layout: pipeline rank ", layout.group("pp").rank(), " is not stage ",
                layout.rank("pp"));
  TESSERA_CHECK(virtual_stages >= 1, "--virtual-pipeline-stages must be at least 1, got ", virtual_stages);
  TESSERA_CHECK(virtual_stages == 1 || layout.size("pp") > 1, "--virtual-pipeline-stages ", virtual_stages,
                " splits each pipeline stage into chunks; it needs --pipeline-parallel > 1");
  TESSERA_CHECK(virtual_stages == 1 || row.causal_lm, asked, " splits a language model's Transformer blocks into ",
                "chunks; --model ", nn::model_name(config.kind), " trains with one chunk per stage (",
                placement == parallel::ChunkPlacement::v_shape ? "--pipeline-schedule zb-h1 or 1f1b"
                                                               : "--virtual-pipeline-stages 1",
                ")");
  const int chunks = layout.size("pp") * virtual_stages;
  TESSERA_CHECK(virtual_stages == 1 || pipeline_layers(config) >= chunks, "--pipeline-parallel ", layout.size("pp"),
                " x ", asked, " = ", chunks, " chunks need at least one Transformer block each, the model has ",
                pipeline_layers(config), " (--num-layers); ", fewer, " or more layers");
}

}  // namespace

StageModel build_stage_model(const nn::ModelConfig& config, const nn::ModelSpec& spec, Layout& layout,
                             bool sequence_parallel, const std::string& pipeline_split, int virtual_stages,
                             parallel::ChunkPlacement placement) {
  const ModelRow& row = model_row(config.kind);
  check_layout_fits(config, row, layout, sequence_parallel, virtual_stages, placement);
  const int p = layout.size("pp"), s = layout.rank("pp"), chunks = p * virtual_stages;
  const parallel::ChunkMap map{p, virtual_stages, placement};
  const TensorParallelism tp{&layout.group("tp"), sequence_parallel, &layout.group("cp"), &layout.group("ep")};
  StageModel stage;
  stage.layers.stage = s;
  stage.layers.stages = p;
  if (p > 1) stage.bounds = stage_bounds(config, pipeline_split, chunks);
  std::unique_ptr<StageChunks> holder = virtual_stages > 1 ? std::make_unique<StageChunks>(spec) : nullptr;
  for (int v = 0; v < virtual_stages; ++v) {
    nn::StageLayers layers = chunk_layers(stage, v, map, s);
    // A V's last chunk on the first chunk's stage: its head uses that chunk's table.
    if (v > 0 && stage.causal_lm) layers.shared_embedding = stage.causal_lm->embedding();
    std::unique_ptr<nn::Module> chunk = row.build(config, spec, tp, layers);
    nn::Module* built = chunk.get();
    auto* causal_lm = dynamic_cast<CausalLm*>(built);
    if (p > 1 && causal_lm && (layers.first() || layers.last()) && causal_lm->embedding_table())
      stage.tied_table = causal_lm->embedding_table();
    if (v == 0) {
      stage.causal_lm = causal_lm;
      stage.input_shape = [built, &row, config, layers](const Tensor& inputs) {
        return row.stage_input_shape(*built, config, layers, inputs);
      };
    }
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
  stage.loss = stage_loss(row, config, layout);
  return stage;
}

}  // namespace tessera::models
