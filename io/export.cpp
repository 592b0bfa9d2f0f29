// export_checkpoint (io/export.h): whole parameters read from a checkpoint,
// renamed and transposed for Hugging Face GPT-2 where asked, written as
// safetensors (a directory sharded above --max-shard-size), and GPT-2's
// config.json (through nlohmann::json) and tokenizer files; Llama's through
// io/hf_llama.h. Where it writes is planned and checked first (not into the
// checkpoint, nothing replaced unasked, a place that can be written), and
// what it made is removed again when a write fails.
#include "io/export.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "core/context.h"
#include "core/error.h"
#include "core/units.h"
#include "io/checkpoint.h"
#include "io/hf_llama.h"
#include "io/model_weights.h"
#include "io/safetensors.h"
#include "io/safetensors_directory.h"
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
  std::vector<SafetensorsInput> inputs() const {
    std::vector<SafetensorsInput> out;
    for (size_t i = 0; i < names.size(); ++i) out.push_back({names[i], dtypes[i], shapes[i], data[i].data()});
    return out;
  }
};

// The formats written by io/hf_llama.h: Llama, and Mixtral (a Llama with experts in every block).
bool llama_family(const std::string& format) {
  return format == "hf-llama" || format == "hf-mixtral";
}

// Why the model cannot be written as `format` (hf-gpt2: GPT2LMHeadModel,
// hf-llama: LlamaForCausalLM, hf-mixtral: MixtralForCausalLM), naming the
// switch that differs and the format it fits; empty when it can. Which
// --model trained it does not matter.
std::string hugging_face_problem(const nn::ModelConfig& m, const std::string& format) {
  const nn::DecoderChoices d = m.decoder();
  if (!nn::model_traits(m.kind).reads_tokens)
    return std::string("a ") + std::string(nn::model_name(m.kind)) + " (--model " + std::string(nn::model_name(m.kind)) +
           "), not a language model; export it with --format tessera";
  const bool llama = d.normalization == nn::Normalization::rms_norm && d.rotary && d.swiglu && !d.bias;
  const bool gpt2 = d.normalization == nn::Normalization::layer_norm && !d.rotary && !d.swiglu && d.bias &&
                    !d.untie_embeddings && m.query_groups() == m.num_heads;
  const bool experts = m.num_experts > 0, every_block = m.moe_layer_freq == "1";
  const std::string elsewhere = llama && experts && every_block ? "export it with --format hf-mixtral"
                                : llama && !experts              ? "export it with --format hf-llama"
                                : gpt2 && !experts               ? "export it with --format hf-gpt2"
                                                                 : "export it with --format tessera";
  std::string differs;
  const auto note = [&](bool bad, const std::string& what) {
    if (bad) differs += (differs.empty() ? "" : ", ") + what;
  };
  if (format == "hf-gpt2") {
    note(d.normalization != nn::Normalization::layer_norm, "RMSNorm (--normalization RMSNorm)");
    note(d.rotary, "rotary embeddings (--position-embedding-type rope)");
    note(d.swiglu, "a SwiGLU MLP (--swiglu)");
    note(!d.bias, "no biases (--disable-bias-linear)");
    note(d.untie_embeddings, "an LM head of its own (--untie-embeddings-and-output-weights)");
    note(m.query_groups() != m.num_heads, "grouped-query attention (--num-query-groups)");
    note(experts, "experts (--num-experts)");
    return differs.empty() ? "" : "a model with " + differs + ", which GPT2LMHeadModel does not have; " + elsewhere;
  }
  const bool mixtral = format == "hf-mixtral";
  note(!mixtral && experts, "experts (--num-experts)");
  note(mixtral && !experts, "dense MLPs (no --num-experts)");
  note(mixtral && experts && !every_block, "experts only in some blocks (--moe-layer-freq " + m.moe_layer_freq + ")");
  note(d.normalization != nn::Normalization::rms_norm, "LayerNorm (--normalization LayerNorm)");
  note(!d.rotary, "learned positions (--position-embedding-type learned_absolute)");
  note(!d.swiglu, "a GELU MLP (no --swiglu)");
  note(d.bias, "biases (no --disable-bias-linear)");
  return differs.empty() ? ""
                         : "a model with " + differs + ", which " +
                               (mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM") + " does not have; " + elsewhere;
}

// The GPT's config.json for transformers' GPT2LMHeadModel.
nlohmann::json hf_gpt2_config(const CheckpointReader& reader, DType dtype) {
  const nn::ModelConfig model = checkpoint_model(reader).config;
  const double p = checkpoint_dropout(reader, "hidden-dropout");
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
          {"layer_norm_epsilon", double(model.norm_epsilon)},
          {"resid_pdrop", p},
          {"embd_pdrop", p},
          {"attn_pdrop", checkpoint_dropout(reader, "attention-dropout")},
          {"initializer_range", 0.02},
          {"tie_word_embeddings", true},
          {"torch_dtype", torch_dtype_name(dtype)}};
}

