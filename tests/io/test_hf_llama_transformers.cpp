// Hugging Face Llama directories against transformers itself (pinned, in the
// venv scripts/install-hf.sh makes; skipped with a message without it),
// through tests/support/hf_llama.py:
//   - a tiny random LlamaForCausalLM (G < H, untied, rope_theta 500000) saved
//     by save_pretrained as one file, as shards (max_shard_size 60KB) and in
//     bf16: read_hf_llama_config gives its config, and load_hf_llama_weights
//     fills the design's parameters at tp 1 and 2 (f32 and bf16) with exactly
//     the tensors transformers holds, placed into the grouped layout here; and
//     write_hf_llama with the same limit shards those tensors as transformers
//     did (the same index);
//   - directories write_hf_llama made from random logical tensors (sharded
//     f32 with a BPE tokenizer, one bf16 file with the bytes tokenizer) load
//     with LlamaForCausalLM.from_pretrained (nothing missing or unexpected,
//     every tensor equal to what was written) and AutoTokenizer.from_pretrained
//     (its ids of a text equal Tessera's tokenizer's).
// The comparison of Tessera's Llama logits with transformers' (the "logits"
// the script prints) belongs with the model's tests.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/hf_llama.h"
#include "io/safetensors_directory.h"
#include "io/tokenizer.h"
#include "tests/io/hf_llama_test_support.h"
#include "tests/io/io_test_files.h"
#include "tests/support/process_job.h"
#include "tests/support/test_support.h"

#ifndef TESSERA_HF_LLAMA_SCRIPT
#error "tests/CMakeLists.txt defines TESSERA_HF_LLAMA_SCRIPT, the path of tests/support/hf_llama.py"
#endif

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

fs::path hf_python() {
  const char* tools = std::getenv("TESSERA_TOOLS_DIR");
  return fs::path(tools && *tools ? tools : "/opt/tessera-tools") / "hf" / "bin" / "python";
}

#define SKIP_WITHOUT_TRANSFORMERS()                                                                     \
  if (!fs::exists(hf_python()))                                                                         \
  GTEST_SKIP() << "no transformers in " << hf_python().parent_path().parent_path()                      \
               << ": run scripts/install-deps.sh (it installs Debian's python3-torch and runs scripts/" \
                  "install-hf.sh)"

// Runs tests/support/hf_llama.py COMMAND DIR ARGS... and returns the JSON it wrote (fails the test on an error).
Json hf_llama(const std::string& command, const fs::path& dir, const std::vector<std::string>& args) {
  const std::string out = dir.string() + "." + command + ".json", log = dir.string() + "." + command + ".log";
  std::vector<std::string> argv = {hf_python().string(), TESSERA_HF_LLAMA_SCRIPT, command, dir.string(), "--json", out};
  argv.insert(argv.end(), args.begin(), args.end());
  const Outcome outcome = run_command(argv, log, seconds(300));
  EXPECT_EQ(outcome.status, 0) << shell_words(argv) << "\n" << outcome.output;
  if (outcome.status != 0 || !fs::exists(out)) return Json::object();
  return Json::parse(std::ifstream(out));
}

// The state_dict the script printed, as named tensors.
NamedTensors tensors_of(const Json& printed) {
  NamedTensors out;
  for (const auto& [name, tensor] : printed["tensors"].items())
    out[name] = {Shape(tensor["shape"].get<std::vector<int64_t>>()), tensor["values"].get<std::vector<double>>()};
  return out;
}

void expect_logits_shape(const Json& printed, size_t ids, int64_t vocab) {
  ASSERT_EQ(printed["logits"].size(), ids);
  for (const Json& row : printed["logits"]) {
    ASSERT_EQ(int64_t(row.size()), vocab);
    for (const Json& value : row) EXPECT_TRUE(std::isfinite(value.get<double>()));
  }
}

TEST(HfLlamaTransformers, LoadsWhatTransformersSavedAsOneFileAsShardsAndInBf16) {
  SKIP_WITHOUT_TRANSFORMERS();
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const std::string seed = std::to_string(rng() % 100000);
  TempDir dir;
  Context ctx;
  struct Save {
    std::string name;
    std::vector<std::string> args;
  };
  for (const Save& save :
       {Save{"single", {}}, Save{"sharded", {"--max-shard-size", "60KB"}}, Save{"bf16", {"--dtype", "bfloat16"}}}) {
    SCOPED_TRACE(save.name);
    const fs::path where = dir.path() / save.name;
    std::vector<std::string> args = {"--seed", seed, "--ids", "3,1,4,1,5"};
    args.insert(args.end(), save.args.begin(), save.args.end());
    const Json made = hf_llama("make", where, args);
    ASSERT_TRUE(made.contains("tensors"));
    expect_logits_shape(made, 5, 96);

    const io::HfLlamaConfig c = io::read_hf_llama_config(where.string());
    expect_same_llama(c, tiny_llama(96, 64, 4, 2, 160, 2));  // hf_llama.py's defaults
    EXPECT_EQ(c.torch_dtype, save.name == "bf16" ? "bfloat16" : "float32");
    EXPECT_EQ(fs::exists(where / "model.safetensors.index.json"), save.name == "sharded");

    const NamedTensors hf = tensors_of(made);
    ASSERT_EQ(hf.size(), hf_llama_tensor_shapes(c).size());
    const NamedTensors logical = logical_from_hf(c, hf);
    for (const DType dtype : {DType::f32, DType::bf16})
      for (const int ranks : {1, 2})
        for (int rank = 0; rank < ranks; ++rank) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " rank " + std::to_string(rank) + " of " +
                       std::to_string(ranks));
          DesignParameters parameters = design_parameters(ctx, c, rank, ranks, dtype);
          const io::WeightsLoaded loaded = io::load_hf_llama_weights(where.string(), parameters.pointers(), c);
          EXPECT_EQ(loaded.tensors, int64_t(parameters.owned.size()));
          EXPECT_EQ(loaded.ignored, 0);
          for (const auto& p : parameters.owned)
            EXPECT_TRUE(all_close(p->value, round_to(dtype, expected_slice(p->name, logical.at(p->name), rank, ranks)),
                                  Tolerance{0, 0}))
                << p->name;
        }

    if (save.name != "sharded") continue;
    // Tessera's writer, given the same tensors and limit, shards them as transformers did.
    std::vector<std::string> storage;
    const std::vector<io::SafetensorsInput> inputs = as_inputs(logical, DType::f32, storage, tessera_llama_shapes(c));
    const fs::path ours = dir.path() / "ours";
    io::write_hf_llama(ours.string(), inputs, c, nullptr, io::parse_shard_size("60KB"));
    const Json theirs_index = Json::parse(std::ifstream(where / "model.safetensors.index.json"));
    const Json our_index = Json::parse(std::ifstream(ours / "model.safetensors.index.json"));
    EXPECT_EQ(our_index["weight_map"], theirs_index["weight_map"]);
    EXPECT_EQ(our_index["metadata"]["total_size"], theirs_index["metadata"]["total_size"]);
  }
}

