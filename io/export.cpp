// export_checkpoint (io/export.h): whole parameters read from a checkpoint,
// renamed and transposed for Hugging Face GPT-2 where asked, written as
// safetensors, and GPT-2's config.json (through nlohmann::json) and tokenizer files.
#include "io/export.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/model_weights.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;

bool is_optimizer_state(const std::string& name) {
  for (const char* suffix : {".exp_avg", ".exp_avg_sq", ".momentum_buffer", ".master"}) {
    const size_t length = std::strlen(suffix);
    if (name.size() > length && name.compare(name.size() - length, length, suffix) == 0) return true;
  }
  return false;
}

// A whole stored tensor's bytes.
std::vector<std::byte> read_whole(Context& ctx, const CheckpointReader& reader, const StoredTensor& stored) {
  TensorPiece piece;
  piece.name = stored.name;
  piece.global_shape = stored.shape;
  piece.dtype = stored.dtype;
  piece.local = ctx.empty(stored.shape, stored.dtype, Device::cpu());
  reader.read(piece);
  const auto* begin = static_cast<const std::byte*>(piece.local.data_ptr());
  return std::vector<std::byte>(begin, begin + piece.local.nbytes());
}

// [rows, columns] → [columns, rows], elements of `size` bytes.
std::vector<std::byte> transposed(const std::vector<std::byte>& bytes, int64_t rows, int64_t columns, size_t size) {
  std::vector<std::byte> out(bytes.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c)
      std::memcpy(out.data() + size_t(c * rows + r) * size, bytes.data() + size_t(r * columns + c) * size, size);
  return out;
}

const std::string& metadata_value(const CheckpointReader& reader, const std::string& key) {
  const auto found = reader.metadata().find(key);
  TESSERA_CHECK(found != reader.metadata().end(), "export: checkpoint ", reader.path(), " has no '", key,
                "' entry; it was not written by `tessera train`");
  return found->second;
}

const char* torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    default:
      return "float32";
  }
}

struct Prepared {
  std::vector<std::string> names;
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;
  std::vector<std::vector<std::byte>> data;

  void add(std::string name, DType dtype, Shape shape, std::vector<std::byte> bytes) {
    names.push_back(std::move(name));
    dtypes.push_back(dtype);
    shapes.push_back(std::move(shape));
    data.push_back(std::move(bytes));
  }
  ExportResult write(const std::string& out, const std::map<std::string, std::string>& metadata) const {
    std::vector<SafetensorsInput> inputs;
    ExportResult result;
    for (size_t i = 0; i < names.size(); ++i) {
      inputs.push_back({names[i], dtypes[i], shapes[i], data[i].data()});
      result.bytes += int64_t(data[i].size());
    }
    write_safetensors(out, inputs, metadata);
    result.weights = out;
    result.tensors = int64_t(names.size());
    return result;
  }
};

// The GPT's config.json for transformers' GPT2LMHeadModel.
nlohmann::json hf_gpt2_config(const CheckpointReader& reader, DType dtype) {
  const nn::ModelConfig model = checkpoint_model(reader).config;
  const auto dropout = reader.metadata().find("config.hidden-dropout");
  const double p = dropout == reader.metadata().end() ? 0.0 : std::stod(dropout->second);
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", model.vocab_size},
          {"n_positions", model.seq_length},
          {"n_ctx", model.seq_length},
          {"n_embd", model.hidden_size},
          {"n_layer", model.num_layers},
          {"n_head", model.num_heads},
          {"n_inner", model.ffn()},
          {"activation_function", "gelu_new"},
          {"layer_norm_epsilon", 1e-5},
          {"resid_pdrop", p},
          {"embd_pdrop", p},
          {"attn_pdrop", 0.0},
          {"initializer_range", 0.02},
          {"tie_word_embeddings", true},
          {"torch_dtype", torch_dtype(dtype)}};
}

// GPT-2's vocab.json and merges.txt beside the weights, from the dataset's
// tokenizer (bytes when it stores none and the vocabulary is 256).
void write_tokenizer(const CheckpointReader& reader, const std::string& tokenizer_data, const fs::path& directory,
                     ExportResult& result) {
  std::string data = tokenizer_data;
  if (data.empty()) {
    const auto trained_on = reader.metadata().find("config.data");
    if (trained_on != reader.metadata().end()) data = trained_on->second;
  }
  std::error_code error;
  if (data.empty() || !fs::exists(data, error)) {
    result.tokenizer_note = "no tokenizer written: the checkpoint's training data " +
                            (data.empty() ? std::string("is not named (--synthetic?)") : data + " is not here") +
                            "; give --tokenizer DATASET.h5";
    return;
  }
  const std::optional<Tokenizer> tokenizer =
      Tokenizer::for_model_data(data, checkpoint_model(reader).config.vocab_size);
  if (!tokenizer) {
    result.tokenizer_note = "no tokenizer written: " + data + " stores none (its tokens came from another tool)";
    return;
  }
  result.vocab = (directory / "vocab.json").string();
  result.merges = (directory / "merges.txt").string();
  tokenizer->write_gpt2_files(result.vocab, result.merges);
}

}  // namespace

