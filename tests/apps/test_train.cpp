// The trainer end to end, in-process: a short real run on Fashion-MNIST,
// gradient accumulation against one bigger batch, the TOML config file, and
// the errors a user meets with bad flags or data.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "apps/train_config.h"
#include "apps/trainer.h"
#include "io/checkpoint.h"
#include "io/dataset.h"
#include "io/metrics.h"
#include "io/prepare.h"
#include "io/tokenizer.h"
#include "tests/io/io_test_files.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

const fs::path kFashionMnist = "/usr/share/datasets/fashion-mnist";

// A scratch directory removed at the end of the test.
struct ScratchDir {
  ScratchDir()
      : path(fs::temp_directory_path() / ("tessera_train_" + std::to_string(::getpid()) + "_" +
                                          ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
  fs::path path;
};

// Fashion-MNIST's training and test sets prepared into `dir`; fails (not
// skips) without Debian's dataset-fashion-mnist: scripts/install-deps.sh installs it.
std::pair<std::string, std::string> prepare_fashion_mnist(const fs::path& dir) {
  if (!fs::exists(kFashionMnist / "train-images-idx3-ubyte.gz")) {
    ADD_FAILURE() << kFashionMnist << " is missing: run scripts/install-deps.sh (Debian package dataset-fashion-mnist)";
    return {};
  }
  const std::string train = (dir / "train.h5").string(), test = (dir / "test.h5").string();
  io::prepare_idx((kFashionMnist / "train-images-idx3-ubyte.gz").string(),
                  (kFashionMnist / "train-labels-idx1-ubyte.gz").string(), train);
  io::prepare_idx((kFashionMnist / "t10k-images-idx3-ubyte.gz").string(),
                  (kFashionMnist / "t10k-labels-idx1-ubyte.gz").string(), test);
  return {train, test};
}

TEST(Train, MlpOnFashionMnistReachesEightyPercentInOneEpoch) {
  ScratchDir dir;
  const auto [train_path, test_path] = prepare_fashion_mnist(dir.path);
  if (train_path.empty()) return;
  app::TrainConfig c;
  c.model = nn::ModelKind::mlp;
  c.hidden = {256};
  c.data = train_path;
  c.eval_data = test_path;
  c.micro_batch_size = 128;
  c.epochs = 1;
  c.lr = 2e-3f;
  c.metrics = (dir.path / "metrics.jsonl").string();
  const app::TrainResult result = app::train(c);
  ASSERT_TRUE(result.final_eval.has_value());
  EXPECT_EQ(result.final_eval->count, 10000);
  EXPECT_GE(*result.final_eval->accuracy, 0.80) << "test accuracy after one epoch";
  EXPECT_EQ(result.steps, 60000 / 128);
  const io::MetricsLog log = io::read_metrics(c.metrics);
  EXPECT_EQ(int64_t(log.steps.size()), result.steps);
  ASSERT_FALSE(log.evals.empty());
  EXPECT_DOUBLE_EQ(log.evals.back().eval_accuracy.value(), *result.final_eval->accuracy);
  EXPECT_LT(log.steps.back().loss, log.steps.front().loss);
}

// Two micro-batches of 32 per step and one batch of 64 see the same samples
// (the permutation depends on the seed and epoch only), so every step's loss
// must agree: each depends on all the updates before it.
TEST(Train, AccumulationEqualsOneBiggerBatch) {
  ScratchDir dir;
  const auto [train_path, test_path] = prepare_fashion_mnist(dir.path);
  if (train_path.empty()) return;
  auto run = [&](int64_t micro, int64_t global, const std::string& name) {
    app::TrainConfig c;
    c.model = nn::ModelKind::mlp;
    c.hidden = {64};
    c.data = train_path;
    c.micro_batch_size = micro;
    c.global_batch_size = global;
    c.train_steps = 6;
    c.optimizer = "sgd";
    c.lr = 0.05f;
    c.metrics = (dir.path / name).string();
    app::train(c);
    return io::read_metrics(c.metrics).steps;
  };
  const auto accumulated = run(32, 64, "accumulated.jsonl");
  const auto single = run(64, 0, "single.jsonl");
  ASSERT_EQ(accumulated.size(), single.size());
  for (size_t i = 0; i < single.size(); ++i) {
    // f32 sums in another order: agree to a few ulp of the loss.
    EXPECT_NEAR(accumulated[i].loss, single[i].loss, 1e-5 * std::abs(single[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(accumulated[i].grad_norm.value(), single[i].grad_norm.value(), 1e-4 * single[i].grad_norm.value());
  }
}

TEST(Train, SyntheticGptTrainsInEveryPrecision) {
  for (const char* precision : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    app::TrainConfig c;
    c.model = nn::ModelKind::gpt;
    c.synthetic = true;
    c.vocab_size = 31;
    c.seq_length = 16;
    c.num_layers = 2;
    c.num_heads = 2;
    c.hidden_size = 32;
    c.micro_batch_size = 4;
    c.train_steps = 30;
    c.lr = 1e-2f;
    c.precision = precision;
    const app::TrainResult result = app::train(c);
    EXPECT_TRUE(std::isfinite(result.last_loss));
    // One fixed random batch: a working model memorises it.
    EXPECT_LT(result.last_loss, std::log(31.0) - 0.5);
  }
}

TEST(Train, ConfigFileSetsWhatFlagsDoNotAndRejectsUnknownKeys) {
  ScratchDir dir;
  const fs::path toml = dir.path / "run.toml";
  std::ofstream(toml) << "model = \"gpt\"\nnum-layers = 3\nlr = 0.5\nhidden_size = 48\n";
  app::TrainConfig c;
  CLI::App command;
  app::add_train_options(command, c);
  command.parse(
      std::vector<std::string>{"0.25", "--lr", toml.string(), "--config"});  // reversed: CLI11 pops from the back
  app::apply_config_file(command, c);
  EXPECT_EQ(c.model, nn::ModelKind::gpt);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.hidden_size, 48);
  EXPECT_FLOAT_EQ(c.lr, 0.25f);  // the flag wins over the file

  std::ofstream(toml) << "learning-rate = 0.1\n";
  app::TrainConfig d;
  CLI::App other;
  app::add_train_options(other, d);
  other.parse(std::vector<std::string>{toml.string(), "--config"});
  try {
    app::apply_config_file(other, d);
    FAIL() << "no error for an unknown key";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("learning-rate"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find(toml.string()), std::string::npos) << error.what();
  }
}

TEST(Train, ARepeatedFlagKeepsItsLastValueAndListsStillAccumulate) {
  app::TrainConfig c;
  CLI::App command;
  app::add_train_options(command, c);
  // Reversed: CLI11 pops from the back. Command line: --lr 0.5 --model mlp --lr 0.125 --hidden 24,12 --model cnn
  command.parse(std::vector<std::string>{"cnn", "--model", "24,12", "--hidden", "0.125", "--lr", "mlp", "--model",
                                         "0.5", "--lr"});
  EXPECT_FLOAT_EQ(c.lr, 0.125f);
  EXPECT_EQ(c.model, nn::ModelKind::cnn);
  EXPECT_EQ(c.hidden, (std::vector<int64_t>{24, 12}));
}

void expect_train_error(const app::TrainConfig& c, const std::string& fragment) {
  try {
    app::train(c);
    ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(Train, BadSettingsAndDataNameTheFlagOrFile) {
  ScratchDir dir;
  app::TrainConfig none;
  none.train_steps = 1;
  expect_train_error(none, "--synthetic");

  app::TrainConfig missing;
  missing.data = (dir.path / "nope.h5").string();
  missing.train_steps = 1;
  expect_train_error(missing, "nope.h5");

  app::TrainConfig both;
  both.synthetic = true;
  both.train_steps = 5;
  both.epochs = 1;
  expect_train_error(both, "--epochs");

  app::TrainConfig accumulation;
  accumulation.synthetic = true;
  accumulation.train_steps = 1;
  accumulation.micro_batch_size = 16;
  accumulation.global_batch_size = 40;
  expect_train_error(accumulation, "--global-batch-size");

  app::TrainConfig heads;
  heads.synthetic = true;
  heads.train_steps = 1;
  heads.model = nn::ModelKind::gpt;
  heads.hidden_size = 30;
  heads.num_heads = 4;
  expect_train_error(heads, "--num-heads");

  // A token file given to an image model.
  const fs::path text = dir.path / "text.txt";
  std::ofstream(text) << std::string(5000, 'a');
  io::prepare_text({text.string()}, (dir.path / "tokens.h5").string(), "", 0.0);
  app::TrainConfig mismatch;
  mismatch.model = nn::ModelKind::mlp;
  mismatch.data = (dir.path / "tokens.h5").string();
  mismatch.train_steps = 1;
  expect_train_error(mismatch, "tokens.h5");
}


// --estimate-memory works the figures out from the model's shapes alone: a
// GPT 1,000,000 wide (about 24 trillion parameters) is estimated without
// allocating or initialising it (building it took the whole memory before),
// and the parameter bytes equal GPT-2's parameter count worked out here
// (f32 values and gradients, AdamW's two f32 moments).
TEST(Train, EstimateMemoryWorksAnySizeOutFromTheShapesAlone) {
  app::TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.synthetic = true;
  c.vocab_size = 50304;
  c.seq_length = 2048;
  c.num_layers = 2;
  c.num_heads = 8;
  c.hidden_size = 1'000'000;
  c.micro_batch_size = 1;
  c.train_steps = 1;
  c.estimate_memory = true;
  const app::TrainResult result = app::train(c);
  ASSERT_EQ(result.memory_estimate.size(), 1u);
  const int64_t v = c.vocab_size, t = c.seq_length, w = c.hidden_size, f = 4 * w, layers = c.num_layers;
  const int64_t block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * f + f) + (f * w + w);
  const int64_t parameters = v * w + t * w + layers * block + 2 * w;
  const auto& [values, gradients, optimizer] = result.memory_estimate[0];
  EXPECT_EQ(values, 4 * parameters);
  EXPECT_EQ(gradients, 4 * parameters);
  EXPECT_EQ(optimizer, 8 * parameters);
  EXPECT_EQ(result.steps, 0);
}

// The same for a Llama-3-8B-shaped model (4096 wide, 32 heads in 8
// key/value groups, SwiGLU 14336, vocabulary 128256, untied head) on one
// rank, from its shapes alone: the estimate knows the groups, the
// SwiGLU's three matrices and the head of its own, worked out here (bf16
// values, f32 gradients, f32 master weights and AdamW's two moments).
TEST(Train, EstimateMemoryKnowsTheLlamasGroupsSwigluAndUntiedHead) {
  app::TrainConfig c;
  c.model = nn::ModelKind::llama;
  c.synthetic = true;
  c.vocab_size = 128256;
  c.seq_length = 8192;
  c.num_layers = 32;
  c.num_heads = 32;
  c.group_query_attention = true;
  c.num_query_groups = 8;
  c.hidden_size = 4096;
  c.ffn_hidden_size = 14336;
  c.precision = "bf16";
  c.micro_batch_size = 1;
  c.train_steps = 1;
  c.estimate_memory = true;
  const app::TrainResult result = app::train(c);
  ASSERT_EQ(result.memory_estimate.size(), 1u);
  const int64_t v = c.vocab_size, w = c.hidden_size, f = c.ffn_hidden_size, dh = w / c.num_heads;
  const int64_t qkv = (c.num_heads + 2 * c.num_query_groups) * dh * w, proj = c.num_heads * dh * w;
  const int64_t block = 2 * w + qkv + proj + 3 * w * f;
  const int64_t parameters = 2 * v * w + c.num_layers * block + w;  // embedding, head, blocks, final norm
  EXPECT_EQ(parameters, 8'030'261'248);  // Llama 3 8B's published count
  const auto& [values, gradients, optimizer] = result.memory_estimate[0];
  EXPECT_EQ(values, 2 * parameters);
  EXPECT_EQ(gradients, 4 * parameters);
  EXPECT_EQ(optimizer, 12 * parameters);
}

// A BPE dataset of `vocab` tokens (from generated words), with an eval file.
std::pair<std::string, std::string> prepare_bpe_words(const fs::path& dir, int64_t vocab) {
  std::mt19937_64 rng(7);
  const char* words[] = {"alpha ", "beta ", "gamma ", "delta\n", "eps ", "zeta, ", "eta ", "theta. "};
  std::string text;
  for (int i = 0; i < 6000; ++i) text += words[rng() % 8];
  const std::string source = (dir / "words.txt").string();
  std::ofstream(source, std::ios::binary) << text;
  io::TextTokenizerOptions bpe;
  bpe.tokenizer = "bpe";
  bpe.vocab_size = vocab;
  const std::string train = (dir / "words.h5").string(), eval = (dir / "words.eval.h5").string();
  io::prepare_text({source}, train, eval, 0.1, {}, bpe);
  return {train, eval};
}

app::TrainConfig small_gpt_on(const std::string& data) {
  app::TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.data = data;
  c.seq_length = 16;
  c.num_layers = 1;
  c.num_heads = 2;
  c.hidden_size = 16;
  c.micro_batch_size = 2;
  c.train_steps = 2;
  return c;
}

// Without --vocab-size the GPT takes the dataset's vocabulary, padded to a
// multiple of --make-vocab-size-divisible-by (128, Megatron-LM's default),
// and says so; before, the default of 256 stopped a 300-token dataset.
TEST(Train, TheVocabularyComesFromTheDataWithoutVocabSize) {
  ScratchDir dir;
  const std::string data = prepare_bpe_words(dir.path, 300).first;
  const auto vocabulary_of = [&](app::TrainConfig c) {
    c.save = (dir.path / ("ckpt" + std::to_string(c.make_vocab_size_divisible_by) + "_" +
                          std::to_string(c.vocab_size)))
                 .string();
    ::testing::internal::CaptureStdout();
    app::train(c);
    const std::string output = ::testing::internal::GetCapturedStdout();
    const io::CheckpointReader reader(*io::find_latest_checkpoint(c.save));
    return std::make_pair(std::stoll(reader.metadata().at("model.vocab_size")), output);
  };
  const int64_t tokens = io::inspect_dataset(data).vocab_size;  // BPE training may stop short of 300
  ASSERT_GT(tokens, 256);
  const auto [padded, said] = vocabulary_of(small_gpt_on(data));
  EXPECT_EQ(padded, 384);
  EXPECT_NE(said.find("vocabulary: 384 from " + data + " (its " + std::to_string(tokens) +
                      " tokens padded to a multiple of 128"),
            std::string::npos)
      << said;
  app::TrainConfig exact = small_gpt_on(data);
  exact.make_vocab_size_divisible_by = 1;
  EXPECT_EQ(vocabulary_of(exact).first, tokens);
  app::TrainConfig given = small_gpt_on(data);
  given.vocab_size = 1000;
  EXPECT_EQ(vocabulary_of(given).first, 1000);
  app::TrainConfig synthetic = small_gpt_on("");
  synthetic.synthetic = true;
  EXPECT_EQ(vocabulary_of(synthetic).first, 256);
}

// eval_bits_per_byte is bits per byte of text: nats per token / ln 2 times
// the eval file's tokens per byte (here about a third: BPE tokens of several
// bytes), the bytes counted by decoding the eval file with its tokenizer.
// Byte data: bits per token. Tokens of another tool (bytes unknown): no field.
TEST(Train, EvalBitsPerByteCountsBytesOfText) {
  ScratchDir dir;
  const auto [data, eval] = prepare_bpe_words(dir.path, 300);
  const std::vector<int32_t> ids = read_whole_dataset<int32_t>(eval, "tokens", H5T_NATIVE_INT32);
  const double tokens_per_byte = double(ids.size()) / double(io::Tokenizer::load(eval)->decode(ids).size());
  ASSERT_LT(tokens_per_byte, 0.6);
  const auto evals_of = [&](const std::string& train_data, const std::string& eval_data, const std::string& name) {
    app::TrainConfig c = small_gpt_on(train_data);
    c.vocab_size = 384;
    c.eval_data = eval_data;
    c.eval_interval = 1;
    c.eval_iters = 2;
    c.metrics = (dir.path / name).string();
    app::train(c);
    return io::read_metrics(c.metrics).evals;
  };
  const auto bpe = evals_of(data, eval, "bpe.jsonl");
  ASSERT_EQ(bpe.size(), 2u);
  for (const io::EvalRecord& record : bpe) {
    ASSERT_TRUE(record.eval_bits_per_byte.has_value());
    EXPECT_NEAR(*record.eval_bits_per_byte, record.eval_loss / std::log(2.0) * tokens_per_byte,
                1e-9 * *record.eval_bits_per_byte);
  }
  const std::string bytes = (dir.path / "bytes.h5").string(), bytes_eval = (dir.path / "bytes.eval.h5").string();
  io::prepare_text({(dir.path / "words.txt").string()}, bytes, bytes_eval, 0.1);
  for (const io::EvalRecord& record : evals_of(bytes, bytes_eval, "bytes.jsonl"))
    EXPECT_NEAR(*record.eval_bits_per_byte, record.eval_loss / std::log(2.0), 1e-9 * record.eval_loss);
  const std::string foreign = (dir.path / "foreign.eval.h5").string();
  write_tokens(foreign, ids, H5T_STD_U16LE, 300);
  for (const io::EvalRecord& record : evals_of(data, foreign, "foreign.jsonl"))
    EXPECT_FALSE(record.eval_bits_per_byte.has_value()) << "bits per byte of tokens whose bytes are unknown";
}

}  // namespace
}  // namespace tessera::testing
