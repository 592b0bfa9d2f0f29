// A model's weights into its parameters, whatever layout built the model:
// each rank reads its own tensor-parallel shard of every parameter (the
// element mapping of nn::ParameterShard). Two sources:
//   a checkpoint (io/checkpoint.h, either format, saved under any layout):
//     `tessera generate`, and the model description it needs
//     (checkpoint_model: the model.* metadata `tessera train` stores);
//   safetensors (`train --init-from`): a file or a Hugging Face model
//     directory (io/safetensors_directory.h, sharded or not): what `tessera
//     export` writes, under Tessera's names or Hugging Face GPT-2's (Conv1D
//     matrices transposed back) or Llama's (io/hf_llama.h), in any float
//     dtype (F64, F32, BF16, F16; converted to the model's), every value
//     finite. A parameter may be made of several of the file's tensors
//     (ParameterInFile); each rank reads only the elements of its shard, at
//     their offsets in the files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "io/checkpoint.h"
#include "nn/models.h"
#include "nn/parameter.h"

namespace tessera::io {

class SafetensorsDirectory;

// Where a parameter's logical tensor (its global shape, row-major) lies in a
// file: consecutive runs of the file's tensors, in logical order, covering it
// exactly. A tensor taken whole is one run; Llama's qkv.weight is 3·G runs
// (q heads of a group from q_proj, its k head from k_proj, its v head from
// v_proj; io/hf_llama.h).
struct TensorRun {
  std::string tensor;         // the file's tensor
  int64_t tensor_offset = 0;  // the run's first element in that tensor (row-major)
  int64_t count = 0;          // elements
};
struct ParameterInFile {
  std::string parameter;  // Tessera's name
  Shape logical_shape;    // the parameter's global shape
  // The file's tensors it is made of, in the file's order, and the shape each must have.
  std::vector<std::pair<std::string, Shape>> tensors;
  std::vector<TensorRun> runs;  // in logical order
  // One 2-D tensor holding the logical matrix transposed (GPT-2's Conv1D): `runs` unused.
  bool transposed = false;
};
// The parameter as one file tensor of the same name and shape (Tessera's naming).
ParameterInFile whole_tensor_layout(const std::string& name, const Shape& shape, const std::string& tensor);

// The file's tensors of `layout` from the logical tensor's bytes (`element_bytes`
// each, row-major): the inverse of reading, what an export writes. Throws when
// the runs do not cover the tensors exactly.
std::vector<std::vector<std::byte>> split_into_file_tensors(const ParameterInFile& layout, const std::byte* logical,
                                                            size_t element_bytes);

// Where a parameter's values sit in its logical tensor: whole, or this
// rank's tensor-parallel shard of it (name, global shape, dtype and slice;
// `local` left for the caller).
TensorPiece parameter_piece(const nn::Parameter& parameter);

// A checkpoint's metadata entry `key`, and the same as an integer; throws
// naming the checkpoint and the entry when it is missing (not written by
// `tessera train` of this version) or not an integer.
std::string checkpoint_metadata(const CheckpointReader& reader, const std::string& key);
int64_t checkpoint_integer(const CheckpointReader& reader, const std::string& key);
// A checkpoint's metadata entry `key` as a number; nothing when the entry is
// missing, and a throw naming the checkpoint and the entry when it is not a number.
std::optional<double> checkpoint_real(const CheckpointReader& reader, const std::string& key);
// The dropout probability a training flag recorded in the checkpoint's
// settings ("hidden-dropout" reads config.hidden-dropout); 0 when the
// checkpoint predates the flag.
double checkpoint_dropout(const CheckpointReader& reader, const std::string& flag);

// A language model's architectural choices as checkpoint metadata (beyond its
// sizes): key "model.<field>", the value as built, the flag that sets it, and
// the value a checkpoint written before the field existed holds (the kind's
// default then).
struct DecoderField {
  std::string key, value, flag, absent;
};
std::vector<DecoderField> decoder_fields(const nn::ModelConfig& m);

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
  std::string naming;  // "tessera", "hf-gpt2" or "hf-llama"
  int64_t tensors = 0;
  int64_t ignored = 0;  // tensors of the file the model has no parameter for (e.g. Hugging Face's attn.bias masks)
};
// Every parameter from the safetensors file or model directory at `path`
// (its model.safetensors, or its shards and index), by Tessera's names or,
// when the file holds Hugging Face GPT-2's (transformer.wte.weight ...), by
// those (`num_layers`: the model's blocks). Throws naming the file and the
// tensor when one is missing, has another shape, a dtype that is not a
// float, or a NaN or an infinity (after conversion to the parameter's dtype).
WeightsLoaded load_safetensors_weights(const std::string& path, const std::vector<nn::Parameter*>& parameters,
                                       int64_t num_layers);

// Every parameter from `weights` as `layouts` (by parameter name) place it:
// first every tensor each needs is checked (present, floating-point, the
// shape it must have), then each parameter's shard is read (only its
// elements), converted to the parameter's dtype and checked finite. A tied
// copy reads what its name reads. `naming` is reported back.
WeightsLoaded load_weights(const SafetensorsDirectory& weights, const std::vector<nn::Parameter*>& parameters,
                           const std::map<std::string, ParameterInFile>& layouts, const std::string& naming);

}  // namespace tessera::io