std::vector<HfGpt2Name> hf_gpt2_names(int64_t num_layers) {
  std::vector<HfGpt2Name> names = {{"wte.weight", "transformer.wte.weight", false},
                                   {"wpe.weight", "transformer.wpe.weight", false}};
  for (int64_t i = 0; i < num_layers; ++i) {
    const std::string t = "blocks." + std::to_string(i) + ".", h = "transformer.h." + std::to_string(i) + ".";
    for (const auto& [ours, theirs, matrix] :
         {std::tuple{"ln1", "ln_1", false}, std::tuple{"attn.qkv", "attn.c_attn", true},
          std::tuple{"attn.proj", "attn.c_proj", true}, std::tuple{"ln2", "ln_2", false},
          std::tuple{"mlp.fc", "mlp.c_fc", true}, std::tuple{"mlp.proj", "mlp.c_proj", true}}) {
      names.push_back({t + ours + ".weight", h + theirs + ".weight", matrix});
      names.push_back({t + ours + ".bias", h + theirs + ".bias", false});
    }
  }
  names.push_back({"ln_f.weight", "transformer.ln_f.weight", false});
  names.push_back({"ln_f.bias", "transformer.ln_f.bias", false});
  return names;
}

ExportResult export_checkpoint(const std::string& checkpoint, const std::string& out, const std::string& format,
                               const std::string& tokenizer_data) {
  TESSERA_CHECK(format == "tessera" || format == "hf-gpt2", "export: --format ", format,
                " is not one of tessera, hf-gpt2");
  const CheckpointReader reader(checkpoint);
  std::error_code made;
  fs::create_directories(fs::absolute(out).parent_path(), made);  // as save_pretrained(DIR) does; errors: at the write
  Context ctx;
  Prepared prepared;
  // Nothing of the checkpoint's path or step: the same weights export to the same bytes.
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const std::string& kind = metadata_value(reader, "model.kind");
  if (format == "tessera") {
    for (const auto& [key, value] : reader.metadata())
      if (key.rfind("model.", 0) == 0) metadata["tessera." + key] = value;
    for (const StoredTensor& stored : reader.tensors())
      if (!is_optimizer_state(stored.name))
        prepared.add(stored.name, stored.dtype, stored.shape, read_whole(ctx, reader, stored));
    return prepared.write(out, metadata);
  }
  TESSERA_CHECK(kind == "gpt", "export --format hf-gpt2: checkpoint ", reader.path(), " holds a ", kind, " (--model ",
                kind, "), not a GPT; export it with --format tessera");
  DType dtype = DType::f32;
  for (const HfGpt2Name& name : hf_gpt2_names(checkpoint_model(reader).config.num_layers)) {
    const auto stored = std::find_if(reader.tensors().begin(), reader.tensors().end(),
                                     [&](const StoredTensor& t) { return t.name == name.tessera; });
    TESSERA_CHECK(stored != reader.tensors().end(), "export --format hf-gpt2: checkpoint ", reader.path(),
                  " has no tensor ", name.tessera, "; it is not a GPT of this version");
    std::vector<std::byte> bytes = read_whole(ctx, reader, *stored);
    Shape shape = stored->shape;
    if (name.transposed) {
      bytes = transposed(bytes, shape[0], shape[1], dtype_size(stored->dtype));
      shape = Shape{shape[1], shape[0]};
    }
    dtype = stored->dtype;
    prepared.add(name.hf, stored->dtype, shape, std::move(bytes));
  }
  ExportResult result = prepared.write(out, metadata);
  const fs::path directory = fs::absolute(out).parent_path();
  result.config = (directory / "config.json").string();
  std::ofstream config(result.config);
  config << hf_gpt2_config(reader, dtype).dump(2) << "\n";
  TESSERA_CHECK(config, "export: cannot write ", result.config);
  write_tokenizer(reader, tokenizer_data, directory, result);
  return result;
}

}  // namespace tessera::io
