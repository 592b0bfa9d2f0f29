// Hugging Face LlamaConfig's config.json (io/hf_llama.h): parsed and
// written through nlohmann::json, every key checked; apart from the weights'
// code so that the fuzz harness of config.json (tests/fuzz/fuzz_hf_llama.cpp)
// links it alone.
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "io/hf_llama.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* const kFixConfig =
    "; config.json must be a LlamaForCausalLM's (or MixtralForCausalLM's) as save_pretrained writes it";

// A size: a positive integer; `fallback` when the key is absent or null (none: required).
int64_t positive_size(const json& config, const std::string& source, const char* key,
                      std::optional<int64_t> fallback = std::nullopt) {
  if (!config.contains(key) || config[key].is_null()) {
    TESSERA_CHECK(fallback.has_value(), source, ": \"", key, "\" is missing", kFixConfig);
    return *fallback;
  }
  const json& value = config[key];
  TESSERA_CHECK(value.is_number_integer() && value.get<int64_t>() > 0, source, ": \"", key, "\" is ", value.dump(),
                ", not a positive integer", kFixConfig);
  return value.get<int64_t>();
}

// A positive number; `fallback` when absent.
double positive_number(const json& config, const std::string& source, const char* key, double fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  const json& value = config[key];
  TESSERA_CHECK(value.is_number() && value.get<double>() > 0 && std::isfinite(value.get<double>()), source, ": \"", key,
                "\" is ", value.dump(), ", not a positive number", kFixConfig);
  return value.get<double>();
}

bool boolean(const json& config, const std::string& source, const char* key, bool fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  TESSERA_CHECK(config[key].is_boolean(), source, ": \"", key, "\" is ", config[key].dump(), ", not true or false",
                kFixConfig);
  return config[key].get<bool>();
}

std::optional<int64_t> optional_token(const json& config, const std::string& source, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  TESSERA_CHECK(config[key].is_number_integer() && config[key].get<int64_t>() >= 0, source, ": \"", key, "\" is ",
                config[key].dump(), ", not a token id");
  return config[key].get<int64_t>();
}

// The architecture config.json names: "llama" or "mixtral" (its model_type
// and architectures agreeing), the features Tessera's Llama does not have refused.
bool check_architecture(const json& config, const std::string& source) {
  const bool mixtral = config.contains("model_type") && config["model_type"] == "mixtral";
  const char* const wanted = mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM";
  TESSERA_CHECK(mixtral || (config.contains("model_type") && config["model_type"] == "llama"), source,
                ": \"model_type\" is ",
                config.contains("model_type") ? config["model_type"].dump() : std::string("missing"),
                ", not \"llama\" or \"mixtral\"; give the config.json of a LlamaForCausalLM or MixtralForCausalLM");
  if (config.contains("architectures") && !config["architectures"].is_null()) {
    const json& names = config["architectures"];
    bool named = false;
    if (names.is_array())
      for (const json& name : names) named = named || name == wanted;
    TESSERA_CHECK(named, source, ": \"architectures\" is ", names.dump(), ", without \"", wanted,
                  "\"; give the config.json of a ", wanted);
  }
  for (const char* key : {"attention_bias", "mlp_bias"})
    TESSERA_CHECK(!boolean(config, source, key, false), source, ": \"", key,
                  "\" is true, but Tessera's Llama has no biases (--disable-bias-linear); give a model saved with \"",
                  key, "\": false");
  if (config.contains("hidden_act") && !config["hidden_act"].is_null())
    TESSERA_CHECK(config["hidden_act"] == "silu", source, ": \"hidden_act\" is ", config["hidden_act"].dump(),
                  ", but Tessera's Llama uses SwiGLU (\"silu\"); give a model saved with \"hidden_act\": \"silu\"");
  if (config.contains("rope_scaling"))
    TESSERA_CHECK(config["rope_scaling"].is_null(), source, ": \"rope_scaling\" is ", config["rope_scaling"].dump(),
                  ": RoPE scaling (linear, dynamic, YaRN, Llama 3.1's \"llama3\") is not supported yet; give a model "
                  "with \"rope_scaling\": null");
  return mixtral;
}

