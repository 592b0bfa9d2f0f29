// Weights into parameters (io/model_weights.h): from a checkpoint through
// CheckpointReader's slices; from safetensors by intersecting each rank's
// shard (nn::shard_runs) with the runs of the file's tensors that make up the
// parameter and reading just those elements, converted through f32 to the
// parameter's dtype (a transposed GPT-2 matrix is read whole and transposed).
#include "io/model_weights.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "core/context.h"
#include "core/error.h"
#include "core/number_text.h"
#include "core/units.h"
#include "io/export.h"
#include "io/safetensors.h"
#include "io/safetensors_directory.h"
#include "kernels/ops.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;

// A file tensor's elements [tensor_offset, tensor_offset + count) at local
// elements [local_offset, ...) of a parameter's shard: a read, and for
// messages where each local element came from.
struct PlacedRun {
  const SafetensorsDirectory::Located* source = nullptr;
  int64_t tensor_offset = 0, local_offset = 0, count = 0;
};

// The logical elements [first, first + count) of `layout` as runs of its file
// tensors, placed from local element `local_offset` on.
void place_runs(const ParameterInFile& layout, const std::map<std::string, SafetensorsDirectory::Located>& located,
                int64_t first, int64_t count, int64_t local_offset, std::vector<PlacedRun>& placed) {
  int64_t start = 0;
  for (const TensorRun& run : layout.runs) {
    const int64_t begin = std::max(first, start), end = std::min(first + count, start + run.count);
    if (begin < end)
      placed.push_back(
          {&located.at(run.tensor), run.tensor_offset + (begin - start), local_offset + (begin - first), end - begin});
    start += run.count;
  }
}

// Every tensor `layout` needs, found in `weights` and checked: present,
// floating-point, the shape the model needs.
std::map<std::string, SafetensorsDirectory::Located> locate_tensors(const SafetensorsDirectory& weights,
                                                                    const ParameterInFile& layout) {
  std::map<std::string, SafetensorsDirectory::Located> located;
  for (const auto& [name, shape] : layout.tensors) {
    const SafetensorsDirectory::Located found = weights.find(name);
    TESSERA_CHECK(found.entry != nullptr, "--init-from ", weights.describe(), " has no tensor '", name,
                  "' for the model's parameter ", layout.parameter,
                  "; was it saved from a model with these settings (`tessera export`, or save_pretrained of the same "
                  "architecture and config.json)?");
    const SafetensorsEntry& entry = *found.entry;
    TESSERA_CHECK(entry.float64 || is_floating(entry.dtype), "--init-from ", found.file->path(), ": tensor '", name,
                  "' holds ", dtype_name(entry.dtype),
                  ", not floating-point weights; save it as float32, bfloat16 or "
                  "float16");
    TESSERA_CHECK(entry.shape == shape, "--init-from ", found.file->path(), ": tensor '", name, "' is ",
                  entry.shape.to_string(), " but the model's ", layout.parameter, " needs ", shape.to_string(),
                  "; train with the model settings the file was made with (its metadata, or config.json beside it)");
    located[name] = found;
  }
  return located;
}

// The whole logical tensor of a transposed layout (a file matrix [in, out] for a parameter [out, in]) as floats.
std::vector<float> transposed_logical(const SafetensorsDirectory::Located& source, const Shape& logical) {
  const int64_t rows = logical[0], columns = logical[1];  // the parameter's; the file holds [columns, rows]
  std::vector<float> stored(size_t(rows * columns)), out(stored.size());
  source.file->read_floats(*source.entry, 0, rows * columns, stored.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c) out[size_t(r * columns + c)] = stored[size_t(c * rows + r)];
  return out;
}

