// After training, end to end through the `tessera` binary: text prepared with
// a BPE tokenizer, a GPT trained on 2 ranks (tp 2) printing samples as it
// goes; `tessera generate` greedy output equals argmax decoding recomputed in
// this test without a KV cache from the checkpoint (library calls, the whole
// sequence each step), on 1 rank and as a tensor-parallel pair; a seeded
// sample is the same text on 1 and 2 ranks; the hf-gpt2 export's vocab.json
// and merges.txt encode as the dataset's tokenizer. --init-from: export → init-from
// (under tp 2, and pipeline 2 from a Hugging Face directory) → export gives
// the same bytes; a file of another model is refused naming tensor and
// shapes. What cannot run (a prompt id outside the vocabulary, a prompt
// longer than the context, a rank count the model does not split over, a
// --tokenizer that is no dataset) is refused before the weights are read:
// with a damaged tensor in the checkpoint, the message is still about it.
// A checkpoint of context-parallel ranks generates without them.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "io/model_weights.h"
#include "io/tokenizer.h"
#include "models/stage_model.h"
#include "tests/io/io_test_files.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

std::vector<std::string> generate_command(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {TESSERA_MPIEXEC, "-np",  std::to_string(ranks), "--oversubscribe",
                                   "--bind-to",     "none", TESSERA_BINARY,        "generate"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// What generate printed on stdout: the output without its "generate: ...\n"
// reports on stderr (which mpirun may forward into the middle of a line).
std::string generated(std::string output) {
  for (size_t at; (at = output.find("generate: ")) != std::string::npos;)
    output.erase(at, output.find('\n', at) + 1 - at);
  return output;
}

std::vector<int32_t> ids_of(const std::string& text) {
  std::istringstream in(text);
  return std::vector<int32_t>(std::istream_iterator<int32_t>(in), std::istream_iterator<int32_t>());
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Greedy decoding of `count` tokens after `prompt` without a cache: the
// checkpoint's GPT (whole, on this process) runs the whole sequence each step.
std::vector<int32_t> argmax_without_cache(const std::string& checkpoint, std::vector<int32_t> sequence, int count) {
  Context ctx;
  const io::CheckpointReader reader(checkpoint);
  const io::CheckpointModel saved = io::checkpoint_model(reader);
  auto model = models::build_model(saved.config, nn::ModelSpec{&ctx, Device::cpu(), saved.dtype, 0});
  io::read_parameters(reader, model->parameters());
  model->train(false);
  const size_t prompt = sequence.size();
  for (int i = 0; i < count; ++i) {
    nn::Saved saved_state;
    const std::vector<float> logits =
        model->forward(ctx.from_vector(Shape{1, int64_t(sequence.size())}, sequence), saved_state, nn::Pass{})
            .to_vector<float>();
    const auto last = logits.end() - saved.config.vocab_size;
    sequence.push_back(int32_t(std::max_element(last, logits.end()) - last));
  }
  return std::vector<int32_t>(sequence.begin() + long(prompt), sequence.end());
}

// Two of Debian's fortune files (empty when fortunes is not installed).
std::vector<std::string> fortune_files() {
  std::vector<std::string> corpus;
  for (const char* name : {"computers", "science"})
    if (fs::is_regular_file(std::string("/usr/share/games/fortunes/") + name))
      corpus.push_back(std::string("/usr/share/games/fortunes/") + name);
  return corpus;
}

// `tessera generate --temperature 0` of the checkpoint (dir/ckpt, whose
// last step is `checkpoint`) on 1 and 2 ranks: the prompt and then what
// argmax without a cache gives, `count` tokens (`prompt`: "The computer " encoded).
void expect_greedy_on_one_and_two_ranks_equals_argmax(const ScratchDirectory& dir, const std::string& checkpoint,
                                                       const std::vector<int32_t>& prompt, int count) {
  const std::vector<int32_t> reference = argmax_without_cache(checkpoint, prompt, count);
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)");
    const Outcome greedy = run_command(
        generate_command(ranks, {dir / "ckpt", "--prompt", "The computer ", "--temperature", "0", "--max-new-tokens",
                                 std::to_string(count), "--print-ids", "--threads", "1"}),
        dir / "greedy.log", seconds(120));
    ASSERT_EQ(greedy.status, 0) << greedy.output;
    std::vector<int32_t> expected = prompt;
    expected.insert(expected.end(), reference.begin(), reference.end());
    EXPECT_EQ(ids_of(generated(greedy.output)), expected) << greedy.output;
    EXPECT_TRUE(contains(greedy.output, "generate: " + std::to_string(count) + " tokens")) << greedy.output;
    EXPECT_TRUE(contains(greedy.output, "KV cache")) << greedy.output;
  }
}

TEST(Generate, GreedyEqualsArgmaxWithoutTheCacheAndTensorParallelSamplesTheSameText) {
  TESSERA_SEED_TRACE();
  const std::vector<std::string> corpus = fortune_files();
  if (corpus.empty()) GTEST_SKIP() << "Debian's fortunes is missing: run scripts/install-deps.sh";
  ScratchDirectory dir("tessera_generate_");
  const Outcome prepared = run_command(
      joined({TESSERA_BINARY, "prepare", "text", "--tokenizer", "bpe", "--vocab-size", "384", "-o", dir / "text.h5"},
             corpus),
      dir / "prepare.log", seconds(120));
  ASSERT_EQ(prepared.status, 0) << prepared.output;

  const std::string train = run_training(
      2,
      words("--model gpt --data " + (dir / "text.h5") +
            " --vocab-size 384 --seq-length 64 --num-layers 2 --num-heads 4 --hidden-size 64 --micro-batch-size 8 "
            "--tp 2 --train-steps 40 --lr 3e-3 --warmup-steps 5 --threads 1 --sample-interval 20 --sample-tokens 24 "
            "--sample-prompt The --seed " +
            std::to_string(test_seed() % 1000) + " --save " + (dir / "ckpt")),
      dir / "train.log");
  EXPECT_TRUE(contains(train, "sample at step 20: The")) << train;
  EXPECT_TRUE(contains(train, "sample at step 40: The")) << train;
  const std::string checkpoint = dir / "ckpt/step_00000040";

  const std::optional<io::Tokenizer> tokenizer = io::Tokenizer::load(dir / "text.h5");
  ASSERT_TRUE(tokenizer.has_value());
  const std::vector<int32_t> prompt = tokenizer->encode("The computer ");
  expect_greedy_on_one_and_two_ranks_equals_argmax(dir, checkpoint, prompt, 30);

  // The export carries the tokenizer as GPT-2's files, which encode as the dataset's does.
  const Outcome exported =
      run_command({TESSERA_BINARY, "export", dir / "ckpt", "-o", dir / "hf/model.safetensors", "--format", "hf-gpt2"},
                  dir / "export.log", seconds(60));
  ASSERT_EQ(exported.status, 0) << exported.output;
  EXPECT_TRUE(contains(exported.output, "wrote " + (dir / "hf/merges.txt"))) << exported.output;
  const io::Tokenizer exported_tokenizer = io::Tokenizer::from_gpt2_files(dir / "hf/vocab.json", dir / "hf/merges.txt");
  EXPECT_EQ(exported_tokenizer.vocab_size(), tokenizer->vocab_size());
  for (const char* text : {"The computer ", "Science is what we understand well enough to explain.\n"})
    EXPECT_EQ(exported_tokenizer.encode(text), tokenizer->encode(text)) << text;

  std::string one_rank;
  for (const int ranks : {1, 2}) {
    const Outcome sampled = run_command(
        generate_command(ranks, {dir / "ckpt", "--prompt", "The ", "--temperature", "0.9", "--top-k", "50", "--top-p",
                                 "0.95", "--seed", "11", "--max-new-tokens", "40", "--threads", "1"}),
        dir / "sample.log", seconds(120));
    ASSERT_EQ(sampled.status, 0) << sampled.output;
    const std::string text = generated(sampled.output);
    EXPECT_EQ(text.rfind("The ", 0), 0u) << text;
    if (ranks == 1)
      one_rank = text;
    else
      EXPECT_EQ(text, one_rank) << "the same seed must give the same text on 1 and 2 ranks";
  }
}

fs::path hf_python() {
  const char* tools = std::getenv("TESSERA_TOOLS_DIR");
  return fs::path(tools && *tools ? tools : "/opt/tessera-tools") / "hf" / "bin" / "python";
}

// The logits [T, V] of the checkpoint's model (whole, on this process) for `ids`.
std::vector<double> checkpoint_logits(const std::string& checkpoint, const std::vector<int32_t>& ids) {
  Context ctx;
  const io::CheckpointReader reader(checkpoint);
  const io::CheckpointModel saved = io::checkpoint_model(reader);
  auto model = models::build_model(saved.config, nn::ModelSpec{&ctx, Device::cpu(), saved.dtype, 0});
  io::read_parameters(reader, model->parameters());
  model->train(false);
  nn::Saved state;
  return model->forward(ctx.from_vector(Shape{1, int64_t(ids.size())}, ids), state, nn::Pass{}).to_doubles();
}

// The README's loop for the Llama, under tensor parallelism: BPE text whose
// vocabulary (300) is padded to 384, a Llama (2 key/value groups of 2 query
// heads) trained on 2 ranks with samples; greedy generation on 1 and 2 ranks
// equal to argmax without the cache; the hf-llama export loaded by
// transformers (nothing missing, its logits Tessera's, its tokenizer's ids
// the dataset's); the export loaded back with --init-from under pp 2 equal to
// the checkpoint, and a flag that disagrees with its config.json refused.
TEST(Generate, LlamaTrainsWithSamplesGeneratesAndGoesToHuggingFaceAndBack) {
  TESSERA_SEED_TRACE();
  if (!fs::exists(hf_python()))
    GTEST_SKIP() << "no transformers in " << hf_python() << ": run scripts/install-deps.sh (scripts/install-hf.sh)";
  const std::vector<std::string> corpus = fortune_files();
  if (corpus.empty()) GTEST_SKIP() << "Debian's fortunes is missing: run scripts/install-deps.sh";
  ScratchDirectory dir("tessera_llama_loop_");
  const Outcome prepared = run_command(
      joined({TESSERA_BINARY, "prepare", "text", "--tokenizer", "bpe", "--vocab-size", "300", "-o", dir / "text.h5"},
             corpus),
      dir / "prepare.log", seconds(120));
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const std::string model =
      "--model llama --seq-length 64 --num-layers 2 --num-heads 4 --group-query-attention --num-query-groups 2 "
      "--hidden-size 64 --ffn-hidden-size 96 --rotary-base 500000 --micro-batch-size 8 --threads 1 ";
  const std::string train = run_training(
      2,
      words(model + "--data " + (dir / "text.h5") +
            " --tp 2 --train-steps 30 --lr 3e-3 --warmup-steps 5 --sample-interval 15 --sample-tokens 24 "
            "--sample-temperature 1.5 --sample-prompt The --seed " + std::to_string(test_seed() % 1000) +
            " --save " + (dir / "ckpt")),
      dir / "train.log");
  EXPECT_TRUE(contains(train, "vocabulary: 384 from " + (dir / "text.h5") + " (its 300 tokens padded")) << train;
  EXPECT_TRUE(contains(train, "sample at step 15: The")) << train;
  EXPECT_TRUE(contains(train, "sample at step 30: The")) << train;
  const std::string checkpoint = dir / "ckpt/step_00000030";

  const std::optional<io::Tokenizer> tokenizer = io::Tokenizer::load(dir / "text.h5");
  ASSERT_TRUE(tokenizer.has_value());
  const std::vector<int32_t> prompt = tokenizer->encode("The computer ");
  expect_greedy_on_one_and_two_ranks_equals_argmax(dir, checkpoint, prompt, 20);

  const Outcome exported = run_command(
      {TESSERA_BINARY, "export", dir / "ckpt", "-o", dir / "hf", "--format", "hf-llama", "--max-shard-size", "100KB"},
      dir / "export.log", seconds(60));
  ASSERT_EQ(exported.status, 0) << exported.output;
  ASSERT_TRUE(fs::exists(dir / "hf/model.safetensors.index.json")) << exported.output;
  std::string ids_text;
  for (const int32_t id : prompt) ids_text += (ids_text.empty() ? "" : ",") + std::to_string(id);
  const Outcome loaded = run_command({hf_python().string(), TESSERA_HF_LLAMA_SCRIPT, "load", dir / "hf", "--json",
                                      dir / "hf.json", "--ids", ids_text, "--text", "The computer "},
                                     dir / "load.log", seconds(300));
  ASSERT_EQ(loaded.status, 0) << loaded.output;
  const nlohmann::json printed = nlohmann::json::parse(std::ifstream(dir / "hf.json"));
  EXPECT_TRUE(printed["missing"].empty() && printed["unexpected"].empty()) << printed["missing"].dump();
  std::vector<double> theirs;
  for (const auto& row : printed["logits"]) {
    const std::vector<double> values = row.get<std::vector<double>>();
    theirs.insert(theirs.end(), values.begin(), values.end());
  }
  EXPECT_TRUE(all_close(theirs, checkpoint_logits(checkpoint, prompt), Tolerance{2e-4, 2e-4}));
  EXPECT_EQ(printed["tokenizer"]["ids"].get<std::vector<int32_t>>(), prompt) << printed["tokenizer"].dump();

  // And back: the export under two pipeline stages, its tensors the checkpoint's.
  const std::string back = run_training(
      2, words(model + "--synthetic --pp 2 --global-batch-size 16 --train-steps 0 --init-from " + (dir / "hf") +
               " --save " + (dir / "back")),
      dir / "back.log");
  EXPECT_TRUE(contains(back, "init-from: " + (dir / "hf"))) << back;
  const io::CheckpointReader original(checkpoint), round_trip(dir / "back/step_00000000");
  for (const io::StoredTensor& t : original.tensors()) {
    if (t.name.find("exp_avg") != std::string::npos || !round_trip.has_tensor(t.name)) continue;
    Context ctx;
    EXPECT_EQ(read_whole(ctx, round_trip, t).to_doubles(), read_whole(ctx, original, t).to_doubles()) << t.name;
  }
  const Outcome disagree = run_command(
      tessera_command(1, words(model + "--synthetic --hidden-size 128 --train-steps 1 --init-from " + (dir / "hf"))),
      dir / "disagree.log", seconds(60));
  EXPECT_NE(disagree.status, 0);
  EXPECT_TRUE(contains(disagree.output, "--hidden-size 128 disagrees with hidden_size 64 in " + (dir / "hf/config.json")))
      << disagree.output;
}

// A Llama with 4 experts in every block (top-2) trained with its experts
// split over 2 ranks (--ep 2): greedy generation from the checkpoint on 1 and
// 2 ranks equals argmax without the cache; --format hf-llama refused naming
// hf-mixtral; the hf-mixtral export loaded by transformers'
// MixtralForCausalLM (nothing missing, its logits Tessera's); and back with
// --init-from under ep 2, each rank reading its experts, every tensor the
// checkpoint's; a flag that disagrees with its config.json refused.
TEST(Generate, MixtureOfExpertsTrainsUnderExpertParallelismGeneratesAndGoesToMixtralAndBack) {
  TESSERA_SEED_TRACE();
  if (!fs::exists(hf_python()))
    GTEST_SKIP() << "no transformers in " << hf_python() << ": run scripts/install-deps.sh (scripts/install-hf.sh)";
  ScratchDirectory dir("tessera_mixtral_loop_");
  const std::string llama =
      "--model llama --seq-length 32 --num-layers 2 --num-heads 4 --group-query-attention --num-query-groups 2 "
      "--hidden-size 32 --ffn-hidden-size 48 --vocab-size 64 --micro-batch-size 4 --threads 1 --synthetic ";
  const std::string model = llama + "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 40 ";
  const std::string train = run_training(
      2,
      words(model + "--ep 2 --moe-aux-loss-coeff 0.01 --train-steps 6 --lr 3e-3 --seed " +
            std::to_string(test_seed() % 1000) + " --save " + (dir / "ckpt")),
      dir / "train.log");
  EXPECT_TRUE(contains(train, "ep=2")) << train;
  const std::string checkpoint = dir / "ckpt/step_00000006";
  const std::vector<int32_t> prompt = {5, 17, 3, 42};
  const std::vector<int32_t> reference = argmax_without_cache(checkpoint, prompt, 12);
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)");
    const Outcome greedy = run_command(generate_command(ranks, {dir / "ckpt", "--prompt-ids", "5,17,3,42",
                                                                "--temperature", "0", "--max-new-tokens", "12",
                                                                "--print-ids", "--threads", "1"}),
                                       dir / "greedy.log", seconds(120));
    ASSERT_EQ(greedy.status, 0) << greedy.output;
    std::vector<int32_t> expected = prompt;
    expected.insert(expected.end(), reference.begin(), reference.end());
    EXPECT_EQ(ids_of(generated(greedy.output)), expected) << greedy.output;
  }

  const Outcome as_llama = run_command({TESSERA_BINARY, "export", dir / "ckpt", "-o", dir / "llama", "--format",
                                        "hf-llama"},
                                       dir / "as_llama.log", seconds(60));
  EXPECT_NE(as_llama.status, 0);
  EXPECT_TRUE(contains(as_llama.output, "experts (--num-experts), which LlamaForCausalLM does not have; export it "
                                        "with --format hf-mixtral"))
      << as_llama.output;
  const Outcome exported = run_command(
      {TESSERA_BINARY, "export", dir / "ckpt", "-o", dir / "hf", "--format", "hf-mixtral", "--max-shard-size", "60KB"},
      dir / "export.log", seconds(60));
  ASSERT_EQ(exported.status, 0) << exported.output;
  ASSERT_TRUE(fs::exists(dir / "hf/model.safetensors.index.json")) << exported.output;
  const Outcome loaded = run_command({hf_python().string(), TESSERA_HF_LLAMA_SCRIPT, "load", dir / "hf", "--json",
                                      dir / "hf.json", "--ids", "5,17,3,42"},
                                     dir / "load.log", seconds(300));
  ASSERT_EQ(loaded.status, 0) << loaded.output;
  const nlohmann::json printed = nlohmann::json::parse(std::ifstream(dir / "hf.json"));
  EXPECT_EQ(printed["class"], "MixtralForCausalLM");
  EXPECT_TRUE(printed["missing"].empty() && printed["unexpected"].empty() && printed["mismatched"].empty())
      << printed["missing"].dump() << printed["unexpected"].dump();
  EXPECT_EQ(printed["config"]["num_local_experts"], 4);
  EXPECT_EQ(printed["config"]["num_experts_per_tok"], 2);
  EXPECT_EQ(printed["config"]["intermediate_size"], 40);
  EXPECT_EQ(printed["config"]["router_aux_loss_coef"], 0.01);
  std::vector<double> theirs;
  for (const auto& row : printed["logits"]) {
    const std::vector<double> values = row.get<std::vector<double>>();
    theirs.insert(theirs.end(), values.begin(), values.end());
  }
  EXPECT_TRUE(all_close(theirs, checkpoint_logits(checkpoint, prompt), Tolerance{2e-4, 2e-4}));

  // An independent reader (the safetensors package and NumPy, following the
  // index to its shards): Mixtral's names hold the checkpoint's tensors, an
  // expert's w1 and w3 the halves of its fc rows, w2 its proj.
  const Outcome read = run_command(
      {(fs::path(std::getenv("TESSERA_TOOLS_DIR") ? std::getenv("TESSERA_TOOLS_DIR") : "/opt/tessera-tools") / "hf" /
        "bin" / "python")
           .string(),
       "-c",
       "import json, sys\nfrom safetensors.numpy import load_file\nd = sys.argv[1]\n"
       "index = json.load(open(d + '/model.safetensors.index.json'))['weight_map']\n"
       "out = {}\nfor f in sorted(set(index.values())):\n"
       "    for k, v in load_file(d + '/' + f).items(): out[k] = v.astype('float64').ravel().tolist()\n"
       "json.dump(out, open(sys.argv[2], 'w'))\n",
       dir / "hf", dir / "read.json"},
      dir / "read.log", seconds(120));
  ASSERT_EQ(read.status, 0) << read.output;
  const nlohmann::json files = nlohmann::json::parse(std::ifstream(dir / "read.json"));
  {
    Context ctx;
    const io::CheckpointReader saved(checkpoint);
    const auto stored = [&](const std::string& name) {
      for (const io::StoredTensor& t : saved.tensors())
        if (t.name == name) return read_whole(ctx, saved, t).to_doubles();
      ADD_FAILURE() << "no " << name << " in " << checkpoint;
      return std::vector<double>{};
    };
    const size_t half = 40 * 32;  // F x C
    for (int block = 0; block < 2; ++block) {
      const std::string ours = "blocks." + std::to_string(block) + ".mlp.",
                        mixtral = "model.layers." + std::to_string(block) + ".block_sparse_moe.";
      EXPECT_EQ(files[mixtral + "gate.weight"].get<std::vector<double>>(), stored(ours + "router.weight"));
      for (int e = 0; e < 4; ++e) {
        const std::string expert = "experts." + std::to_string(e) + ".";
        const std::vector<double> fc = stored(ours + expert + "fc.weight");
        ASSERT_EQ(fc.size(), 2 * half);
        EXPECT_EQ(files[mixtral + expert + "w1.weight"].get<std::vector<double>>(),
                  std::vector<double>(fc.begin(), fc.begin() + long(half)));
        EXPECT_EQ(files[mixtral + expert + "w3.weight"].get<std::vector<double>>(),
                  std::vector<double>(fc.begin() + long(half), fc.end()));
        EXPECT_EQ(files[mixtral + expert + "w2.weight"].get<std::vector<double>>(), stored(ours + expert + "proj.weight"));
      }
    }
  }

  // And back under expert parallelism, the experts' flags taken from
  // config.json (--ep without --num-experts): every tensor the checkpoint's.
  const std::string back = run_training(
      2, words(llama + "--ep 2 --train-steps 0 --init-from " + (dir / "hf") + " --save " + (dir / "back")),
      dir / "back.log");
  const io::CheckpointReader original(checkpoint), round_trip(dir / "back/step_00000000");
  int compared = 0;
  for (const io::StoredTensor& t : original.tensors()) {
    if (t.name.find("exp_avg") != std::string::npos || !round_trip.has_tensor(t.name)) continue;
    Context ctx;
    EXPECT_EQ(read_whole(ctx, round_trip, t).to_doubles(), read_whole(ctx, original, t).to_doubles()) << t.name;
    compared += t.name.find(".experts.") != std::string::npos;
  }
  EXPECT_EQ(compared, 2 * 4 * 2) << "every expert's fc and proj of both blocks";
  const Outcome disagree = run_command(
      tessera_command(1, words(model + "--num-experts 8 --train-steps 1 --init-from " + (dir / "hf"))),
      dir / "disagree.log", seconds(60));
  EXPECT_NE(disagree.status, 0);
  EXPECT_TRUE(contains(disagree.output, "--num-experts 8 disagrees with num_local_experts 4 in " +
                                            (dir / "hf/config.json")))
      << disagree.output;
}

