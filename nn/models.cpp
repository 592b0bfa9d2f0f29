// ModelConfig validation (nn/models.h); the models themselves are built on
// the models/ floor.
#include "nn/models.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/context.h"

namespace tessera::nn {
namespace {

// The largest sizes Tessera accepts: far beyond any published model (widths
// up to 25,600, 128 layers, vocabularies of 256k), small enough that every
// tensor's element count and every byte count of a model stays exact in
// int64 (layers x 12 x width^2 x 16 bytes < 2^63), so a typo is refused with
// a message instead of overflowing, allocating for minutes or hanging.
constexpr int64_t kMaxWidth = int64_t(1) << 20;        // --hidden-size, --ffn-hidden-size, --hidden widths
constexpr int64_t kMaxLayers = int64_t(1) << 14;       // --num-layers
constexpr int64_t kMaxSeqLength = int64_t(1) << 24;    // --seq-length
constexpr int64_t kMaxVocab = (int64_t(1) << 31) - 1;  // --vocab-size: token ids are int32
constexpr int64_t kMaxExperts = int64_t(1) << 16;      // --num-experts (DeepSeek-V3: 256)

void check_at_most(const char* flag, int64_t value, int64_t limit, const char* what) {
  TESSERA_CHECK(value <= limit, flag, " ", value, " is larger than ", limit, ", the largest ", what,
                " Tessera accepts; check the value for a typo");
}

// Grouped-query attention, rotary embeddings and the norms: what makes them work.
void validate_decoder_choices(const ModelConfig& m) {
  const int64_t groups = m.query_groups();
  TESSERA_CHECK(groups >= 1 && m.num_heads % groups == 0, "--num-query-groups ", groups, " must divide --num-heads ",
                m.num_heads,
                " (each key/value head serves the same number of query heads); use e.g. "
                "--num-query-groups ",
                nearest_divisor(m.num_heads, groups));
  if (m.decoder().rotary) {
    TESSERA_CHECK((m.hidden_size / m.num_heads) % 2 == 0,
                  "--position-embedding-type rope rotates pairs of features: "
                  "the head width --hidden-size / --num-heads = ",
                  m.hidden_size / m.num_heads, " must be even");
    TESSERA_CHECK(m.rotary_base > 1.0f, "--rotary-base ", m.rotary_base,
                  " must be larger than 1 (Llama: 10000, "
                  "Llama 3: 500000)");
  }
  TESSERA_CHECK(m.norm_epsilon > 0.0f, "--norm-epsilon ", m.norm_epsilon, " must be positive (Llama: 1e-5 or 1e-6)");
}

// "N" or "[1,0,1,1]" (--moe-layer-freq) as one flag per layer of `layers`.
std::vector<bool> moe_layer_pattern(const std::string& freq, int64_t layers) {
  std::vector<bool> pattern;
  if (!freq.empty() && freq.front() == '[') {
    TESSERA_CHECK(freq.back() == ']', "--moe-layer-freq '", freq, "': a pattern is a list such as [1,0,1,1]");
    for (size_t i = 1; i + 1 < freq.size(); ++i) {
      const char c = freq[i];
      if (c == ',' || c == ' ') continue;
      TESSERA_CHECK(c == '0' || c == '1', "--moe-layer-freq '", freq,
                    "': a pattern holds a 0 (dense) or 1 (experts) per layer, comma-separated");
      pattern.push_back(c == '1');
    }
    TESSERA_CHECK(int64_t(pattern.size()) == layers, "--moe-layer-freq '", freq, "' has ", pattern.size(),
                  " entries; --num-layers is ", layers, ": give one 0/1 per layer");
    return pattern;
  }
  char* end = nullptr;
  const long long every = std::strtoll(freq.c_str(), &end, 10);
  TESSERA_CHECK(!freq.empty() && end == freq.c_str() + freq.size() && every >= 1, "--moe-layer-freq '", freq,
                "' must be a whole number N >= 1 (layers 0, N, 2N, ... have experts) or a pattern such as [1,0,1,1]");
  for (int64_t i = 0; i < layers; ++i) pattern.push_back(i % every == 0);
  return pattern;
}

// A mixture of experts' sizes and coefficients.
void validate_experts(const ModelConfig& m) {
  TESSERA_CHECK(m.num_experts >= 0, "--num-experts ", m.num_experts, " must not be negative (0: dense MLPs)");
  if (m.num_experts == 0) return;
  check_at_most("--num-experts", m.num_experts, kMaxExperts, "number of experts");
  TESSERA_CHECK(m.moe_router_topk >= 1 && m.moe_router_topk <= m.num_experts, "--moe-router-topk ", m.moe_router_topk,
                " must be from 1 to --num-experts ", m.num_experts);
  TESSERA_CHECK(m.moe_ffn_hidden_size >= 0, "--moe-ffn-hidden-size ", m.moe_ffn_hidden_size,
                " must be positive (or 0 for --ffn-hidden-size's width)");
  check_at_most("--moe-ffn-hidden-size", m.moe_ffn_hidden_size, kMaxWidth, "expert width");
  TESSERA_CHECK(m.moe_aux_loss_coeff >= 0 && m.moe_z_loss_coeff >= 0, "--moe-aux-loss-coeff ", m.moe_aux_loss_coeff,
                " and --moe-z-loss-coeff ", m.moe_z_loss_coeff, " must not be negative");
  TESSERA_CHECK(m.moe_expert_capacity_factor >= 0, "--moe-expert-capacity-factor ", m.moe_expert_capacity_factor,
                " must not be negative (0: dropless, every token kept)");
  moe_layer_pattern(m.moe_layer_freq, m.num_layers);  // throws on a bad pattern
}

}  // namespace

bool ModelConfig::moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  return moe_layer_pattern(moe_layer_freq, num_layers)[size_t(layer)];
}

