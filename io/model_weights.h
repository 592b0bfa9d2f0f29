// A model's weights into its parameters, whatever layout built the model:
// each rank reads its own tensor-parallel shard of every parameter (the
// element mapping of nn::ParameterShard). Two sources:
//   a checkpoint (io/checkpoint.h, either format, saved under any layout):
//     `tessera generate`, and the model description it needs
//     (checkpoint_model: the model.* metadata `tessera train` stores);
//   a safetensors file (`train --init-from`): what `tessera export` writes,
//     under Tessera's names or Hugging Face GPT-2's (Conv1D matrices
//     transposed back), in any float dtype (F64, F32, BF16, F16; converted
//     to the model's), every value finite.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/checkpoint.h"
#include "nn/models.h"
#include "nn/parameter.h"

namespace tessera::io {

// Where a parameter's values sit in its logical tensor: whole, or this
// rank's tensor-parallel shard of it (name, global shape, dtype and slice;
// `local` left for the caller).
TensorPiece parameter_piece(const nn::Parameter& parameter);

// The model a checkpoint holds (from its model.* metadata) and its dtype.
struct CheckpointModel {
  nn::ModelConfig config;
  DType dtype = DType::f32;
};
// Throws naming the checkpoint and the missing entry (not written by `tessera train`).
CheckpointModel checkpoint_model(const CheckpointReader& reader);

// Every parameter's values (this rank's shard) from the checkpoint; the tied
// copy of an embedding reads the same tensor. Throws naming a missing tensor.
void read_parameters(const CheckpointReader& reader, const std::vector<nn::Parameter*>& parameters);

struct WeightsLoaded {
  std::string naming;  // "tessera" or "hf-gpt2"
  int64_t tensors = 0;
  int64_t ignored = 0;  // tensors of the file the model has no parameter for (e.g. Hugging Face's attn.bias masks)
};
// Every parameter from the safetensors file at `path` (a directory: its
// model.safetensors), by Tessera's names or, when the file holds Hugging
// Face GPT-2's (transformer.wte.weight ...), by those (`num_layers`: the
// model's blocks). Throws naming the file and the tensor when one is
// missing, has another shape, a dtype that is not a float, or a NaN or an
// infinity (after conversion to the parameter's dtype).
WeightsLoaded load_safetensors_weights(const std::string& path, const std::vector<nn::Parameter*>& parameters,
                                       int64_t num_layers);

}  // namespace tessera::io