// A text with words, digits, punctuation, contractions and UTF-8, for the tokenizers.
const char* const kText =
    "The quick brown fox jumps over the lazy dog; it's 42 degrees in Zürich, and naïve café owners say \"déjà vu\" "
    "-- 東京 too.\n  Indented lines, tabs\tand   spaces.";

TEST(HfLlamaTransformers, LoadsWhatTesseraWroteWithItsTokenizer) {
  SKIP_WITHOUT_TRANSFORMERS();
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  std::string corpus;
  for (int i = 0; i < 20; ++i) corpus += kText;
  const io::Tokenizer bpe = io::Tokenizer::train_bpe(corpus, 300).tokenizer;
  const io::Tokenizer bytes = io::Tokenizer::bytes();
  struct Case {
    std::string name;
    DType dtype;
    int64_t max_shard_bytes;
    const io::Tokenizer* tokenizer;
  };
  for (const Case& run : {Case{"sharded-f32-bpe", DType::f32, 100000, &bpe},
                          Case{"single-bf16-bytes", DType::bf16, io::kDefaultMaxShardBytes, &bytes}}) {
    SCOPED_TRACE(run.name);
    io::HfLlamaConfig c = tiny_llama(300, 64, 4, 2, 160, 2);
    const NamedTensors logical = random_tensors(tessera_llama_shapes(c), run.dtype, rng);
    std::vector<std::string> storage;
    const fs::path where = dir.path() / run.name;
    const io::HfLlamaWritten written =
        io::write_hf_llama(where.string(), as_inputs(logical, run.dtype, storage, tessera_llama_shapes(c)), c,
                           run.tokenizer, run.max_shard_bytes);
    EXPECT_EQ(written.weights.files.size() > 1, run.max_shard_bytes < io::kDefaultMaxShardBytes);

    const Json loaded = hf_llama("load", where, {"--ids", "7,299,0,42", "--text", kText});
    ASSERT_TRUE(loaded.contains("tensors"));
    EXPECT_EQ(loaded["class"], "LlamaForCausalLM");
    EXPECT_EQ(loaded["missing"], Json::array());
    EXPECT_EQ(loaded["unexpected"], Json::array());
    EXPECT_EQ(loaded["mismatched"], Json::array());
    EXPECT_EQ(loaded["config"]["num_key_value_heads"], 2);
    EXPECT_EQ(loaded["config"]["rope_theta"], 500000.0);
    EXPECT_EQ(loaded["config"]["rms_norm_eps"], 1e-5);
    EXPECT_EQ(loaded["config"]["tie_word_embeddings"], false);
    EXPECT_EQ(loaded["config"]["intermediate_size"], 160);
    expect_logits_shape(loaded, 4, 300);

    const NamedTensors expected = hf_from_logical(c, logical);
    const NamedTensors held = tensors_of(loaded);
    EXPECT_EQ(held.size(), expected.size());
    for (const auto& [name, tensor] : expected) {
      ASSERT_TRUE(held.count(name)) << name;
      EXPECT_EQ(held.at(name).shape, tensor.shape) << name;
      EXPECT_EQ(held.at(name).values, tensor.values) << name;
      EXPECT_EQ(loaded["tensors"][name]["dtype"], run.dtype == DType::bf16 ? "bfloat16" : "float32") << name;
    }

    ASSERT_FALSE(loaded.contains("tokenizer_error")) << loaded["tokenizer_error"];
    EXPECT_EQ(loaded["tokenizer"]["class"], "GPT2TokenizerFast");
    EXPECT_EQ(loaded["tokenizer"]["length"], run.tokenizer->vocab_size());
    EXPECT_EQ(loaded["tokenizer"]["ids"].get<std::vector<int32_t>>(), run.tokenizer->encode(kText));
    EXPECT_EQ(loaded["tokenizer"]["decoded"], kText);
  }
}

}  // namespace
}  // namespace tessera::testing