int64_t nearest_divisor(int64_t n, int64_t target) {
  int64_t nearest = 1;
  const auto consider = [&](int64_t d) {
    const int64_t distance = d > target ? d - target : target - d,
                  best = nearest > target ? nearest - target : target - nearest;
    if (distance < best || (distance == best && d > nearest)) nearest = d;
  };
  for (int64_t d = 1; d <= n / d; ++d)  // divisors come in pairs (d, n / d): O(sqrt n)
    if (n % d == 0) {
      consider(d);
      consider(n / d);
    }
  return nearest;
}

DecoderChoices ModelConfig::decoder() const {
  DecoderChoices c = decoder_defaults(kind);
  c.normalization = normalization.value_or(c.normalization);
  c.rotary = rotary.value_or(c.rotary);
  c.swiglu = swiglu.value_or(c.swiglu);
  c.bias = bias.value_or(c.bias);
  c.untie_embeddings = untie_embeddings.value_or(c.untie_embeddings);
  return c;
}

bool ModelConfig::grouped_attention() const {
  return kind == ModelKind::llama || decoder().rotary || query_groups() != num_heads;
}

int64_t ModelConfig::ffn() const {
  if (ffn_hidden_size > 0) return ffn_hidden_size;
  if (decoder().swiglu) return (8 * hidden_size / 3 + 255) / 256 * 256;
  return 4 * hidden_size;
}

void ModelConfig::validate() const {
  const std::string_view name = model_name(kind);
  if (!model_traits(kind).reads_tokens) {
    TESSERA_CHECK(channels >= 1 && height >= 1 && width >= 1, name, ": the dataset's input shape (C, H, W) = (",
                  channels, ", ", height, ", ", width, ") has an empty dimension");
    TESSERA_CHECK(num_classes >= 2, name, ": the dataset has ", num_classes, " classes; a classifier needs at least 2");
  }
  if (kind == ModelKind::mlp) {
    for (size_t i = 0; i < hidden.size(); ++i) {
      TESSERA_CHECK(hidden[i] >= 1, "--hidden: layer ", i, " has width ", hidden[i], "; widths must be at least 1");
      check_at_most("--hidden: a width of", hidden[i], kMaxWidth, "layer width");
    }
    check_at_most("--hidden: a list of", int64_t(hidden.size()), kMaxLayers, "number of layers");
  }
  if (kind == ModelKind::cnn) {
    TESSERA_CHECK(height >= 4 && width >= 4, "cnn: its two 2x2 poolings need images of at least 4x4, the dataset has ",
                  height, "x", width, "; use --model mlp");
  }
  if (model_traits(kind).reads_tokens) {
    TESSERA_CHECK(vocab_size >= 1, "--vocab-size ", vocab_size, " must be at least 1");
    TESSERA_CHECK(seq_length >= 1, "--seq-length ", seq_length, " must be at least 1");
    TESSERA_CHECK(num_layers >= 1, "--num-layers ", num_layers, " must be at least 1");
    TESSERA_CHECK(hidden_size >= 1, "--hidden-size ", hidden_size, " must be at least 1");
    TESSERA_CHECK(num_heads >= 1, "--num-heads ", num_heads, " must be at least 1");
    check_at_most("--vocab-size", vocab_size, kMaxVocab, "vocabulary (token ids are 32-bit)");
    check_at_most("--seq-length", seq_length, kMaxSeqLength, "context length");
    check_at_most("--num-layers", num_layers, kMaxLayers, "number of layers");
    check_at_most("--hidden-size", hidden_size, kMaxWidth, "width");
    check_at_most("--ffn-hidden-size", ffn_hidden_size, kMaxWidth, "feed-forward width");
    if (hidden_size % num_heads != 0) {
      const int64_t nearest = nearest_divisor(hidden_size, num_heads);
      TESSERA_THROW("--num-heads ", num_heads, " does not divide --hidden-size ", hidden_size,
                    "; choose a head count that divides it (e.g. --num-heads ", nearest, ": heads of ",
                    hidden_size / nearest, ")");
    }
    TESSERA_CHECK(ffn_hidden_size >= 0, "--ffn-hidden-size ", ffn_hidden_size,
                  " must be positive (or 0 for 4 x --hidden-size)");
    TESSERA_CHECK(dropout >= 0.0f && dropout < 1.0f, "--dropout ", dropout, " must be in [0, 1)");
    TESSERA_CHECK(attention_dropout >= 0.0f && attention_dropout < 1.0f, "--attention-dropout ", attention_dropout,
                  " must be in [0, 1)");
  }
  if (model_traits(kind).reads_tokens) validate_decoder_choices(*this);
  if (model_traits(kind).reads_tokens) validate_experts(*this);
}

int64_t parameter_count(Module& model) {
  int64_t total = 0;
  for (const Parameter* p : model.parameters()) total += p->shard.global_shape.numel();
  return total;
}

}  // namespace tessera::nn