// This rank's elements of the parameter as floats, read from `located`'s
// files; `placed` says where each came from.
std::vector<float> read_shard_floats(const ParameterInFile& layout,
                                     const std::map<std::string, SafetensorsDirectory::Located>& located,
                                     const nn::Parameter& parameter, std::vector<PlacedRun>& placed) {
  std::vector<float> local(size_t(parameter.value.numel()));
  const std::vector<nn::ShardRun> shard = nn::shard_runs(parameter.shard);
  if (layout.transposed) {
    const SafetensorsDirectory::Located& source = located.at(layout.tensors.front().first);
    const std::vector<float> whole = transposed_logical(source, layout.logical_shape);
    for (const nn::ShardRun& run : shard) {
      std::copy_n(whole.begin() + run.global_offset, run.count, local.begin() + run.local_offset);
      placed.push_back({&source, run.global_offset, run.local_offset, run.count});  // logical element numbers
    }
    return local;
  }
  for (const nn::ShardRun& run : shard)
    place_runs(layout, located, run.global_offset, run.count, run.local_offset, placed);
  for (const PlacedRun& read : placed)
    read.source->file->read_floats(*read.source->entry, read.tensor_offset, read.count,
                                   local.data() + read.local_offset);
  return local;
}

// Throws naming the file tensor and its element when `values` (the shard, as
// the parameter's dtype) holds a NaN or an infinity: found here, not as a NaN
// loss later.
void check_finite(const Tensor& values, const std::vector<PlacedRun>& placed) {
  Tensor single = values;
  if (values.dtype() != DType::f32) {
    single = values.context().empty(values.shape(), DType::f32, Device::cpu());
    ops::cast(values, single);
  }
  const std::vector<float> elements = single.to_vector<float>();
  const auto first = std::find_if(elements.begin(), elements.end(), [](float x) { return !std::isfinite(x); });
  if (first == elements.end()) return;
  const int64_t local = first - elements.begin();
  const auto from = std::find_if(placed.begin(), placed.end(), [&](const PlacedRun& run) {
    return local >= run.local_offset && local < run.local_offset + run.count;
  });
  TESSERA_CHECK(from != placed.end(), "check_finite: local element ", local, " was not read");
  const SafetensorsDirectory::Located& source = *from->source;
  int64_t count = 0;  // of this file tensor's elements in the shard
  for (const PlacedRun& run : placed)
    if (run.source->entry == source.entry)
      count += std::count_if(elements.begin() + run.local_offset, elements.begin() + run.local_offset + run.count,
                             [](float x) { return !std::isfinite(x); });
  TESSERA_THROW("--init-from ", source.file->path(), ": tensor '", source.entry->name, "' holds ", count, " value",
                count == 1 ? "" : "s", " that ", count == 1 ? "is" : "are", " not finite as ",
                dtype_name(values.dtype()), " (element ", from->tensor_offset + (local - from->local_offset), " is ",
                *first,
                "); the weights are damaged (or too large for this --precision); export them again from a good "
                "checkpoint");
}

// This rank's shard of `parameter` from `weights` as `layout` places it.
void read_parameter(const std::map<std::string, SafetensorsDirectory::Located>& located, const ParameterInFile& layout,
                    nn::Parameter& parameter) {
  std::vector<PlacedRun> placed;
  const std::vector<float> floats = read_shard_floats(layout, located, parameter, placed);
  Context& ctx = parameter.value.context();
  Tensor local = ctx.empty(parameter.value.shape(), DType::f32, Device::cpu());
  std::memcpy(local.data_ptr(), floats.data(), floats.size() * sizeof(float));
  if (parameter.value.dtype() != DType::f32) {
    Tensor converted = ctx.empty(local.shape(), parameter.value.dtype(), Device::cpu());
    ops::cast(local, converted);
    local = converted;
  }
  check_finite(local, placed);
  parameter.value.copy_(local);
}

