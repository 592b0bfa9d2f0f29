// The model kinds (--model) and what the library and the app ask of each: a
// table with no dependencies beyond core/error.h, so that the command line
// (apps/train_config.cpp, and its fuzz harness) can check --model without
// the layers. nn/models.h builds them.
#pragma once

#include <iosfwd>
#include <string_view>

namespace tessera::nn {

// The models this build knows (--model). Adding one: its enumerator, its row
// in model_traits (nn/model_kind.cpp), and its file and registry row on the
// models/ floor (models/registry.h says how).
enum class ModelKind { mlp, cnn, gpt, llama };

// The language models' normalisation (--normalization).
enum class Normalization { layer_norm, rms_norm };
std::string_view normalization_name(Normalization n);  // "LayerNorm", "RMSNorm"

// A decoder's architectural choices. GPT-2's: LayerNorm, learned absolute
// positions (wpe), a GELU MLP, biases, the head tied to the embedding. The
// Llama's: RMSNorm, rotary embeddings, SwiGLU, no biases, an untied head.
struct DecoderChoices {
  Normalization normalization = Normalization::layer_norm;
  bool rotary = false;
  bool swiglu = false;
  bool bias = true;
  bool untie_embeddings = false;
};

// What the rest of the library and the app ask of a model kind.
struct ModelTraits {
  std::string_view name;                     // as --model spells it
  bool reads_tokens = false;                 // token ids [B, T] (a tokens dataset) rather than images/features
  bool splits_into_stages = false;           // --pipeline-parallel > 1 applies
  bool splits_over_tensor_parallel = false;  // --tensor-parallel > 1 applies
  std::string_view layer_word;               // what its pipeline layers are called ("blocks", "layers")
  DecoderChoices decoder = {};               // a language model's choices unless switches change them
};
const ModelTraits& model_traits(ModelKind kind);
inline std::string_view model_name(ModelKind kind) {
  return model_traits(kind).name;
}
std::ostream& operator<<(std::ostream& out, ModelKind kind);  // its name
// "mlp" | "cnn" | "gpt" | "llama" (--model); throws naming the flag and the known models otherwise.
ModelKind parse_model_kind(std::string_view text);
// The kind's decoder choices (model_traits(kind).decoder).
inline DecoderChoices decoder_defaults(ModelKind kind) {
  return model_traits(kind).decoder;
}


}  // namespace tessera::nn