// The tokenizer to write beside hf-gpt2 weights, found before anything is
// written: --tokenizer's dataset (refused when it holds none), else the
// training data's (config.data; when it is not here or stores none, nothing
// and a note saying why).
struct TokenizerToWrite {
  std::optional<Tokenizer> tokenizer;
  std::string note;
};
TokenizerToWrite tokenizer_to_write(const CheckpointReader& reader, const std::string& tokenizer_data) {
  const int64_t vocab_size = checkpoint_integer(reader, "model.vocab_size");
  if (!tokenizer_data.empty()) return {Tokenizer::of_dataset(tokenizer_data, vocab_size, "export: --tokenizer"), ""};
  const auto trained_on = reader.metadata().find("config.data");
  const std::string data = trained_on == reader.metadata().end() ? "" : trained_on->second;
  std::error_code error;
  if (data.empty() || !fs::exists(data, error))
    return {std::nullopt, "no tokenizer written: the checkpoint's training data " +
                              (data.empty() ? std::string("is not named (--synthetic?)") : data + " is not here") +
                              "; give --tokenizer DATASET.h5"};
  std::optional<Tokenizer> tokenizer = Tokenizer::for_model_data(data, vocab_size);
  if (!tokenizer)
    return {std::nullopt, "no tokenizer written: " + data + " stores none (its tokens came from another tool)"};
  return {std::move(tokenizer), ""};
}

// `path` absolute and lexically normal, without a trailing separator.
fs::path absolute_normal(const fs::path& path) {
  std::error_code error;
  fs::path out = fs::absolute(path, error).lexically_normal();
  if (out.filename().empty() && out.has_relative_path()) out = out.parent_path();
  return out;
}

// The same with symbolic links resolved as far as the path exists.
fs::path normalized(const fs::path& path) {
  std::error_code error;
  return fs::weakly_canonical(absolute_normal(path), error);
}

// Whether `path` is `extent` or lies inside it (the same file under another name too).
bool lies_inside(const fs::path& path, const fs::path& extent) {
  std::error_code error;
  if (fs::exists(path, error) && fs::equivalent(path, extent, error)) return true;
  const fs::path inner = normalized(path), outer = normalized(extent);
  return std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end()).first == outer.end();
}

// What reading the checkpoint reads: its directory (the index and every rank's
// file of format 2, or a step directory given), else its one file.
fs::path checkpoint_extent(const CheckpointReader& reader, const std::string& given) {
  std::error_code error;
  const bool directory = reader.format() >= 2 || fs::is_directory(given, error);
  return directory ? fs::path(reader.path()).parent_path() : fs::path(reader.path());
}

// Where an export writes: the weights, and for the Hugging Face formats
// config.json (and the tokenizer's files) in `directory` beside them.
struct OutputPlan {
  fs::path directory;            // the output's directory (created if missing)
  fs::path weights;              // the safetensors file (-o DIR: the first of `weight_files`)
  std::vector<fs::path> files;   // every file written, the weights first (shards, then their index)
  bool whole_directory = false;  // hf, -o DIR: the directory is the output
};