// A checkpoint is layout-free: a Llama trained with its sequences split over
// two context-parallel ranks (ring attention) generates on one rank and on a
// tensor-parallel pair without context parallelism, greedily the tokens
// argmax without the cache gives from the same checkpoint.
TEST(Generate, ACheckpointOfContextParallelRanksGeneratesWithoutThem) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_generate_cp_");
  const std::string train = run_training(
      2,
      words("--model llama --synthetic --vocab-size 64 --seq-length 32 --num-layers 2 --num-heads 4 "
            "--group-query-attention --num-query-groups 2 --hidden-size 32 --ffn-hidden-size 48 --micro-batch-size 4 "
            "--cp 2 --train-steps 6 --lr 3e-3 --threads 1 --seed " + std::to_string(test_seed() % 1000) +
            " --save " + (dir / "ckpt")),
      dir / "train.log");
  EXPECT_TRUE(contains(train, "cp=2")) << train;
  const std::vector<int32_t> prompt = {5, 17, 3, 42};
  const std::vector<int32_t> reference = argmax_without_cache(dir / "ckpt/step_00000006", prompt, 12);
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)");
    const Outcome greedy = run_command(generate_command(ranks, {dir / "ckpt", "--prompt-ids", "5,17,3,42", "--temperature",
                                                                "0", "--max-new-tokens", "12", "--print-ids",
                                                                "--threads", "1"}),
                                       dir / "greedy.log", seconds(120));
    ASSERT_EQ(greedy.status, 0) << greedy.output;
    std::vector<int32_t> expected = prompt;
    expected.insert(expected.end(), reference.begin(), reference.end());
    EXPECT_EQ(ids_of(generated(greedy.output)), expected) << greedy.output;
  }
}