// Each parameter's layout in a file of Tessera's names, or Hugging Face GPT-2's.
std::map<std::string, ParameterInFile> gpt_layouts(const SafetensorsDirectory& weights,
                                                   const std::vector<nn::Parameter*>& parameters, int64_t num_layers,
                                                   std::string& naming) {
  const bool hf =
      weights.find("transformer.wte.weight").entry != nullptr && weights.find("wte.weight").entry == nullptr;
  naming = hf ? "hf-gpt2" : "tessera";
  std::map<std::string, ParameterInFile> layouts;
  std::map<std::string, HfGpt2Name> hf_names;
  if (hf)
    for (const HfGpt2Name& name : hf_gpt2_names(num_layers)) hf_names[name.tessera] = name;
  for (const nn::Parameter* p : parameters) {
    const Shape& shape = p->shard.global_shape;
    const auto renamed = hf_names.find(p->name);
    if (renamed == hf_names.end()) {
      layouts[p->name] = whole_tensor_layout(p->name, shape, p->name);
      continue;
    }
    layouts[p->name] = whole_tensor_layout(p->name, shape, renamed->second.hf);
    if (renamed->second.transposed) {
      layouts[p->name].tensors.front().second = Shape{shape[1], shape[0]};
      layouts[p->name].transposed = true;
    }
  }
  return layouts;
}

}  // namespace

std::string checkpoint_metadata(const CheckpointReader& reader, const std::string& key) {
  const auto found = reader.metadata().find(key);
  TESSERA_CHECK(found != reader.metadata().end(), "checkpoint ", reader.path(), " has no '", key,
                "' entry; it was not written by `tessera train` of this version");
  return found->second;
}

