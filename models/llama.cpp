// The Llama family (--model llama: Llama 2/3, Mistral, Qwen without biases):
// models/decoder.h with the Llama's choices (nn::decoder_defaults: RMSNorm,
// rotary embeddings at --rotary-base in Hugging Face's half-split pairs,
// SwiGLU of width 8/3·C rounded up to 256, no biases, an untied head) and
// grouped-query attention (--num-query-groups), whose qkv rows are always in
// Megatron's grouped layout (io/hf_llama.h maps them to q_proj/k_proj/v_proj).
// Its registry row.
#include "models/decoder.h"

namespace tessera::models {

ModelRow llama_row() {
  return decoder_row(nn::ModelKind::llama);
}

}  // namespace tessera::models
