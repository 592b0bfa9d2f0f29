// The mixture-of-experts figures of each step (apps/expert_load.h).
#include "apps/expert_load.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "core/error.h"

namespace tessera::app {
namespace {

// The block number of a layer named "blocks.<i>.mlp" (or "<chunk>.blocks.<i>.mlp").
int64_t block_of(const std::string& name) {
  const size_t at = name.rfind("blocks.");
  TESSERA_CHECK(at != std::string::npos, "expert load: layer '", name, "' is not in a block");
  return std::stoll(name.substr(at + 7));
}

}  // namespace

ExpertLoad::ExpertLoad(Context& context, nn::Module& model, parallel::Layout& layout, const nn::ModelConfig& config,
                       bool sequence_parallel, int64_t micro_batches)
    : context_(context),
      layout_(layout),
      layers_(parallel::mixtures_of_experts(model)),
      num_layers_(config.num_layers),
      num_experts_(config.num_experts),
      micro_batches_(std::max<int64_t>(micro_batches, 1)) {
  for (const parallel::MixtureOfExperts* layer : layers_) layer_index_.push_back(block_of(layer->name()));
  const bool first_tp = layout.rank("tp") == 0;
  counts_tokens_ = first_tp || sequence_parallel;       // the tp ranks hold one sequence's tokens, or each a part
  counts_losses_ = first_tp && layout.rank("cp") == 0;  // the losses are the sequence's on each of its ranks
}

void ExpertLoad::on_step_end(io::StepEnd& end) {
  const int64_t row = num_experts_ + 1;  // per layer: tokens per expert, dropped
  std::vector<int64_t> counts(size_t(num_layers_ * row), 0);
  std::vector<float> losses(size_t(2 * num_layers_), 0.0f);  // aux and z per layer, summed over micro-batches
  for (size_t l = 0; l < layers_.size(); ++l) {
    const parallel::MoeStepStats s = layers_[l]->take_step_stats();
    const int64_t block = layer_index_[l];
    if (counts_tokens_) {
      std::copy(s.tokens_per_expert.begin(), s.tokens_per_expert.end(), counts.begin() + block * row);
      counts[size_t(block * row + num_experts_)] = s.dropped;
    }
    if (counts_losses_) {
      losses[size_t(2 * block)] = float(s.aux_loss);
      losses[size_t(2 * block + 1)] = float(s.z_loss);
    }
  }
  parallel::Communicator& world = layout_.world();
  Tensor counted = context_.from_vector(Shape{int64_t(counts.size())}, counts, Device::cpu());
  Tensor summed = context_.from_vector(Shape{int64_t(losses.size())}, losses, Device::cpu());
  world.all_reduce(counted, parallel::ReduceOp::sum)->wait();
  world.all_reduce(summed, parallel::ReduceOp::sum)->wait();
  counts = counted.to_vector<int64_t>();
  losses = summed.to_vector<float>();

  // A layer's losses came from each data rank's micro-batches: their mean.
  const double per_micro_batch = double(parallel::data_group(layout_).size()) * double(micro_batches_);
  double aux = 0.0, z = 0.0, imbalance = 0.0;
  int64_t dropped = 0, kept = 0;
  std::vector<std::pair<std::string, double>>& extra = end.record.extra;
  for (int64_t block = 0; block < num_layers_; ++block) {
    const auto first = counts.begin() + block * row, last = first + num_experts_;
    const int64_t layer_kept = std::accumulate(first, last, int64_t(0));
    const int64_t layer_dropped = counts[size_t(block * row + num_experts_)];
    if (layer_kept + layer_dropped == 0) continue;  // a dense block
    const double mean = double(layer_kept) / double(num_experts_);
    const double most = double(*std::max_element(first, last)), fewest = double(*std::min_element(first, last));
    const std::string prefix = "moe_l" + std::to_string(block) + "_";
    extra.emplace_back(prefix + "tokens_min", fewest);
    extra.emplace_back(prefix + "tokens_max", most);
    extra.emplace_back(prefix + "imbalance", mean > 0 ? most / mean : 0.0);
    imbalance = std::max(imbalance, mean > 0 ? most / mean : 0.0);
    aux += losses[size_t(2 * block)] / per_micro_batch;
    z += losses[size_t(2 * block + 1)] / per_micro_batch;
    dropped += layer_dropped;
    kept += layer_kept;
  }
  extra.emplace_back("moe_aux_loss", aux);
  extra.emplace_back("moe_z_loss", z);
  extra.emplace_back("moe_imbalance", imbalance);
  extra.emplace_back("moe_dropped_fraction", kept + dropped > 0 ? double(dropped) / double(kept + dropped) : 0.0);
}

}  // namespace tessera::app
