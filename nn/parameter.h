// Parameter: one trainable tensor of a model, known by its global name
// ("blocks.3.attn.qkv.weight"): names are what checkpoints store and what
// initialisation, weight-decay rules and (later) tensor-parallel slicing key on.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tessera::nn {

// Which part of a logical ("global") tensor a rank holds. The global tensor,
// viewed row-major as `view` (empty: the global shape itself), is cut along
// `dim`, and this rank holds the indices [begin, begin + length) of that
// dimension and everything along the others:
//   whole (tp = 1, or replicated):  split = false
//   column-parallel weight [out, in]: dim 0      row-parallel weight [out, in]: dim 1
//   fused QKV weight [3·C, C] split by heads: view [3, H, Dh·C], dim 1
// Initialisation, checkpoints and gradient-norm counting read this: a shard
// draws exactly its elements of the global tensor, checkpoints store the
// global tensor, and split parameters' squares are summed over the group.
struct ParameterShard {
  Shape global_shape;
  bool split = false;
  Shape view;  // empty: global_shape
  int dim = 0;
  int64_t begin = 0, length = 0;
  // The layout axes (parallel::Layout) whose ranks hold different parts:
  // {"tp"} for a tensor-parallel layer's split weight; empty when whole.
  std::vector<std::string> axes{};

  const Shape& cut_shape() const { return view.ndim() > 0 ? view : global_shape; }
  // The local tensor's number of elements.
  int64_t local_numel() const;
};

// A run of consecutive elements of the shard in both flattenings: local
// elements [local_offset, local_offset + count) are global elements
// [global_offset, global_offset + count).
struct ShardRun {
  int64_t global_offset = 0, local_offset = 0, count = 0;
};
std::vector<ShardRun> shard_runs(const ParameterShard& shard);

struct Parameter {
  std::string name;          // global, dot-separated, unique within a model
  Tensor value;              // in the model's compute dtype (f32, bf16 or f16), on the model's device
  Tensor grad;               // always f32, same shape: the "main" gradient that micro-batches accumulate into
  bool weight_decay = true;  // false for biases and normalisation weights (AdamW/SGD skip decay)
  ParameterShard shard;      // the whole tensor unless a tensor-parallel layer says otherwise
  // The layout axes whose ranks hold replicas of this parameter (the same
  // part of it, fed different data): its gradient is averaged over their
  // group (parallel::gradient_group). Data, context and expert parallelism
  // by default (the ep ranks read different samples); an expert, held by
  // one rank of the ep group, names dp and cp only.
  std::vector<std::string> gradient_axes{"dp", "cp", "ep"};
  // A copy of a parameter another pipeline stage owns (the LM head's tied
  // embedding on the last stage): kept equal by summing the two gradients,
  // updated identically, and neither counted in the gradient norm nor
  // written to checkpoints by this copy.
  bool tied_copy = false;
  // Called when a backward pass has finished adding into `grad` (by the
  // module that owns the parameter, after its backward); empty by default.
  std::function<void(Parameter&)> on_grad_ready;
};

// A stable 64-bit hash of a parameter's name (FNV-1a), used as its random
// stream: initial values are a function of (seed, name, element index) only,
// so any layout or shard draws the same numbers for the same element.
uint64_t name_stream(const std::string& name);

// Initial values of a shard: element g of the global tensor gets the value
// drawn at counter index g of stream name_stream(name), so every layout holds
// the same numbers for the same element.
void init_shard_normal(Parameter& p, uint64_t seed, float mean, float stddev);
void init_shard_uniform(Parameter& p, uint64_t seed, float low, float high);

// Zeroes every parameter's gradient (start of an optimizer step).
void zero_grads(const std::vector<Parameter*>& parameters);

}  // namespace tessera::nn