// What an export of `format` writes: `weight_files` (the names plan_shards
// gives, and the index when sharded) for -o DIR, else the one file -o names.
OutputPlan plan_output(const std::string& out, const std::string& format, bool tokenizer,
                       const std::vector<std::string>& weight_files) {
  OutputPlan plan;
  const fs::path path(out);
  const bool hugging_face = format != "tessera";
  plan.whole_directory = hugging_face && path.extension() != ".safetensors";
  TESSERA_CHECK(plan.whole_directory || !llama_family(format), "export --format ", format, ": -o ", out, " names a file; ",
                format, " writes a directory (model.safetensors, or shards above --max-shard-size, "
                "with config.json and the tokenizer): name the directory");
  plan.weights = plan.whole_directory ? path / weight_files.front() : path;
  plan.directory = plan.weights.parent_path().empty() ? fs::path(".") : plan.weights.parent_path();
  plan.files = {plan.weights};
  if (plan.whole_directory)
    for (size_t i = 1; i < weight_files.size(); ++i) plan.files.push_back(plan.directory / weight_files[i]);
  if (!hugging_face) return plan;
  plan.files.push_back(plan.directory / "config.json");
  if (tokenizer) {
    plan.files.push_back(plan.directory / "vocab.json");
    plan.files.push_back(plan.directory / "merges.txt");
    if (llama_family(format)) plan.files.push_back(plan.directory / "tokenizer_config.json");
  }
  return plan;
}

// The stored tensor `name`; throws naming the checkpoint and the format when it is missing.
const StoredTensor& stored_tensor(const CheckpointReader& reader, const std::string& name, const std::string& format) {
  const auto stored = std::find_if(reader.tensors().begin(), reader.tensors().end(),
                                   [&](const StoredTensor& t) { return t.name == name; });
  TESSERA_CHECK(stored != reader.tensors().end(), "export --format ", format, ": checkpoint ", reader.path(),
                " has no tensor ", name, "; it is not a ", llama_family(format) ? "Llama" : "GPT", " of this version");
  return *stored;
}

// The byte sizes of the Hugging Face tensors an export writes, in the order it writes them.
std::vector<int64_t> hf_tensor_bytes(const CheckpointReader& reader, const std::string& format) {
  std::vector<int64_t> bytes;
  if (format == "hf-gpt2")
    for (const HfGpt2Name& name : hf_gpt2_names(checkpoint_model(reader).config.num_layers)) {
      const StoredTensor& stored = stored_tensor(reader, name.tessera, format);
      bytes.push_back(stored.shape.numel() * int64_t(dtype_size(stored.dtype)));
    }
  else
    for (const ParameterInFile& layout : hf_llama_layouts(hf_llama_config_of(reader))) {
      const DType dtype = stored_tensor(reader, layout.parameter, format).dtype;
      for (const auto& [name, shape] : layout.tensors) bytes.push_back(shape.numel() * int64_t(dtype_size(dtype)));
    }
  return bytes;
}

// The weight files of an export: save_pretrained's for the Hugging Face formats (shards and index above the limit).
std::vector<std::string> weight_files(const CheckpointReader& reader, const std::string& format,
                                      int64_t max_shard_bytes) {
  if (format == "tessera") return {kSafetensorsWeightsName};
  const ShardPlan shards = plan_shards(hf_tensor_bytes(reader, format), max_shard_bytes);
  std::vector<std::string> files = shards.files;
  if (shards.sharded()) files.push_back(kSafetensorsIndexName);
  return files;
}

// The nearest of `path` and its parents that exists.
fs::path nearest_existing(fs::path path) {
  std::error_code error;
  path = absolute_normal(path);
  while (!fs::exists(path, error) && path.has_relative_path()) path = path.parent_path();
  return path;
}

