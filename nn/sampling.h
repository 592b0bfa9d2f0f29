// Choosing the next token from a model's logits, as `tessera generate` and
// the samples printed during training do: greedy (temperature 0: the first
// largest logit), or a draw from softmax(logits / temperature) restricted to
// the top_k most likely tokens and then to the smallest set of them whose
// probability reaches top_p (nucleus sampling). The draw for the n-th
// generated token is a pure function of (seed, n) (Philox, core/rng.h), so
// the same seed gives the same text on any machine and under any layout
// that computes the same logits.
#pragma once

#include <cstdint>
#include <span>

namespace tessera::nn {

struct SamplingOptions {
  float temperature = 1.0f;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
  // Throws tessera::Error naming the flag (--temperature, --top-k, --top-p).
  void validate() const;
};

// The token chosen from `logits` (one per vocabulary entry) for the
// `draw`-th generated token.
int64_t sample_token(std::span<const float> logits, const SamplingOptions& options, uint64_t draw);

}  // namespace tessera::nn
