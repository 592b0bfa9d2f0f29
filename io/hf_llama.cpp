// Hugging Face Llama in and out (io/hf_llama.h): the tensor correspondence
// as ParameterInFile runs (one table, read by load_weights and inverted by
// split_into_file_tensors), the directory written by
// write_safetensors_directory, tokenizer_config.json; config.json itself is
// io/hf_llama_config.cpp.
#include "io/hf_llama.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/tokenizer.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The logical tensor `name` among `logical`, checked against the layout.
const SafetensorsInput& logical_tensor(const std::vector<SafetensorsInput>& logical, const ParameterInFile& layout,
                                       DType dtype) {
  for (const SafetensorsInput& tensor : logical) {
    if (tensor.name != layout.parameter) continue;
    TESSERA_CHECK(tensor.shape == layout.logical_shape, "write_hf_llama: ", tensor.name, " is ",
                  tensor.shape.to_string(), " but config.json's sizes make it ", layout.logical_shape.to_string(),
                  "; the config does not describe these weights");
    TESSERA_CHECK(tensor.dtype == dtype && is_floating(dtype), "write_hf_llama: ", tensor.name, " is ",
                  dtype_name(tensor.dtype), ", the others ", dtype_name(dtype),
                  "; Hugging Face's torch_dtype needs one floating-point dtype");
    return tensor;
  }
  TESSERA_THROW("write_hf_llama: no tensor ", layout.parameter, " among the model's ", logical.size(),
                " tensors; a Llama (Mixtral) of ",
                layout.parameter == "lm_head.weight" ? "untied embeddings" : "these sizes", " has one");
}

// Refuses a logical tensor with no place in Hugging Face's Llama (a tied model's lm_head, optimizer state, ...).
void check_all_placed(const std::vector<SafetensorsInput>& logical, const std::vector<ParameterInFile>& layouts,
                      const HfLlamaConfig& config) {
  for (const SafetensorsInput& tensor : logical) {
    bool placed = false;
    for (const ParameterInFile& layout : layouts) placed = placed || layout.parameter == tensor.name;
    TESSERA_CHECK(placed, "write_hf_llama: tensor ", tensor.name, " has no place in Hugging Face's Llama",
                  tensor.name == "lm_head.weight" && config.tie_word_embeddings
                      ? " with tie_word_embeddings true (the head is the embedding); set it false"
                      : "; pass the model's parameters only");
  }
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  TESSERA_CHECK(out, "cannot write ", path, ": ", std::strerror(errno));
}

// tokenizer_config.json: AutoTokenizer builds GPT2Tokenizer(Fast) from vocab.json and merges.txt (config.json's
// model_type alone would ask for LlamaTokenizer's SentencePiece model); Tessera's tokenizers have no special tokens.
std::string tokenizer_config_json(const HfLlamaConfig& config) {
  const json content = {{"tokenizer_class", "GPT2Tokenizer"},
                        {"add_prefix_space", false},
                        {"bos_token", nullptr},
                        {"eos_token", nullptr},
                        {"unk_token", nullptr},
                        {"pad_token", nullptr},
                        {"clean_up_tokenization_spaces", false},
                        {"model_max_length", config.max_position_embeddings}};
  return content.dump(2) + "\n";
}

// Attention's rows: group g of the grouped layout is R q heads, then a k head, then a v head (Dh rows each).
ParameterInFile qkv_layout(const std::string& block, const std::string& layer, const HfLlamaConfig& c) {
  const int64_t C = c.hidden_size, H = c.num_attention_heads, G = c.num_key_value_heads, R = c.queries_per_group(),
                Dh = c.head_dim();
  const std::string q = layer + "self_attn.q_proj.weight", k = layer + "self_attn.k_proj.weight",
                    v = layer + "self_attn.v_proj.weight";
  ParameterInFile layout{block + "attn.qkv.weight",
                         Shape{G * (R + 2) * Dh, C},
                         {{q, Shape{H * Dh, C}}, {k, Shape{G * Dh, C}}, {v, Shape{G * Dh, C}}},
                         {},
                         false};
  for (int64_t g = 0; g < G; ++g) {
    layout.runs.push_back({q, g * R * Dh * C, R * Dh * C});
    layout.runs.push_back({k, g * Dh * C, Dh * C});
    layout.runs.push_back({v, g * Dh * C, Dh * C});
  }
  return layout;
}

// The MLP's input rows: gate then up.
ParameterInFile fc_layout(const std::string& block, const std::string& layer, const HfLlamaConfig& c) {
  const int64_t C = c.hidden_size, F = c.intermediate_size;
  const std::string gate = layer + "mlp.gate_proj.weight", up = layer + "mlp.up_proj.weight";
  return ParameterInFile{block + "mlp.fc.weight",
                         Shape{2 * F, C},
                         {{gate, Shape{F, C}}, {up, Shape{F, C}}},
                         {{gate, 0, F * C}, {up, 0, F * C}},
                         false};
}

