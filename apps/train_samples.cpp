// TrainingSamples (apps/train_samples.h): the checks at start-up, then
// models::generate at each due step.
#include "apps/train_samples.h"

#include "core/error.h"
#include "models/generation.h"

namespace tessera::app {
namespace {

io::Tokenizer data_tokenizer(const TrainConfig& c, int64_t vocab_size) {
  TESSERA_CHECK(!c.data.empty(),
                "--sample-interval: samples are decoded with --data's tokenizer, and --synthetic "
                "data has none; drop --sample-interval");
  std::optional<io::Tokenizer> tokenizer = io::Tokenizer::for_model_data(c.data, vocab_size);
  TESSERA_CHECK(tokenizer.has_value(), "--sample-interval: ", c.data,
                " stores no tokenizer (its tokens came from another tool), so samples cannot be decoded; prepare "
                "the text with `tessera prepare text --tokenizer bpe`, or drop --sample-interval");
  return std::move(*tokenizer);
}

}  // namespace

TrainingSamples::TrainingSamples(const TrainConfig& c, models::CausalLm* model) : config_(c) {
  if (c.sample_interval == 0) return;
  model_ = model;
  TESSERA_CHECK(model_ != nullptr, "--sample-interval: only a language model generates text (--model gpt or llama)");
  const std::string problem = models::generation_problem(*model_);
  TESSERA_CHECK(problem.empty(), "--sample-interval: ", problem);
  tokenizer_ = data_tokenizer(c, model_->config().vocab_size);
  prompt_ = tokenizer_->encode(c.sample_prompt);
  TESSERA_CHECK(!prompt_.empty(), "--sample-prompt is empty; give the text samples continue (--sample-prompt \"The\")");
  const int64_t positions = int64_t(prompt_.size()) + c.sample_tokens - 1;
  TESSERA_CHECK(positions <= c.seq_length, "--sample-prompt (", prompt_.size(), " tokens) and --sample-tokens ",
                c.sample_tokens, " need ", positions, " positions, more than --seq-length ", c.seq_length,
                "; ask for at most ", std::max<int64_t>(c.seq_length - int64_t(prompt_.size()) + 1, 0),
                " tokens or shorten the prompt");
}

bool TrainingSamples::due(int64_t step, bool last) const {
  return model_ != nullptr && (last || step % config_.sample_interval == 0);
}

std::string TrainingSamples::sample(int64_t step) {
  models::GenerationOptions options;
  options.max_new_tokens = config_.sample_tokens;
  options.sampling.temperature = config_.sample_temperature;
  options.sampling.top_k = config_.sample_top_k;
  options.sampling.seed = config_.seed + uint64_t(step);  // a new draw each time, reproducible
  options.vocab_limit = tokenizer_->vocab_size();  // not the padding of --make-vocab-size-divisible-by
  const models::GenerationResult result = models::generate(*model_, prompt_, options);
  return "sample at step " + std::to_string(step) + ": " + tokenizer_->decode(prompt_) +
         tokenizer_->decode(result.tokens);
}

}  // namespace tessera::app
