// Weights into parameters (io/model_weights.h): from a checkpoint through
// CheckpointReader's slices; from safetensors by cutting each rank's shard
// out of the whole tensor on the host (nn::shard_runs) after renaming,
// transposing and converting what the file holds.
#include "io/model_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "core/context.h"
#include "core/error.h"
#include "core/units.h"
#include "io/export.h"
#include "io/safetensors.h"
#include "kernels/ops.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;

std::string metadata_entry(const CheckpointReader& reader, const std::string& key) {
  const auto found = reader.metadata().find(key);
  TESSERA_CHECK(found != reader.metadata().end(), "checkpoint ", reader.path(), " has no '", key,
                "' entry; it was not written by `tessera train` of this version");
  return found->second;
}

int64_t metadata_integer(const CheckpointReader& reader, const std::string& key) {
  const std::string text = metadata_entry(reader, key);
  try {
    size_t used = 0;
    const int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  TESSERA_THROW("checkpoint ", reader.path(), ": entry '", key, "' is '", text, "', not an integer; it is damaged");
}

// A host tensor of `dtype` and `shape` holding `bytes`.
Tensor host_tensor(Context& ctx, DType dtype, const Shape& shape, const std::vector<std::byte>& bytes) {
  Tensor t = ctx.empty(shape, dtype, Device::cpu());
  TESSERA_CHECK(size_t(t.nbytes()) == bytes.size(), "host_tensor: ", bytes.size(), " bytes for ", shape.to_string());
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

// [rows, columns] → [columns, rows] on the host.
Tensor transposed(const Tensor& matrix) {
  const int64_t rows = matrix.size(0), columns = matrix.size(1);
  const size_t size = dtype_size(matrix.dtype());
  Tensor out = matrix.context().empty(Shape{columns, rows}, matrix.dtype(), Device::cpu());
  const auto* from = static_cast<const std::byte*>(matrix.data_ptr());
  auto* to = static_cast<std::byte*>(out.data_ptr());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c)
      std::memcpy(to + (c * rows + r) * size, from + (r * columns + c) * size, size);
  return out;
}

// This rank's shard of the whole host tensor `whole` (already the parameter's dtype), copied into the parameter.
void copy_shard(const Tensor& whole, nn::Parameter& parameter) {
  const nn::ParameterShard& shard = parameter.shard;
  if (!shard.split) {
    parameter.value.copy_(whole.view(parameter.value.shape()));
    return;
  }
  Tensor local = whole.context().empty(parameter.value.shape(), whole.dtype(), Device::cpu());
  const size_t size = dtype_size(whole.dtype());
  const auto* from = static_cast<const std::byte*>(whole.data_ptr());
  auto* to = static_cast<std::byte*>(local.data_ptr());
  for (const nn::ShardRun& run : nn::shard_runs(shard))
    std::memcpy(to + run.local_offset * size, from + run.global_offset * size, size_t(run.count) * size);
  parameter.value.copy_(local);
}

// The names the file uses for each of the model's parameters.
struct FileNames {
  std::string naming;
  std::map<std::string, HfGpt2Name> by_parameter;  // parameter name → file name and orientation
};

FileNames file_names(const SafetensorsFile& file, const std::vector<nn::Parameter*>& parameters, int64_t num_layers) {
  FileNames names;
  const bool hf = file.find("transformer.wte.weight") != nullptr && file.find("wte.weight") == nullptr;
  names.naming = hf ? "hf-gpt2" : "tessera";
  if (hf)
    for (const HfGpt2Name& name : hf_gpt2_names(num_layers)) names.by_parameter[name.tessera] = name;
  for (const nn::Parameter* p : parameters)
    if (!names.by_parameter.count(p->name)) names.by_parameter[p->name] = HfGpt2Name{p->name, p->name, false};
  return names;
}

// Throws naming the tensor when `values` (a host tensor of the parameter's
// dtype) holds a NaN or an infinity: found here, not as a NaN loss later.
void check_finite(const SafetensorsFile& file, const std::string& name, const Tensor& values) {
  Tensor single = values;
  if (values.dtype() != DType::f32) {
    single = values.context().empty(values.shape(), DType::f32, Device::cpu());
    ops::cast(values, single);
  }
  const std::vector<float> elements = single.to_vector<float>();
  const auto first = std::find_if(elements.begin(), elements.end(), [](float x) { return !std::isfinite(x); });
  if (first == elements.end()) return;
  const auto count = std::count_if(first, elements.end(), [](float x) { return !std::isfinite(x); });
  TESSERA_THROW("--init-from ", file.path(), ": tensor '", name, "' holds ", count, " value", count == 1 ? "" : "s",
                " that ", count == 1 ? "is" : "are", " not finite as ", dtype_name(values.dtype()), " (element ",
                first - elements.begin(), " is ", *first,
                "); the weights are damaged (or too large for this --precision); export them again from a good "
                "checkpoint");
}

// The file's tensor for `parameter`, as the parameter's global shape and dtype, on the host.
Tensor whole_tensor(const SafetensorsFile& file, const HfGpt2Name& name, const nn::Parameter& parameter) {
  const SafetensorsEntry* entry = file.find(name.hf);
  TESSERA_CHECK(entry != nullptr, "--init-from ", file.path(), " has no tensor '", name.hf, "' for the parameter ",
                parameter.name, "; was it exported from a model with these settings (`tessera export`)?");
  TESSERA_CHECK(is_floating(entry->dtype), "--init-from ", file.path(), ": tensor '", name.hf, "' holds ",
                dtype_name(entry->dtype), ", not floating-point weights");
  const Shape& want = parameter.shard.global_shape;
  const Shape stored = name.transposed ? Shape{want[1], want[0]} : want;
  TESSERA_CHECK(entry->shape == stored, "--init-from ", file.path(), ": tensor '", name.hf, "' is ",
                entry->shape.to_string(), " but the model's ", parameter.name, " needs ", stored.to_string(),
                "; train with the model settings the file was made with (its metadata, or config.json beside it)");
  Context& ctx = parameter.value.context();
  Tensor t = host_tensor(ctx, entry->dtype, entry->shape, file.read_values(*entry));
  if (name.transposed) t = transposed(t);
  if (t.dtype() != parameter.value.dtype()) {
    Tensor converted = ctx.empty(t.shape(), parameter.value.dtype(), Device::cpu());
    ops::cast(t, converted);
    t = converted;
  }
  check_finite(file, name.hf, t);
  return t;
}

// `path`, or the model.safetensors of a directory (as Hugging Face's from_pretrained(DIR) reads).
std::string weights_file(const std::string& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return path;
  const fs::path inside = fs::path(path) / "model.safetensors";
  if (fs::exists(inside, error)) return inside.string();
  std::vector<std::string> found;
  for (fs::directory_iterator it(path, error), end; !error && it != end; it.increment(error))
    if (it->path().extension() == ".safetensors") found.push_back(it->path().string());
  TESSERA_THROW("--init-from ", path, " is a directory without a model.safetensors; name the safetensors file",
                found.empty() ? std::string(" (tessera export -o FILE writes one)") : ": " + human_list(found, "or"));
}

}  // namespace

