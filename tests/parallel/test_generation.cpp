// Generation with a KV cache (nn/kv_cache.h, models/generation.h) on one
// process: the GPT fed a sequence in chunks through the cache (a prompt,
// then single tokens and a few together) gives the logits of the whole
// sequence run at once without it; greedy generation equals argmax decoding
// recomputed without the cache from scratch at every step; a seed gives the
// same sample twice and another seed another; the model's mode is restored;
// prompts that do not fit and models that cannot generate are refused with
// the numbers; logits of the wrong rank are named before their sizes are read.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "core/context.h"
#include "nn/kv_cache.h"
#include "models/decoder.h"
#include "models/generation.h"
#include "parallel/tensor_parallel.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

nn::ModelConfig small_gpt() {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::gpt;
  m.vocab_size = 97;
  m.seq_length = 24;
  m.num_layers = 2;
  m.num_heads = 2;
  m.hidden_size = 32;
  m.dropout = 0.1f;  // generation must switch it off
  return m;
}

std::vector<int32_t> random_ids(std::mt19937_64& rng, size_t n, int64_t vocab) {
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = int32_t(rng() % uint64_t(vocab));
  return ids;
}

// GPT-2's initialisation makes a model whose argmax mostly repeats the
// current token; weights of a larger spread make every part (positions
// included) decide the next token, as training does.
void spread_weights(nn::Module& model, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (nn::Parameter* p : model.parameters()) {
    float* values = p->value.data<float>();
    for (int64_t i = 0; i < p->value.numel(); ++i) values[i] = normal(rng);
  }
}

// The Llama with 2 key/value groups of 2 query heads (its cache holds 2 heads).
nn::ModelConfig small_llama() {
  nn::ModelConfig m = small_gpt();
  m.kind = nn::ModelKind::llama;
  m.num_heads = 4;
  m.num_query_groups = 2;
  m.rotary_base = 500000.0f;
  return m;
}

// The whole model (no tensor-parallel group) with spread weights.
std::unique_ptr<models::CausalLm> spread_model(Context& ctx, const nn::ModelConfig& m, std::mt19937_64& rng) {
  std::unique_ptr<nn::Module> built = models::model_row(m.kind).build(
      m, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, rng()}, parallel::TensorParallelism{}, nn::StageLayers{});
  std::unique_ptr<models::CausalLm> model(dynamic_cast<models::CausalLm*>(built.release()));
  spread_weights(*model, rng);
  return model;
}
std::unique_ptr<models::CausalLm> spread_gpt(Context& ctx, const nn::ModelConfig& m, std::mt19937_64& rng) {
  return spread_model(ctx, m, rng);
}

// Logits [T, V] of the whole sequence, no cache, evaluation mode.
std::vector<float> whole_sequence_logits(Context& ctx, nn::Module& model, const std::vector<int32_t>& ids) {
  model.train(false);
  nn::Saved saved;
  const Tensor logits = model.forward(ctx.from_vector(Shape{1, int64_t(ids.size())}, ids), saved, nn::Pass{});
  return logits.to_vector<float>();
}

void expect_cache_chunks_give_whole_sequence_logits(const nn::ModelConfig& m) {
  Context ctx;
  auto rng = make_rng();
  const auto owned = spread_model(ctx, m, rng);
  models::CausalLm& model = *owned;
  const std::vector<int32_t> ids = random_ids(rng, size_t(m.seq_length), m.vocab_size);
  const std::vector<float> expected = whole_sequence_logits(ctx, model, ids);

  nn::KvCache cache(ctx, Device::cpu(), DType::f32, 1, m.seq_length);
  nn::Pass pass;
  pass.kv_cache = &cache;
  std::vector<float> got;
  for (const int64_t n : {7, 1, 1, 3, 1, 5, 1, 2, 1, 1, 1}) {
    const std::vector<int32_t> chunk(ids.begin() + cache.position(), ids.begin() + cache.position() + n);
    nn::Saved saved;
    const std::vector<float> logits =
        model.forward(ctx.from_vector(Shape{1, n}, chunk), saved, pass).to_vector<float>();
    got.insert(got.end(), logits.begin(), logits.end());
    cache.advance(n);
  }
  ASSERT_EQ(cache.position(), m.seq_length);
  std::vector<double> want(expected.begin(), expected.end());
  EXPECT_TRUE(all_close(std::vector<double>(got.begin(), got.end()), want, Tolerance{1e-4, 1e-5}));
  // Per layer: keys and values of the key/value heads (the GPT's heads, the Llama's groups) at every position.
  const int64_t kv_heads = m.kind == nn::ModelKind::llama ? m.query_groups() : m.num_heads;
  EXPECT_EQ(cache.bytes(), m.num_layers * 2 * kv_heads * m.seq_length * (m.hidden_size / m.num_heads) * 4);
}

TEST(Generation, ChunksThroughTheCacheGiveTheWholeSequencesLogits) {
  TESSERA_SEED_TRACE();
  expect_cache_chunks_give_whole_sequence_logits(small_gpt());
}

TEST(Generation, LlamaChunksThroughTheCacheOfItsGroupsGiveTheWholeSequencesLogits) {
  TESSERA_SEED_TRACE();
  expect_cache_chunks_give_whole_sequence_logits(small_llama());
}

