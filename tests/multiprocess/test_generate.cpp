// After training, end to end through the `tessera` binary: text prepared with
// a BPE tokenizer, a GPT trained on 2 ranks (tp 2) printing samples as it
// goes; `tessera generate` greedy output equals argmax decoding recomputed in
// this test without a KV cache from the checkpoint (library calls, the whole
// sequence each step), on 1 rank and as a tensor-parallel pair; a seeded
// sample is the same text on 1 and 2 ranks; the hf-gpt2 export's vocab.json
// and merges.txt encode as the dataset's tokenizer. --init-from: export → init-from
// (under tp 2, and pipeline 2 from Hugging Face names) → export gives the
// same bytes; a file of another model is refused naming tensor and shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "io/model_weights.h"
#include "io/tokenizer.h"
#include "parallel/stage_model.h"
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
  auto model = parallel::build_model(saved.config, nn::ModelSpec{&ctx, Device::cpu(), saved.dtype, 0});
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

TEST(Generate, GreedyEqualsArgmaxWithoutTheCacheAndTensorParallelSamplesTheSameText) {
  TESSERA_SEED_TRACE();
  std::vector<std::string> corpus;
  for (const char* name : {"computers", "science"})
    if (fs::is_regular_file(std::string("/usr/share/games/fortunes/") + name))
      corpus.push_back(std::string("/usr/share/games/fortunes/") + name);
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
  const std::vector<int32_t> reference = argmax_without_cache(checkpoint, prompt, 30);
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)");
    const Outcome greedy =
        run_command(generate_command(ranks, {dir / "ckpt", "--prompt", "The computer ", "--temperature", "0",
                                             "--max-new-tokens", "30", "--print-ids", "--threads", "1"}),
                    dir / "greedy.log", seconds(120));
    ASSERT_EQ(greedy.status, 0) << greedy.output;
    std::vector<int32_t> expected = prompt;
    expected.insert(expected.end(), reference.begin(), reference.end());
    EXPECT_EQ(ids_of(generated(greedy.output)), expected) << greedy.output;
    EXPECT_TRUE(contains(greedy.output, "generate: 30 tokens")) << greedy.output;
  }

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

  // Hugging Face's names (transposed matrices), loaded into two pipeline stages.
  run_training(2,
               words(std::string(kSmallGpt) + "--pp 2 --global-batch-size 8 --train-steps 0 --init-from " +
                     (dir / "hf/model.safetensors") + " --save " + (dir / "c")),
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

}  // namespace
}  // namespace tessera::testing