int64_t checkpoint_integer(const CheckpointReader& reader, const std::string& key) {
  const std::string text = checkpoint_metadata(reader, key);
  try {
    size_t used = 0;
    const int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  TESSERA_THROW("checkpoint ", reader.path(), ": entry '", key, "' is '", text, "', not an integer; it is damaged");
}

std::optional<double> checkpoint_real(const CheckpointReader& reader, const std::string& key) {
  const auto found = reader.metadata().find(key);
  if (found == reader.metadata().end()) return std::nullopt;
  try {
    size_t used = 0;
    const double value = std::stod(found->second, &used);
    if (used == found->second.size()) return value;
  } catch (const std::exception&) {
  }
  TESSERA_THROW("checkpoint ", reader.path(), ": entry '", key, "' is '", found->second,
                "', not a number; it is damaged");
}

double checkpoint_dropout(const CheckpointReader& reader, const std::string& flag) {
  return checkpoint_real(reader, "config." + flag).value_or(0.0);
}

TensorPiece parameter_piece(const nn::Parameter& parameter) {
  TensorPiece piece;
  piece.name = parameter.name;
  piece.global_shape = parameter.shard.global_shape;
  piece.dtype = parameter.value.dtype();
  piece.slice = shard_slice(parameter.shard);
  return piece;
}

std::vector<DecoderField> decoder_fields(const nn::ModelConfig& m) {
  nn::ModelConfig before;  // what a checkpoint without the fields was trained with
  before.kind = m.kind;
  before.num_heads = m.num_heads;
  const auto flag = [](bool on) { return std::string(on ? "1" : "0"); };
  const auto fields = [&](const nn::ModelConfig& c) {
    const nn::DecoderChoices d = c.decoder();
    return std::vector<std::array<std::string, 3>>{
        {"model.normalization", std::string(nn::normalization_name(d.normalization)), "--normalization"},
        {"model.position_embedding_type", d.rotary ? "rope" : "learned_absolute", "--position-embedding-type"},
        {"model.swiglu", flag(d.swiglu), "--swiglu"},
        {"model.bias", flag(d.bias), "--disable-bias-linear"},
        {"model.untie_embeddings", flag(d.untie_embeddings), "--untie-embeddings-and-output-weights"},
        {"model.num_query_groups", std::to_string(c.query_groups()), "--num-query-groups"},
        {"model.rotary_base", shortest_text(c.rotary_base), "--rotary-base"},
        {"model.norm_epsilon", shortest_text(c.norm_epsilon), "--norm-epsilon"},
        {"model.num_experts", std::to_string(c.num_experts), "--num-experts"},
        {"model.moe_router_topk", std::to_string(c.moe_router_topk), "--moe-router-topk"},
        {"model.moe_layer_freq", c.moe_layer_freq, "--moe-layer-freq"},
        {"model.moe_ffn_hidden_size", std::to_string(c.num_experts > 0 ? c.moe_ffn() : 0), "--moe-ffn-hidden-size"}};
  };
  const auto now = fields(m), then = fields(before);
  std::vector<DecoderField> out;
  for (size_t i = 0; i < now.size(); ++i) out.push_back({now[i][0], now[i][1], now[i][2], then[i][1]});
  return out;
}

namespace {

// The choices of decoder_fields back from a checkpoint's metadata (a missing
// entry: the value checkpoints held before it was written).
void read_decoder_fields(const CheckpointReader& reader, nn::ModelConfig& c) {
  const auto text = [&](const DecoderField& field) {
    const auto found = reader.metadata().find(field.key);
    return found == reader.metadata().end() ? field.absent : found->second;
  };
  const auto damaged = [&](const DecoderField& field) {
    return "checkpoint " + reader.path() + ": entry '" + field.key + "' is '" + text(field) + "'; it is damaged";
  };
  for (const DecoderField& field : decoder_fields(c)) {
    const std::string value = text(field);
    if (field.key == "model.normalization") {
      TESSERA_CHECK(value == "LayerNorm" || value == "RMSNorm", damaged(field));
      c.normalization = value == "RMSNorm" ? nn::Normalization::rms_norm : nn::Normalization::layer_norm;
    } else if (field.key == "model.position_embedding_type") {
      TESSERA_CHECK(value == "rope" || value == "learned_absolute", damaged(field));
      c.rotary = value == "rope";
    } else if (field.key == "model.moe_layer_freq") {
      c.moe_layer_freq = value;  // validated with the rest of the model
    } else if (field.key == "model.num_query_groups" || field.key == "model.rotary_base" ||
               field.key == "model.norm_epsilon" || field.key == "model.num_experts" ||
               field.key == "model.moe_router_topk" || field.key == "model.moe_ffn_hidden_size") {
      size_t used = 0;
      double number = 0;
      try {
        number = std::stod(value, &used);
      } catch (const std::exception&) {
      }
      TESSERA_CHECK(used == value.size() && used > 0, damaged(field));
      if (field.key == "model.num_query_groups") c.num_query_groups = int64_t(number);
      if (field.key == "model.rotary_base") c.rotary_base = float(number);
      if (field.key == "model.norm_epsilon") c.norm_epsilon = float(number);
      if (field.key == "model.num_experts") c.num_experts = int64_t(number);
      if (field.key == "model.moe_router_topk") c.moe_router_topk = int64_t(number);
      if (field.key == "model.moe_ffn_hidden_size") c.moe_ffn_hidden_size = int64_t(number);
    } else {
      TESSERA_CHECK(value == "0" || value == "1", damaged(field));
      const bool on = value == "1";
      if (field.key == "model.swiglu") c.swiglu = on;
      if (field.key == "model.bias") c.bias = on;
      if (field.key == "model.untie_embeddings") c.untie_embeddings = on;
    }
  }
}

}  // namespace

CheckpointModel checkpoint_model(const CheckpointReader& reader) {
  CheckpointModel model;
  nn::ModelConfig& c = model.config;
  c.kind = nn::parse_model_kind(checkpoint_metadata(reader, "model.kind"));
  model.dtype = parse_dtype(checkpoint_metadata(reader, "model.dtype"));
  if (!nn::model_traits(c.kind).reads_tokens) return model;
  c.vocab_size = checkpoint_integer(reader, "model.vocab_size");
  c.seq_length = checkpoint_integer(reader, "model.seq_length");
  c.num_layers = checkpoint_integer(reader, "model.num_layers");
  c.num_heads = checkpoint_integer(reader, "model.num_heads");
  c.hidden_size = checkpoint_integer(reader, "model.hidden_size");
  c.ffn_hidden_size = checkpoint_integer(reader, "model.ffn_hidden_size");
  read_decoder_fields(reader, c);
  c.validate();
  return model;
}

void read_parameters(const CheckpointReader& reader, const std::vector<nn::Parameter*>& parameters) {
  for (nn::Parameter* p : parameters) {
    TESSERA_CHECK(reader.has_tensor(p->name), "checkpoint ", reader.path(), " has no tensor '", p->name,
                  "' for the model's parameter of that name");
    TensorPiece piece = parameter_piece(*p);
    piece.local = p->value;
    reader.read(piece);
    if (piece.local.data_ptr() != p->value.data_ptr()) p->value.copy_(piece.local);
  }
}

ParameterInFile whole_tensor_layout(const std::string& name, const Shape& shape, const std::string& tensor) {
  return ParameterInFile{name, shape, {{tensor, shape}}, {TensorRun{tensor, 0, shape.numel()}}, false};
}

std::vector<std::vector<std::byte>> split_into_file_tensors(const ParameterInFile& layout, const std::byte* logical,
                                                            size_t element_bytes) {
  TESSERA_CHECK(!layout.transposed, "split_into_file_tensors: ", layout.parameter, " is transposed");
  std::map<std::string, size_t> index;
  std::vector<std::vector<std::byte>> tensors;
  std::vector<int64_t> filled;
  for (const auto& [name, shape] : layout.tensors) {
    index[name] = tensors.size();
    tensors.emplace_back(size_t(shape.numel()) * element_bytes);
    filled.push_back(0);
  }
  int64_t start = 0;
  for (const TensorRun& run : layout.runs) {
    const size_t t = index.at(run.tensor);
    TESSERA_CHECK(run.tensor_offset >= 0 &&
                      (run.tensor_offset + run.count) * int64_t(element_bytes) <= int64_t(tensors[t].size()),
                  "split_into_file_tensors: a run of ", layout.parameter, " lies outside ", run.tensor);
    std::memcpy(tensors[t].data() + size_t(run.tensor_offset) * element_bytes, logical + size_t(start) * element_bytes,
                size_t(run.count) * element_bytes);
    filled[t] += run.count;
    start += run.count;
  }
  TESSERA_CHECK(start == layout.logical_shape.numel(), "split_into_file_tensors: the runs of ", layout.parameter,
                " cover ", start, " of its ", layout.logical_shape.numel(), " elements");
  for (size_t t = 0; t < tensors.size(); ++t)
    TESSERA_CHECK(filled[t] == layout.tensors[t].second.numel(), "split_into_file_tensors: ", layout.tensors[t].first,
                  " gets ", filled[t], " of its ", layout.tensors[t].second.numel(), " elements");
  return tensors;
}

WeightsLoaded load_weights(const SafetensorsDirectory& weights, const std::vector<nn::Parameter*>& parameters,
                           const std::map<std::string, ParameterInFile>& layouts, const std::string& naming) {
  WeightsLoaded loaded{naming, 0, 0};
  std::map<std::string, std::map<std::string, SafetensorsDirectory::Located>> located;  // by parameter, checked first
  std::map<std::string, bool> used;
  for (const nn::Parameter* p : parameters) {
    const auto layout = layouts.find(p->name);
    TESSERA_CHECK(layout != layouts.end(), "--init-from ", weights.describe(), ": the model's parameter ", p->name,
                  " has no counterpart in ", naming, " weights; is the model the one the weights were saved from?");
    TESSERA_CHECK(layout->second.logical_shape == p->shard.global_shape, "--init-from ", weights.describe(),
                  ": the model's ", p->name, " is ", p->shard.global_shape.to_string(), " but the ", naming,
                  " weights make it ", layout->second.logical_shape.to_string(),
                  "; give the model the dimensions of the weights' config.json");
    located[p->name] = locate_tensors(weights, layout->second);
    for (const auto& [name, shape] : layout->second.tensors) used[name] = true;
  }
  for (nn::Parameter* p : parameters) {
    read_parameter(located.at(p->name), layouts.at(p->name), *p);
    ++loaded.tensors;
  }
  for (const std::string& name : weights.names())
    if (!used.count(name)) ++loaded.ignored;
  return loaded;
}

WeightsLoaded load_safetensors_weights(const std::string& path, const std::vector<nn::Parameter*>& parameters,
                                       int64_t num_layers) {
  const SafetensorsDirectory weights(path, "--init-from");
  std::string naming;
  const std::map<std::string, ParameterInFile> layouts = gpt_layouts(weights, parameters, num_layers, naming);
  return load_weights(weights, parameters, layouts, naming);
}

}  // namespace tessera::io