void expect_greedy_equals_argmax_without_cache(const nn::ModelConfig& m) {
  Context ctx;
  auto rng = make_rng();
  const auto owned = spread_model(ctx, m, rng);
  models::CausalLm& model = *owned;
  const std::vector<int32_t> prompt = random_ids(rng, 5, m.vocab_size);
  models::GenerationOptions options;
  options.max_new_tokens = m.seq_length - 5 + 1;  // the last position's logits choose the last token
  options.sampling.temperature = 0.0f;
  model.train(true);
  std::vector<int32_t> streamed;
  const models::GenerationResult result =
      models::generate(model, prompt, options, [&](int32_t token) { streamed.push_back(token); });
  EXPECT_TRUE(model.training()) << "generate must leave the model in the mode it found";
  EXPECT_EQ(streamed, result.tokens);

  std::vector<int32_t> sequence = prompt, reference;
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    const std::vector<float> logits = whole_sequence_logits(ctx, model, sequence);
    const auto last = logits.end() - m.vocab_size;
    reference.push_back(int32_t(std::max_element(last, logits.end()) - last));
    sequence.push_back(reference.back());
  }
  EXPECT_EQ(result.tokens, reference);
  options.use_cache = false;  // the library's own recomputing path agrees too
  EXPECT_EQ(models::generate(model, prompt, options).tokens, reference);
}

TEST(Generation, GreedyEqualsArgmaxRecomputedWithoutTheCache) {
  TESSERA_SEED_TRACE();
  expect_greedy_equals_argmax_without_cache(small_gpt());
}

TEST(Generation, LlamaGreedyEqualsArgmaxRecomputedWithoutTheCache) {
  TESSERA_SEED_TRACE();
  expect_greedy_equals_argmax_without_cache(small_llama());
}

// A vocabulary padded past the tokenizer's (--make-vocab-size-divisible-by):
// the padding ids are never drawn, even when their logits are the largest.
TEST(Generation, PaddingIdsOfTheVocabularyAreNeverDrawn) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const nn::ModelConfig m = small_gpt();
  const auto owned = spread_model(ctx, m, rng);
  models::CausalLm& model = *owned;
  const std::vector<int32_t> prompt = random_ids(rng, 3, m.vocab_size);
  models::GenerationOptions options;
  options.max_new_tokens = 16;
  options.sampling = nn::SamplingOptions{2.0f, 0, 1.0f, rng()};  // hot: every id has a chance
  const int64_t limit = 5;
  bool drawn_above = false;
  for (const int32_t token : models::generate(model, prompt, options).tokens) drawn_above |= token >= limit;
  EXPECT_TRUE(drawn_above) << "the unlimited draw should reach ids past " << limit << " (seed)";
  options.vocab_limit = limit;
  for (const int32_t token : models::generate(model, prompt, options).tokens) EXPECT_LT(token, limit);
}

TEST(Generation, TheSameSeedGivesTheSameSample) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const nn::ModelConfig m = small_gpt();
  const auto owned = spread_gpt(ctx, m, rng);
  models::CausalLm& model = *owned;
  const std::vector<int32_t> prompt = random_ids(rng, 3, m.vocab_size);
  models::GenerationOptions options;
  options.max_new_tokens = 16;
  options.sampling = nn::SamplingOptions{1.5f, 40, 0.95f, rng()};
  const std::vector<int32_t> first = models::generate(model, prompt, options).tokens;
  EXPECT_EQ(models::generate(model, prompt, options).tokens, first);
  models::GenerationOptions stopping = options;
  stopping.stop_token = first[3];
  const std::vector<int32_t> stopped = models::generate(model, prompt, stopping).tokens;
  options.sampling.seed += 1;
  EXPECT_NE(models::generate(model, prompt, options).tokens, first);
  const auto at = std::find(first.begin(), first.end(), first[3]);
  EXPECT_EQ(stopped, std::vector<int32_t>(first.begin(), at + 1)) << "generation ends after the stop token";
}

TEST(Generation, WhatDoesNotFitIsRefusedWithTheNumbers) {
  Context ctx;
  const nn::ModelConfig m = small_gpt();
  models::Decoder model(m, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 7}, {});
  models::GenerationOptions options;
  options.max_new_tokens = 20;
  const std::vector<int32_t> prompt(10, 1);
  EXPECT_CONTAINS(error_of([&] { models::generate(model, prompt, options); }),
                  "need 29 positions, but the model was trained with --seq-length 24; ask for at most 15 new tokens");
  EXPECT_CONTAINS(error_of([&] {
                    models::generate(model, std::vector<int32_t>{3, 97}, options);
                  }),
                  "prompt token 1 is 97, outside the model's vocabulary of 97");
  EXPECT_CONTAINS(error_of([&] { models::generate(model, std::vector<int32_t>{}, options); }), "prompt is empty");
  nn::StageLayers first_stage;
  first_stage.stages = 2;
  first_stage.end = 1;
  models::Decoder stage(m, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 7}, {}, first_stage);
  EXPECT_CONTAINS(error_of([&] { models::generate(stage, prompt, options); }), "--pipeline-parallel 1");
}

// Logits of the wrong rank are named as such before any of their sizes is
// read (a [V] or [T, V] tensor has no size(2): that read would be the error).
TEST(Generation, LogitsOfTheWrongRankAreNamedBeforeTheirSizesAreRead) {
  Context ctx;
  models::Decoder model(small_gpt(), nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 7}, {});
  for (const Shape& shape : {Shape{97}, Shape{5, 97}, Shape{2, 5, 97}, Shape{1, 5, 97, 1}}) {
    const Tensor logits = ctx.zeros(shape, DType::f32);
    EXPECT_CONTAINS(error_of([&] { models::last_position_logits(model, logits); }),
                    "expected logits [1, T, V], got " + shape.to_string());
  }
}

}  // namespace
}  // namespace tessera::testing