const char* kSmallGpt =
    "--model gpt --synthetic --vocab-size 64 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 "
    "--micro-batch-size 4 --threads 1 ";

TEST(Generate, ExportInitFromExportGivesTheSameBytesUnderOtherLayouts) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_init_from_");
  const std::string seed = std::to_string(test_seed() % 1000);
  run_training(1, words(std::string(kSmallGpt) + "--train-steps 3 --lr 1e-2 --seed " + seed + " --save " + (dir / "a")),
               dir / "a.log");
  const auto export_to = [&](const std::string& checkpoint, const std::string& out, const std::string& format) {
    fs::create_directories(fs::path(out).parent_path());
    const Outcome exported = run_command({TESSERA_BINARY, "export", checkpoint, "-o", out, "--format", format},
                                         dir / "export.log", seconds(60));
    EXPECT_EQ(exported.status, 0) << exported.output;
  };
  export_to(dir / "a", dir / "a/tessera.safetensors", "tessera");
  export_to(dir / "a", dir / "hf/model.safetensors", "hf-gpt2");

  // Tessera's names, loaded split over two tensor-parallel ranks.
  const std::string tp = run_training(2,
                                      words(std::string(kSmallGpt) + "--tp 2 --train-steps 0 --init-from " +
                                            (dir / "a/tessera.safetensors") + " --save " + (dir / "b")),
                                      dir / "b.log");
  EXPECT_TRUE(contains(tp, "init-from: " + (dir / "a/tessera.safetensors") + ": 28 tensors under tessera names")) << tp;
  export_to(dir / "b", dir / "b/tessera.safetensors", "tessera");
  EXPECT_EQ(file_bytes(dir / "b/tessera.safetensors"), file_bytes(dir / "a/tessera.safetensors"));

  // Hugging Face's names (transposed matrices), loaded into two pipeline stages from the
  // directory, as from_pretrained(DIR) reads it.
  run_training(2,
               words(std::string(kSmallGpt) + "--pp 2 --global-batch-size 8 --train-steps 0 --init-from " +
                     (dir / "hf") + " --save " + (dir / "c")),
               dir / "c.log");
  export_to(dir / "c", dir / "hf2/model.safetensors", "hf-gpt2");
  EXPECT_EQ(file_bytes(dir / "hf2/model.safetensors"), file_bytes(dir / "hf/model.safetensors"));
  EXPECT_EQ(file_bytes(dir / "hf2/config.json"), file_bytes(dir / "hf/config.json"));

  // Weights of another model: refused naming the tensor and both shapes.
  const Outcome wrong = run_command(
      tessera_command(1, words("--model gpt --synthetic --vocab-size 64 --seq-length 16 --num-layers 2 --num-heads 2 "
                               "--hidden-size 64 --train-steps 1 --init-from " +
                               (dir / "a/tessera.safetensors"))),
      dir / "wrong.log", seconds(60));
  EXPECT_NE(wrong.status, 0);
  EXPECT_TRUE(contains(wrong.output, "tensor 'wte.weight' is [64, 32] but the model's wte.weight needs [64, 64]"))
      << wrong.output;
}