// A Mixtral block's sparse MLP: the router, then each expert's w1/w3 (fc rows gate, up) and w2 (proj).
void add_expert_layouts(const std::string& block, const std::string& layer, const HfLlamaConfig& c,
                        std::vector<ParameterInFile>& layouts) {
  const int64_t C = c.hidden_size, F = c.intermediate_size, E = c.num_local_experts;
  const std::string moe = layer + "block_sparse_moe.";
  layouts.push_back(whole_tensor_layout(block + "mlp.router.weight", Shape{E, C}, moe + "gate.weight"));
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = block + "mlp.experts." + std::to_string(e) + ".",
                      theirs = moe + "experts." + std::to_string(e) + ".";
    const std::string w1 = theirs + "w1.weight", w3 = theirs + "w3.weight";
    layouts.push_back(ParameterInFile{expert + "fc.weight",
                                      Shape{2 * F, C},
                                      {{w1, Shape{F, C}}, {w3, Shape{F, C}}},
                                      {{w1, 0, F * C}, {w3, 0, F * C}},
                                      false});
    layouts.push_back(whole_tensor_layout(expert + "proj.weight", Shape{C, F}, theirs + "w2.weight"));
  }
}

// A checkpoint's mixture of experts as Mixtral's keys (nothing without
// experts); refused when only some blocks have experts (Mixtral's all do).
void read_checkpoint_experts(const CheckpointReader& reader, HfLlamaConfig& c) {
  if (!reader.metadata().count("model.num_experts") || checkpoint_integer(reader, "model.num_experts") == 0) return;
  const std::string freq = reader.metadata().at("model.moe_layer_freq");
  TESSERA_CHECK(freq == "1", "checkpoint ", reader.path(), " has experts only in the blocks --moe-layer-freq ", freq,
                " picks, and Mixtral has them in every block; export it with --format tessera");
  c.num_local_experts = checkpoint_integer(reader, "model.num_experts");
  c.num_experts_per_tok = checkpoint_integer(reader, "model.moe_router_topk");
  c.intermediate_size = checkpoint_integer(reader, "model.moe_ffn_hidden_size");
  if (const std::optional<double> coefficient = checkpoint_real(reader, "config.moe-aux-loss-coeff"))
    c.router_aux_loss_coef = *coefficient;
}

// A number of the checkpoint's metadata: the first of `keys` it has.
double checkpoint_number(const CheckpointReader& reader, const std::vector<std::string>& keys) {
  for (const std::string& key : keys)
    if (const std::optional<double> value = checkpoint_real(reader, key)) return *value;
  TESSERA_THROW("checkpoint ", reader.path(), " has no '", keys.front(), "' entry (nor '", keys.back(),
                "'); it was not written by `tessera train --model llama` of this version");
}

// Key/value groups: model.num_query_groups, else from the first block's qkv rows (G·(R+2)·Dh = (H + 2G)·Dh).
int64_t checkpoint_query_groups(const CheckpointReader& reader, int64_t hidden, int64_t heads) {
  if (reader.metadata().count("model.num_query_groups")) return checkpoint_integer(reader, "model.num_query_groups");
  for (const StoredTensor& tensor : reader.tensors())
    if (tensor.name == "blocks.0.attn.qkv.weight") {
      const int64_t head_rows = tensor.shape[0] / (hidden / heads);
      TESSERA_CHECK((head_rows - heads) % 2 == 0 && head_rows > heads, "checkpoint ", reader.path(),
                    ": blocks.0.attn.qkv.weight ", tensor.shape.to_string(), " is not the grouped qkv of ", heads,
                    " heads of ", hidden / heads);
      return (head_rows - heads) / 2;
    }
  TESSERA_THROW("checkpoint ", reader.path(), " has no blocks.0.attn.qkv.weight; it is not a Llama of this version");
}

}  // namespace

HfLlamaConfig hf_llama_config_of(const CheckpointReader& reader) {
  HfLlamaConfig c;
  c.vocab_size = checkpoint_integer(reader, "model.vocab_size");
  c.hidden_size = checkpoint_integer(reader, "model.hidden_size");
  c.intermediate_size = checkpoint_integer(reader, "model.ffn_hidden_size");
  c.num_hidden_layers = checkpoint_integer(reader, "model.num_layers");
  c.num_attention_heads = checkpoint_integer(reader, "model.num_heads");
  c.max_position_embeddings = checkpoint_integer(reader, "model.seq_length");
  TESSERA_CHECK(c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0, "checkpoint ", reader.path(),
                ": model.hidden_size ", c.hidden_size, " is not divisible by model.num_heads ", c.num_attention_heads);
  c.num_key_value_heads = checkpoint_query_groups(reader, c.hidden_size, c.num_attention_heads);
  c.tie_word_embeddings = !reader.has_tensor("lm_head.weight");
  c.rope_theta = checkpoint_number(reader, {"model.rotary_base", "config.rotary-base"});
  c.rms_norm_eps = checkpoint_number(reader, {"model.norm_epsilon", "config.norm-epsilon"});
  c.attention_dropout = checkpoint_dropout(reader, "attention-dropout");
  read_checkpoint_experts(reader, c);
  c.validate("checkpoint " + reader.path());
  return c;
}

