// generate (models/generation.h): the prompt, then one token at a time
// against the KV cache, each chosen from the gathered last-position logits.
#include "models/generation.h"

#include <chrono>
#include <string>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "nn/kv_cache.h"

namespace tessera::models {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Puts the model in evaluation mode for a scope, then back.
class EvaluationMode {
 public:
  explicit EvaluationMode(nn::Module& model) : model_(model), was_training_(model.training()) { model_.train(false); }
  ~EvaluationMode() { model_.train(was_training_); }
  EvaluationMode(const EvaluationMode&) = delete;
  EvaluationMode& operator=(const EvaluationMode&) = delete;

 private:
  nn::Module& model_;
  bool was_training_;
};

// ids [1, n] on the model's device.
Tensor token_ids(const nn::Module& model, std::span<const int32_t> ids) {
  Tensor host = model.context().empty(Shape{1, int64_t(ids.size())}, DType::i32, Device::cpu());
  std::copy(ids.begin(), ids.end(), host.data<int32_t>());
  return host.to(model.spec().device);
}

}  // namespace

void check_prompt(const nn::ModelConfig& config, std::span<const int32_t> prompt, const GenerationOptions& options) {
  TESSERA_CHECK(!prompt.empty(), "generate: the prompt is empty; give at least one token");
  TESSERA_CHECK(options.max_new_tokens >= 0, "--max-new-tokens must be 0 or more, got ", options.max_new_tokens);
  for (size_t i = 0; i < prompt.size(); ++i)
    TESSERA_CHECK(prompt[i] >= 0 && prompt[i] < config.vocab_size, "generate: prompt token ", i, " is ", prompt[i],
                  ", outside the model's vocabulary of ", config.vocab_size, " (ids 0 to ", config.vocab_size - 1, ")");
  const int64_t tokens = int64_t(prompt.size()), context = config.seq_length;
  const int64_t more_positions = std::max<int64_t>(options.max_new_tokens - 1, 0);  // the last new token needs none
  const int64_t prompt_room = context - more_positions;  // prompt tokens that fit with --max-new-tokens
  const std::string with_new_tokens = prompt_room >= 1 && prompt_room < context
                                          ? " (" + std::to_string(prompt_room) +
                                                " to leave room for --max-new-tokens " +
                                                std::to_string(options.max_new_tokens) + ")"
                                          : "";
  TESSERA_CHECK(tokens <= context, "generate: the prompt's ", tokens, " tokens do not fit the model's context of ",
                context, " positions (it was trained with --seq-length ", context, "); shorten the prompt to at most ",
                context, " tokens", with_new_tokens);
  TESSERA_CHECK(tokens + more_positions <= context, "generate: the prompt's ", tokens, " tokens and --max-new-tokens ",
                options.max_new_tokens, " need ", tokens + more_positions,
                " positions, but the model was trained with --seq-length ", context, "; ask for at most ",
                context - tokens + 1, " new tokens",
                prompt_room >= 1 ? " or shorten the prompt to at most " + std::to_string(prompt_room) + " tokens" : "");
}

double GenerationResult::tokens_per_second() const {
  return tokens.size() > 1 && decode_seconds > 0.0 ? double(tokens.size() - 1) / decode_seconds : 0.0;
}

std::string generation_problem(const CausalLm& model) {
  if (!model.stage().first() || !model.stage().last())
    return "generation needs the whole model on each tensor-parallel group (--pipeline-parallel 1)";
  if (model.parallelism().sequence_parallel && model.parallelism().size() > 1)
    return "generation runs one token at a time, which --sequence-parallel cannot split; generate without it";
  return {};
}

std::vector<float> last_position_logits(CausalLm& model, const Tensor& logits) {
  TESSERA_CHECK(logits.ndim() == 3 && logits.size(0) == 1, "generate: expected logits [1, T, V], got ",
                logits.shape().to_string());
  const int64_t tokens = logits.size(1), local_vocab = logits.size(2);
  const Tensor last = logits.view(Shape{tokens, local_vocab}).slice(tokens - 1, tokens).view(Shape{local_vocab});
  Tensor local = last;
  if (last.dtype() != DType::f32) {
    local = model.context().empty(Shape{local_vocab}, DType::f32, last.device());
    ops::cast(last, local);
  }
  parallel::Communicator* group = model.parallelism().group;
  if (!group || group->size() == 1) return local.to(Device::cpu()).to_vector<float>();
  Tensor whole = model.context().empty(Shape{local_vocab * group->size()}, DType::f32, last.device());
  group->all_gather(local, whole)->wait();
  return whole.to(Device::cpu()).to_vector<float>();
}

GenerationResult generate(CausalLm& model, std::span<const int32_t> prompt, const GenerationOptions& options,
                          const std::function<void(int32_t)>& on_token) {
  const std::string problem = generation_problem(model);
  TESSERA_CHECK(problem.empty(), "generate: ", problem);
  options.sampling.validate();
  check_prompt(model.config(), prompt, options);
  GenerationResult result;
  if (options.max_new_tokens == 0) return result;

  const EvaluationMode evaluation(model);
  const int64_t capacity = int64_t(prompt.size()) + options.max_new_tokens - 1;
  nn::KvCache cache(model.context(), model.spec().device, model.spec().dtype, 1, capacity);
  nn::Pass pass;
  if (options.use_cache) pass.kv_cache = &cache;
  std::vector<int32_t> sequence(prompt.begin(), prompt.end());  // what runs next without a cache
  Tensor ids = token_ids(model, prompt);
  Clock::time_point start = Clock::now();
  while (true) {
    Tensor logits;
    {
      nn::Saved saved;  // inference: whatever the forward keeps is dropped at once
      logits = model.forward(ids, saved, pass);
    }
    if (options.use_cache) cache.advance(ids.size(1));
    std::vector<float> candidates = last_position_logits(model, logits);
    if (options.vocab_limit > 0 && options.vocab_limit < int64_t(candidates.size()))
      candidates.resize(size_t(options.vocab_limit));  // the padding ids of the vocabulary are never drawn
    const int64_t token = nn::sample_token(candidates, options.sampling, result.tokens.size());
    if (result.tokens.empty()) {
      result.prompt_seconds = seconds_since(start);
      start = Clock::now();
    }
    result.tokens.push_back(int32_t(token));
    if (on_token) on_token(int32_t(token));
    if (int64_t(result.tokens.size()) == options.max_new_tokens || token == options.stop_token) break;
    const int32_t next = int32_t(token);
    sequence.push_back(next);
    ids = options.use_cache ? token_ids(model, std::span<const int32_t>(&next, 1)) : token_ids(model, sequence);
  }
  result.decode_seconds = seconds_since(start);
  result.cache_bytes = cache.bytes();
  return result;
}

}  // namespace tessera::models