// A Mixtral's keys: its experts, and a sliding window no shorter than its positions (else not supported).
void read_experts(const json& config, const std::string& source, HfLlamaConfig& c) {
  c.num_local_experts = positive_size(config, source, "num_local_experts");
  c.num_experts_per_tok = positive_size(config, source, "num_experts_per_tok", c.num_experts_per_tok);
  if (config.contains("router_aux_loss_coef") && config["router_aux_loss_coef"].is_number())
    c.router_aux_loss_coef = config["router_aux_loss_coef"].get<double>();
  if (config.contains("sliding_window") && !config["sliding_window"].is_null())
    TESSERA_CHECK(config["sliding_window"].is_number_integer() &&
                      config["sliding_window"].get<int64_t>() >= c.max_position_embeddings,
                  source, ": \"sliding_window\" is ", config["sliding_window"].dump(),
                  ": sliding-window attention (a window shorter than max_position_embeddings ",
                  c.max_position_embeddings, ") is not supported; give a model with \"sliding_window\": null");
}

}  // namespace

void HfLlamaConfig::validate(const std::string& source) const {
  // Bounds far above any Llama's, so that no product of sizes overflows and a damaged file is caught here.
  for (const auto& [key, value, most] :
       {std::tuple{"vocab_size", vocab_size, int64_t(1) << 24},
        std::tuple{"hidden_size", hidden_size, int64_t(1) << 20},
        std::tuple{"intermediate_size", intermediate_size, int64_t(1) << 22},
        std::tuple{"num_hidden_layers", num_hidden_layers, int64_t(1) << 16},
        std::tuple{"num_attention_heads", num_attention_heads, hidden_size},
        std::tuple{"num_key_value_heads", num_key_value_heads, num_attention_heads},
        std::tuple{"max_position_embeddings", max_position_embeddings, int64_t(1) << 31}})
    TESSERA_CHECK(value > 0 && value <= most, source, ": \"", key, "\" is ", value, "; it must be in [1, ", most, "]",
                  kFixConfig);
  TESSERA_CHECK(hidden_size % num_attention_heads == 0, source, ": \"hidden_size\" ", hidden_size,
                " is not divisible by \"num_attention_heads\" ", num_attention_heads);
  TESSERA_CHECK(num_attention_heads % num_key_value_heads == 0, source, ": \"num_attention_heads\" ",
                num_attention_heads, " is not divisible by \"num_key_value_heads\" ", num_key_value_heads);
  TESSERA_CHECK(head_dim() % 2 == 0, source, ": the head size hidden_size / num_attention_heads = ", head_dim(),
                " is odd; rotary embeddings need it even");
  TESSERA_CHECK(rms_norm_eps > 0 && rope_theta > 0, source, ": \"rms_norm_eps\" and \"rope_theta\" must be positive");
  if (!mixtral()) return;
  TESSERA_CHECK(num_local_experts <= (int64_t(1) << 16), source, ": \"num_local_experts\" is ", num_local_experts,
                "; it must be in [1, 65536]", kFixConfig);
  TESSERA_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_local_experts, source,
                ": \"num_experts_per_tok\" ", num_experts_per_tok, " must be from 1 to \"num_local_experts\" ",
                num_local_experts);
}

nn::ModelConfig llama_model_config(const HfLlamaConfig& hf, int64_t seq_length) {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::llama;
  m.vocab_size = hf.vocab_size;
  m.seq_length = seq_length;
  m.num_layers = hf.num_hidden_layers;
  m.num_heads = hf.num_attention_heads;
  m.num_query_groups = hf.num_key_value_heads;
  m.hidden_size = hf.hidden_size;
  m.ffn_hidden_size = hf.intermediate_size;
  m.rotary_base = float(hf.rope_theta);
  m.norm_epsilon = float(hf.rms_norm_eps);
  m.untie_embeddings = !hf.tie_word_embeddings;
  if (hf.mixtral()) {  // every block's MLP a mixture of experts
    m.num_experts = hf.num_local_experts;
    m.moe_router_topk = hf.num_experts_per_tok;
    m.moe_ffn_hidden_size = hf.intermediate_size;
    m.moe_layer_freq = "1";
  }
  return m;
}

