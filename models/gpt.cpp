// The GPT (--model gpt): GPT-2's decoder, models/decoder.h with GPT-2's
// choices (nn::decoder_defaults: LayerNorm, learned positions, a GELU MLP,
// biases, the head tied to the embedding), each of which Megatron's switches
// change on their own. Its registry row.
#include "models/decoder.h"

namespace tessera::models {

ModelRow gpt_row() {
  return decoder_row(nn::ModelKind::gpt);
}

}  // namespace tessera::models
