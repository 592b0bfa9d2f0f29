// Generating text with a causal LM (models/causal_lm.h: the GPT, the Llama):
// the prompt runs through the model once, filling a KV cache
// (nn/kv_cache.h); then each new token runs alone against
// the cache, its logits (the last position's, gathered over the
// tensor-parallel group: every rank holds V/K of them) go through
// nn::sample_token, and the token chosen is fed back. Every rank of the
// group computes the same gathered logits and draws the same token, so no
// broadcast is needed and the ranks stay in step.
//
// `tessera generate` (a checkpoint, any layout it was saved under, here on
// one rank or under mpirun with --tensor-model-parallel-size) and the
// samples `tessera train --sample-interval` prints both call generate().
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "nn/sampling.h"
#include "models/causal_lm.h"

namespace tessera::models {

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  nn::SamplingOptions sampling;
  std::optional<int64_t> stop_token;  // generation ends after this token (e.g. the tokenizer's end of text)
  // false: no KV cache, the whole sequence runs through the model for every
  // token (as transformers' use_cache=False; for comparisons and benchmarks).
  bool use_cache = true;
  // Draw only ids below this (0: the whole vocabulary): the tokenizer's size
  // when the model's vocabulary is padded past it (--make-vocab-size-divisible-by),
  // whose padding ids no text has.
  int64_t vocab_limit = 0;
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // the new tokens (the stop token included when it came)
  double prompt_seconds = 0.0;  // the prompt's forward (filling the cache)
  double decode_seconds = 0.0;  // every token after the first
  int64_t cache_bytes = 0;      // this rank's KV cache
  // New tokens per second after the prompt (0 when only one was made).
  double tokens_per_second() const;
};

// Why `model` cannot generate (empty: it can): a pipeline stage that is not
// the whole model, or sequence parallelism.
std::string generation_problem(const CausalLm& model);

// Throws, naming the numbers and what fits, when `prompt` is empty, holds an
// id outside the vocabulary, or with options.max_new_tokens does not fit the
// model's --seq-length. generate() checks this first; a command can call it
// before it loads the weights.
void check_prompt(const nn::ModelConfig& config, std::span<const int32_t> prompt, const GenerationOptions& options);

// Collective over the model's tensor-parallel group (and over whatever
// group its parameter hooks gather through, e.g. ZeRO-3's data-parallel
// group: every rank of it calls this with the same arguments). The model is
// run in evaluation mode (no dropout) and left in the mode it was in.
// Throws as check_prompt does.
// `on_token` sees each new token as it is chosen.
GenerationResult generate(CausalLm& model, std::span<const int32_t> prompt, const GenerationOptions& options,
                          const std::function<void(int32_t)>& on_token = {});

// The whole vocabulary's logits of the last position of `logits` [1, T, V/K]
// (this rank's columns), f32 on the host: gathered over the model's group.
std::vector<float> last_position_logits(CausalLm& model, const Tensor& logits);

}  // namespace tessera::models