HfLlamaConfig read_hf_llama_config(const std::string& path) {
  std::error_code error;
  const std::string file = fs::is_directory(path, error) ? (fs::path(path) / "config.json").string() : path;
  std::ifstream in(file, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", file, ": ", std::strerror(errno),
                "; a Hugging Face model directory holds config.json beside its weights");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_hf_llama_config(text.str(), file);
}

HfLlamaConfig parse_hf_llama_config(const std::string& text, const std::string& source) {
  const json config = json::parse(text, nullptr, false);
  TESSERA_CHECK(!config.is_discarded() && config.is_object(), source, " is not a JSON object (malformed JSON)",
                kFixConfig);
  const bool mixtral = check_architecture(config, source);
  HfLlamaConfig c;
  c.vocab_size = positive_size(config, source, "vocab_size");
  c.hidden_size = positive_size(config, source, "hidden_size");
  c.intermediate_size = positive_size(config, source, "intermediate_size");
  c.num_hidden_layers = positive_size(config, source, "num_hidden_layers");
  c.num_attention_heads = positive_size(config, source, "num_attention_heads");
  c.num_key_value_heads = positive_size(config, source, "num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = positive_size(config, source, "max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = positive_number(config, source, "rms_norm_eps", c.rms_norm_eps);
  c.rope_theta = positive_number(config, source, "rope_theta", c.rope_theta);
  c.tie_word_embeddings = boolean(config, source, "tie_word_embeddings", false);
  if (config.contains("torch_dtype") && config["torch_dtype"].is_string())
    c.torch_dtype = config["torch_dtype"].get<std::string>();
  c.bos_token_id = optional_token(config, source, "bos_token_id");
  c.eos_token_id = optional_token(config, source, "eos_token_id");
  if (mixtral) read_experts(config, source, c);
  c.validate(source);
  if (config.contains("head_dim") && !config["head_dim"].is_null())
    TESSERA_CHECK(config["head_dim"] == c.head_dim(), source, ": \"head_dim\" is ", config["head_dim"].dump(),
                  " but hidden_size / num_attention_heads is ", c.head_dim(),
                  "; heads of another size than hidden_size / num_attention_heads are not supported");
  return c;
}

std::string hf_llama_config_json(const HfLlamaConfig& c) {
  const auto token = [](const std::optional<int64_t>& id) { return id ? json(*id) : json(nullptr); };
  json config = {{"architectures", {c.mixtral() ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
                 {"model_type", c.mixtral() ? "mixtral" : "llama"},
                 {"vocab_size", c.vocab_size},
                 {"hidden_size", c.hidden_size},
                 {"intermediate_size", c.intermediate_size},
                 {"num_hidden_layers", c.num_hidden_layers},
                 {"num_attention_heads", c.num_attention_heads},
                 {"num_key_value_heads", c.num_key_value_heads},
                 {"head_dim", c.head_dim()},
                 {"max_position_embeddings", c.max_position_embeddings},
                 {"rms_norm_eps", c.rms_norm_eps},
                 {"rope_theta", c.rope_theta},
                 {"rope_scaling", nullptr},
                 {"tie_word_embeddings", c.tie_word_embeddings},
                 {"hidden_act", "silu"},
                 {"attention_bias", false},
                 {"mlp_bias", false},
                 {"attention_dropout", c.attention_dropout},
                 {"initializer_range", 0.02},
                 {"pretraining_tp", 1},
                 {"use_cache", true},
                 {"bos_token_id", token(c.bos_token_id)},
                 {"eos_token_id", token(c.eos_token_id)},
                 {"torch_dtype", c.torch_dtype.empty() ? "float32" : c.torch_dtype}};
  if (c.mixtral()) {
    config["num_local_experts"] = c.num_local_experts;
    config["num_experts_per_tok"] = c.num_experts_per_tok;
    config["router_aux_loss_coef"] = c.router_aux_loss_coef;
    config["output_router_logits"] = false;
    config["router_jitter_noise"] = 0.0;
    config["sliding_window"] = nullptr;
  }
  return config.dump(2) + "\n";
}

}  // namespace tessera::io