std::vector<ParameterInFile> hf_llama_layouts(const HfLlamaConfig& c) {
  c.validate("hf_llama_layouts");
  const int64_t V = c.vocab_size, C = c.hidden_size, F = c.intermediate_size;
  const auto whole = [](const std::string& name, const Shape& shape, const std::string& hf) {
    return whole_tensor_layout(name, shape, hf);
  };
  std::vector<ParameterInFile> layouts = {whole("wte.weight", Shape{V, C}, "model.embed_tokens.weight")};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string block = "blocks." + std::to_string(i) + ".", layer = "model.layers." + std::to_string(i) + ".";
    layouts.push_back(qkv_layout(block, layer, c));
    layouts.push_back(whole(block + "attn.proj.weight", Shape{C, c.num_attention_heads * c.head_dim()},
                            layer + "self_attn.o_proj.weight"));
    if (c.mixtral()) {
      add_expert_layouts(block, layer, c, layouts);
    } else {
      layouts.push_back(fc_layout(block, layer, c));
      layouts.push_back(whole(block + "mlp.proj.weight", Shape{C, F}, layer + "mlp.down_proj.weight"));
    }
    layouts.push_back(whole(block + "ln1.weight", Shape{C}, layer + "input_layernorm.weight"));
    layouts.push_back(whole(block + "ln2.weight", Shape{C}, layer + "post_attention_layernorm.weight"));
  }
  layouts.push_back(whole("ln_f.weight", Shape{C}, "model.norm.weight"));
  if (!c.tie_word_embeddings) layouts.push_back(whole("lm_head.weight", Shape{V, C}, "lm_head.weight"));
  return layouts;
}

WeightsLoaded load_hf_llama_weights(const std::string& directory, const std::vector<nn::Parameter*>& parameters,
                                    const HfLlamaConfig& config) {
  const SafetensorsDirectory weights(directory, "--init-from");
  std::map<std::string, ParameterInFile> layouts;
  for (ParameterInFile& layout : hf_llama_layouts(config)) layouts[layout.parameter] = std::move(layout);
  return load_weights(weights, parameters, layouts, "hf-llama");
}

HfLlamaWritten write_hf_llama(const std::string& directory, const std::vector<SafetensorsInput>& logical,
                              const HfLlamaConfig& config, const Tokenizer* tokenizer, int64_t max_shard_bytes) {
  const std::vector<ParameterInFile> layouts = hf_llama_layouts(config);
  check_all_placed(logical, layouts, config);
  TESSERA_CHECK(!logical.empty(), "write_hf_llama: no tensors to write");
  TESSERA_CHECK(tokenizer == nullptr || tokenizer->vocab_size() <= config.vocab_size,
                "write_hf_llama: the tokenizer has ", tokenizer ? tokenizer->vocab_size() : 0,
                " tokens, more than the model's vocabulary of ", config.vocab_size,
                "; give the tokenizer of the data the model was trained on");
  const DType dtype = logical.front().dtype;
  std::vector<std::vector<std::byte>> storage;  // the Hugging Face tensors' bytes, which `inputs` point into
  std::vector<SafetensorsInput> inputs;
  for (const ParameterInFile& layout : layouts) {
    const SafetensorsInput& tensor = logical_tensor(logical, layout, dtype);
    std::vector<std::vector<std::byte>> parts =
        split_into_file_tensors(layout, static_cast<const std::byte*>(tensor.data), dtype_size(dtype));
    for (size_t t = 0; t < parts.size(); ++t) {
      storage.push_back(std::move(parts[t]));
      inputs.push_back({layout.tensors[t].first, dtype, layout.tensors[t].second, nullptr});
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) inputs[i].data = storage[i].data();

  std::error_code error;
  fs::create_directories(directory, error);
  TESSERA_CHECK(!error, "write_hf_llama: cannot create ", directory, ": ", error.message());
  HfLlamaWritten written;
  written.weights = write_safetensors_directory(directory, inputs, max_shard_bytes);
  HfLlamaConfig described = config;
  described.torch_dtype = torch_dtype_name(dtype);
  written.config = (fs::path(directory) / "config.json").string();
  write_text(written.config, hf_llama_config_json(described));
  if (tokenizer == nullptr) return written;
  written.vocab = (fs::path(directory) / "vocab.json").string();
  written.merges = (fs::path(directory) / "merges.txt").string();
  written.tokenizer_config = (fs::path(directory) / "tokenizer_config.json").string();
  tokenizer->write_gpt2_files(written.vocab, written.merges);
  write_text(written.tokenizer_config, tokenizer_config_json(config));
  return written;
}

}  // namespace tessera::io
