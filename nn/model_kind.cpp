// The model kinds' table (nn/model_kind.h).
#include "nn/model_kind.h"

#include <ostream>
#include <string>

#include "core/error.h"

namespace tessera::nn {
namespace {

// One row per ModelKind, in the enumerators' order.
constexpr ModelTraits kModels[] = {
    {"mlp", false, true, false, "layers"},
    {"cnn", false, false, false, "layers"},
    {"gpt", true, true, true, "blocks"},
    {"llama", true, true, true, "blocks",
     {Normalization::rms_norm, /*rotary=*/true, /*swiglu=*/true, /*bias=*/false, /*untie_embeddings=*/true}},
};

}  // namespace

const ModelTraits& model_traits(ModelKind kind) {
  return kModels[size_t(kind)];
}

std::ostream& operator<<(std::ostream& out, ModelKind kind) {
  return out << model_name(kind);
}

ModelKind parse_model_kind(std::string_view text) {
  std::string known;
  for (size_t i = 0; i < std::size(kModels); ++i) {
    if (kModels[i].name == text) return ModelKind(i);
    known += std::string(i == 0 ? "" : i + 1 == std::size(kModels) ? " or " : ", ") + std::string(kModels[i].name);
  }
  TESSERA_THROW("--model '", text, "' is not a model this build knows; use ", known);
}

std::string_view normalization_name(Normalization n) {
  return n == Normalization::rms_norm ? "RMSNorm" : "LayerNorm";
}

}  // namespace tessera::nn