// Refuses an output file that is, or lies inside, the checkpoint being read.
void check_not_the_checkpoint(const OutputPlan& plan, const std::string& out, const fs::path& extent) {
  for (const fs::path& file : plan.files)
    TESSERA_CHECK(!lies_inside(file, extent), "export: -o ", out, " would write ", file.string(),
                  ", which is or lies inside the checkpoint being read (", extent.string(),
                  "); name an output outside it");
}

// Refuses (unless `force`) to write into a non-empty output directory, or
// over files beside a FILE.safetensors that were not asked for.
void check_nothing_replaced(const OutputPlan& plan, const std::string& out, bool force) {
  std::error_code error;
  std::vector<std::string> names, existing;
  for (const fs::path& file : plan.files) {
    names.push_back(file.filename().string());
    if (file != plan.weights && fs::exists(file, error)) existing.push_back(file.string());
  }
  if (plan.whole_directory && fs::exists(plan.directory, error)) {
    TESSERA_CHECK(fs::is_directory(plan.directory, error), "export: -o ", out,
                  " exists and is not a directory; for a Hugging Face format -o names the directory to write ",
                  human_list(names), " into (or a new FILE.safetensors)");
    TESSERA_CHECK(force || fs::is_empty(plan.directory, error), "export: -o ", out,
                  " is a directory that is not empty; name a new or empty one, or add --force to write ",
                  human_list(names), " into it");
  }
  TESSERA_CHECK(force || existing.empty(), "export: -o ", out, " would replace ", human_list(existing),
                " beside it (not asked for); export into a new directory (-o DIR), or add --force to replace ",
                existing.size() == 1 ? "it" : "them");
}

// Refuses an output under a file, a file to write that is a directory, or a
// place where this process cannot create files.
void check_writable(const OutputPlan& plan, const std::string& out) {
  std::error_code error;
  for (const fs::path& file : plan.files)
    TESSERA_CHECK(!fs::is_directory(file, error), "export: ", file.string(), " is a directory; -o names ",
                  plan.whole_directory ? "the directory to write the files into" : "the safetensors file to write");
  const fs::path ancestor = nearest_existing(plan.directory);
  TESSERA_CHECK(fs::is_directory(ancestor, error), "export: -o ", out, ": ", ancestor.string(),
                " is a file, not a directory, so nothing can be made under it; name another output");
  TESSERA_CHECK(::access(ancestor.c_str(), W_OK | X_OK) == 0, "export: -o ", out, ": cannot write in ",
                ancestor.string(), ": ", std::strerror(errno), "; name an output in a directory you can write");
}

// What an export made (directories and files that were not there), removed
// again unless the export completes: a refusal or a failed write leaves nothing.
class MadeByExport {
 public:
  MadeByExport() = default;
  MadeByExport(const MadeByExport&) = delete;
  MadeByExport& operator=(const MadeByExport&) = delete;
  ~MadeByExport() {
    std::error_code ignored;
    if (!kept_)
      for (auto made = made_.rbegin(); made != made_.rend(); ++made) fs::remove(*made, ignored);
  }
  // Creates `directory` and the parents it lacks, each noted.
  void create_directories(const fs::path& directory) {
    std::error_code error;
    const fs::path target = absolute_normal(directory);
    const fs::path base = nearest_existing(target);
    if (base == target) return;
    fs::path made = base;
    for (const fs::path& part : target.lexically_relative(base)) {
      made /= part;
      const bool created = fs::create_directory(made, error);
      TESSERA_CHECK(!error, "export: cannot create ", made.string(), ": ", error.message());
      if (created) made_.push_back(made);
    }
  }
  // Notes `file` as made here when it does not exist yet (before writing it).
  void about_to_write(const fs::path& file) {
    std::error_code error;
    if (!fs::exists(file, error)) made_.push_back(file);
  }
  void keep() { kept_ = true; }

 private:
  std::vector<fs::path> made_;
  bool kept_ = false;
};