// The rank counts a GPT of these sizes splits over, by trying each: whole
// heads, and equal shares of the vocabulary and of the MLP on every rank.
std::string rank_counts(int64_t heads, int64_t vocab, int64_t ffn) {
  std::vector<std::string> counts;
  for (int64_t ranks = 1; ranks <= heads; ++ranks)
    if (heads % ranks == 0 && vocab % ranks == 0 && ffn % ranks == 0) counts.push_back(std::to_string(ranks));
  std::string text = counts.front();
  for (size_t i = 1; i < counts.size(); ++i) text += (i + 1 == counts.size() ? " or " : ", ") + counts[i];
  return text;
}

TEST(Generate, RefusesWhatCannotRunBeforeReadingTheWeights) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_generate_refused_");
  const int64_t vocab = 48, context = 16, heads = 4, hidden = 32;
  run_training(
      1,
      words("--model gpt --synthetic --vocab-size " + std::to_string(vocab) + " --seq-length " +
            std::to_string(context) + " --num-layers 1 --num-heads " + std::to_string(heads) + " --hidden-size " +
            std::to_string(hidden) + " --micro-batch-size 2 --train-steps 2 --threads 1 --save " + (dir / "ckpt")),
      dir / "train.log");
  // A flipped bit in a stored tensor: whatever reads the weights fails its checksum.
  std::mt19937_64 rng = make_rng();
  const auto [file, dataset] = stored_tensor_data(dir / "ckpt/step_00000002/checkpoint.h5", "wte.weight");
  ASSERT_TRUE(flip_random_stored_bit(file, dataset, rng));
  std::ofstream(dir / "notes.txt") << "not a dataset\n";
  const auto ids = [](int64_t count, int64_t last) {
    std::string list;
    for (int64_t i = 1; i < count; ++i) list += std::to_string(i % 7) + ",";
    return list + std::to_string(last);
  };
  const std::vector<std::string> checkpoint = {dir / "ckpt", "--threads", "1"};
  const std::string fits = "2,5";  // with --max-new-tokens 4: a prompt that can run
  const struct {
    int ranks;
    std::vector<std::string> args;
    std::string expected, not_expected;
  } cases[] = {
      {1,
       {"--prompt-ids", ids(3, vocab), "--print-ids", "--max-new-tokens", "4"},
       "--prompt-ids: id " + std::to_string(vocab),
       "checksum"},
      {1,
       {"--prompt-ids", ids(context + 4, 1), "--print-ids", "--max-new-tokens", "3"},
       "shorten the prompt to at most " + std::to_string(context) + " tokens",
       "at most 0 new tokens"},
      {3,
       {"--prompt-ids", fits, "--print-ids", "--max-new-tokens", "4"},
       "run generate on " + rank_counts(heads, vocab, 4 * hidden) + " rank(s)",
       "multiple of 3"},
      {1,
       {"--prompt", "hi", "--tokenizer", dir / "notes.txt", "--max-new-tokens", "4"},
       (dir / "notes.txt") + " is not an HDF5 file",
       "H5Fopen"},
      {1,
       {"--prompt", "hi", "--tokenizer", dir / "ckpt", "--max-new-tokens", "4"},
       (dir / "ckpt") + " is a checkpoint",
       "give --tokenizer"},
      // The damage itself: a prompt that can run reaches the weights and is stopped there.
      {1,
       {"--prompt-ids", fits, "--print-ids", "--max-new-tokens", "4"},
       "checksum mismatch in tensor wte.weight",
       "--prompt-ids"},
  };
  for (const auto& refused : cases) {
    SCOPED_TRACE(std::to_string(refused.ranks) + " rank(s): " + shell_words(refused.args));
    const Outcome out = run_command(generate_command(refused.ranks, joined(checkpoint, refused.args)),
                                    dir / "refused.log", seconds(60));
    EXPECT_NE(out.status, 0) << out.output;
    EXPECT_FALSE(out.left) << "processes left after the job ended";
    EXPECT_TRUE(contains(out.output, refused.expected)) << out.output;
    EXPECT_FALSE(contains(out.output, refused.not_expected)) << out.output;
    EXPECT_FALSE(contains(out.output, "checksum") && refused.expected.find("checksum") == std::string::npos)
        << "the weights were read first:\n"
        << out.output;
  }
}

}  // namespace
}  // namespace tessera::testing
