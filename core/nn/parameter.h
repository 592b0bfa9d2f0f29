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

struct Parameter {
  std::string name;  // global, dot-separated, unique within a model
  Tensor value;      // in the model's compute dtype (f32, bf16 or f16), on the model's device
  Tensor grad;       // always f32, same shape: the "main" gradient that micro-batches accumulate into
  bool weight_decay = true;  // false for biases and normalisation weights (AdamW/SGD skip decay)
  // Called when a backward pass has finished adding into `grad` (by the
  // module that owns the parameter, after its backward); empty by default.
  std::function<void(Parameter&)> on_grad_ready;
};

// A stable 64-bit hash of a parameter's name (FNV-1a), used as its random
// stream: initial values are a function of (seed, name, element index) only,
// so any layout or shard draws the same numbers for the same element.
uint64_t name_stream(const std::string& name);

// Zeroes every parameter's gradient (start of an optimizer step).
void zero_grads(const std::vector<Parameter*>& parameters);

}  // namespace tessera::nn