TensorPiece parameter_piece(const nn::Parameter& parameter) {
  TensorPiece piece;
  piece.name = parameter.name;
  piece.global_shape = parameter.shard.global_shape;
  piece.dtype = parameter.value.dtype();
  piece.slice = shard_slice(parameter.shard);
  return piece;
}

CheckpointModel checkpoint_model(const CheckpointReader& reader) {
  CheckpointModel model;
  nn::ModelConfig& c = model.config;
  c.kind = nn::parse_model_kind(metadata_entry(reader, "model.kind"));
  model.dtype = parse_dtype(metadata_entry(reader, "model.dtype"));
  if (!nn::model_traits(c.kind).reads_tokens) return model;
  c.vocab_size = metadata_integer(reader, "model.vocab_size");
  c.seq_length = metadata_integer(reader, "model.seq_length");
  c.num_layers = metadata_integer(reader, "model.num_layers");
  c.num_heads = metadata_integer(reader, "model.num_heads");
  c.hidden_size = metadata_integer(reader, "model.hidden_size");
  c.ffn_hidden_size = metadata_integer(reader, "model.ffn_hidden_size");
  if (c.kind == nn::ModelKind::llama) {
    c.num_query_groups = metadata_integer(reader, "model.num_query_groups");
    c.rotary_base = std::stof(metadata_entry(reader, "model.rotary_base"));
    c.norm_epsilon = std::stof(metadata_entry(reader, "model.norm_epsilon"));
    c.untie_embeddings = metadata_integer(reader, "model.untie_embeddings") != 0;
  }
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

WeightsLoaded load_safetensors_weights(const std::string& path, const std::vector<nn::Parameter*>& parameters,
                                       int64_t num_layers) {
  const SafetensorsFile file(weights_file(path));
  const FileNames names = file_names(file, parameters, num_layers);
  WeightsLoaded loaded{names.naming, 0, 0};
  std::map<std::string, bool> used;
  for (nn::Parameter* p : parameters) {
    const HfGpt2Name& name = names.by_parameter.at(p->name);
    copy_shard(whole_tensor(file, name, *p), *p);
    used[name.hf] = true;
    ++loaded.tensors;
  }
  for (const SafetensorsEntry& entry : file.tensors())
    if (!used.count(entry.name)) ++loaded.ignored;
  return loaded;
}

}  // namespace tessera::io