// With --force into a directory that holds an earlier save: its weight files
// this export does not write (model.safetensors, model-*-of-*.safetensors,
// the index) removed, so that from_pretrained cannot read them instead.
void remove_earlier_weights(const OutputPlan& plan) {
  std::error_code error;
  std::vector<fs::path> earlier;
  for (fs::directory_iterator it(plan.directory, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    const bool weights = name == kSafetensorsWeightsName || name == kSafetensorsIndexName ||
                         (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
                          it->path().extension() == ".safetensors");
    if (weights && std::find(plan.files.begin(), plan.files.end(), plan.directory / name) == plan.files.end())
      earlier.push_back(it->path());
  }
  for (const fs::path& file : earlier) {
    fs::remove(file, error);
    TESSERA_CHECK(!error, "export: cannot remove ", file.string(), " (weights of an earlier save that ",
                  "from_pretrained would read instead): ", error.message());
  }
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  TESSERA_CHECK(out, "export: cannot write ", path.string(), ": ", std::strerror(errno));
}

// Every parameter (no optimizer state) under Tessera's names.
Prepared prepare_tessera(const CheckpointReader& reader) {
  Context ctx;
  Prepared prepared;
  for (const StoredTensor& stored : reader.tensors())
    if (!is_optimizer_state(stored.name))
      prepared.add(stored.name, stored.dtype, stored.shape, read_whole(ctx, reader, stored));
  return prepared;
}

// The GPT's parameters under Hugging Face GPT-2's names, matrices transposed; `dtype`: theirs.
Prepared prepare_hf_gpt2(const CheckpointReader& reader, DType& dtype) {
  Context ctx;
  Prepared prepared;
  for (const HfGpt2Name& name : hf_gpt2_names(checkpoint_model(reader).config.num_layers)) {
    const StoredTensor& stored = stored_tensor(reader, name.tessera, "hf-gpt2");
    std::vector<std::byte> bytes = read_whole(ctx, reader, stored);
    Shape shape = stored.shape;
    if (name.transposed) {
      bytes = transposed(bytes, shape[0], shape[1], dtype_size(stored.dtype));
      shape = Shape{shape[1], shape[0]};
    }
    dtype = stored.dtype;
    prepared.add(name.hf, stored.dtype, shape, std::move(bytes));
  }
  return prepared;
}

// The Llama's parameters whole, under Tessera's names and logical shapes (io/hf_llama.h renames and splits them).
Prepared prepare_llama(const CheckpointReader& reader, const HfLlamaConfig& config) {
  Context ctx;
  Prepared prepared;
  for (const ParameterInFile& layout : hf_llama_layouts(config)) {
    const StoredTensor& stored = stored_tensor(reader, layout.parameter, "hf-llama");
    prepared.add(stored.name, stored.dtype, stored.shape, read_whole(ctx, reader, stored));
  }
  return prepared;
}

// The file's __metadata__: nothing of the checkpoint's path or step (the
// same weights export to the same bytes); for Tessera's format the model's fields.
std::map<std::string, std::string> safetensors_metadata(const CheckpointReader& reader, bool hugging_face) {
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (!hugging_face)
    for (const auto& [key, value] : reader.metadata())
      if (key.rfind("model.", 0) == 0) metadata["tessera." + key] = value;
  return metadata;
}

// config.json and the tokenizer's files (when there is one) in `directory`, noted in `result`.
void write_beside_weights(const CheckpointReader& reader, DType dtype, const TokenizerToWrite& tokenizer,
                          const fs::path& directory, ExportResult& result) {
  result.config = (directory / "config.json").string();
  write_text(result.config, hf_gpt2_config(reader, dtype).dump(2) + "\n");
  result.tokenizer_note = tokenizer.note;
  if (!tokenizer.tokenizer) return;
  result.vocab = (directory / "vocab.json").string();
  result.merges = (directory / "merges.txt").string();
  tokenizer.tokenizer->write_gpt2_files(result.vocab, result.merges);
}

// The weights (and for hf-gpt2 config.json and the tokenizer's files) written as `plan` says.
ExportResult write_export(const CheckpointReader& reader, const ExportOptions& options, const OutputPlan& plan,
                          const TokenizerToWrite& tokenizer) {
  ExportResult result;
  if (llama_family(options.format)) {
    const HfLlamaConfig config = hf_llama_config_of(reader);
    const Prepared prepared = prepare_llama(reader, config);
    const HfLlamaWritten written =
        write_hf_llama(plan.directory.string(), prepared.inputs(), config,
                       tokenizer.tokenizer ? &*tokenizer.tokenizer : nullptr, options.max_shard_bytes);
    result.weights = written.weights.files.back();
    result.shards = written.weights.files.size() > 1
                        ? std::vector<std::string>(written.weights.files.begin(), written.weights.files.end() - 1)
                        : std::vector<std::string>{};
    result.tensors = written.weights.tensors;
    result.bytes = written.weights.bytes;
    result.config = written.config;
    result.vocab = written.vocab;
    result.merges = written.merges;
    result.tokenizer_config = written.tokenizer_config;
    result.tokenizer_note = tokenizer.note;
    return result;
  }
  const bool hugging_face = options.format == "hf-gpt2";
  DType dtype = DType::f32;
  const Prepared prepared = hugging_face ? prepare_hf_gpt2(reader, dtype) : prepare_tessera(reader);
  const std::map<std::string, std::string> metadata = safetensors_metadata(reader, hugging_face);
  if (plan.whole_directory) {
    const SafetensorsWritten written =
        write_safetensors_directory(plan.directory.string(), prepared.inputs(), options.max_shard_bytes, metadata);
    result.weights = written.files.back();
    if (written.files.size() > 1) result.shards.assign(written.files.begin(), written.files.end() - 1);
  } else {
    write_safetensors(plan.weights.string(), prepared.inputs(), metadata);
    result.weights = plan.weights.string();
  }
  result.tensors = int64_t(prepared.names.size());
  for (const std::vector<std::byte>& bytes : prepared.data) result.bytes += int64_t(bytes.size());
  if (hugging_face) write_beside_weights(reader, dtype, tokenizer, plan.directory, result);
  return result;
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

ExportResult export_checkpoint(const std::string& checkpoint, const std::string& out, const ExportOptions& options) {
  const std::map<std::string, std::string> kinds = {
      {"tessera", ""}, {"hf-gpt2", "gpt"}, {"hf-llama", "llama"}, {"hf-mixtral", "llama"}};
  TESSERA_CHECK(kinds.count(options.format), "export: --format ", options.format,
                " is not one of tessera, hf-gpt2, hf-llama, hf-mixtral");
  const bool hugging_face = options.format != "tessera";
  const CheckpointReader reader(checkpoint);
  if (hugging_face) {
    const std::string problem = hugging_face_problem(checkpoint_model(reader).config, options.format);
    TESSERA_CHECK(problem.empty(), "export --format ", options.format, ": checkpoint ", reader.path(), " holds ",
                  problem);
  }
  // Everything that can refuse comes before the first byte is written.
  const TokenizerToWrite tokenizer =
      hugging_face ? tokenizer_to_write(reader, options.tokenizer_data) : TokenizerToWrite{};
  const OutputPlan plan = plan_output(out, options.format, tokenizer.tokenizer.has_value(),
                                      weight_files(reader, options.format, options.max_shard_bytes));
  check_not_the_checkpoint(plan, out, checkpoint_extent(reader, checkpoint));
  if (hugging_face) check_nothing_replaced(plan, out, options.force);
  check_writable(plan, out);

  MadeByExport made;
  made.create_directories(plan.directory);
  if (plan.whole_directory && options.force) remove_earlier_weights(plan);
  for (const fs::path& file : plan.files) made.about_to_write(file);
  ExportResult result = write_export(reader, options, plan, tokenizer);
  made.keep();
  return result;
}

}  // namespace tessera::io
