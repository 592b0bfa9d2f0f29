// `tessera train`'s settings in-process (apps/train_config.h): the --config
// reader (arrays where one value goes, unterminated strings and arrays, keys
// set twice, unknown keys; what TOML allows still read right; random bytes
// never crash it), settings given but unused refused with the reason,
// suggestions for unknown flags, the range messages of numeric flags, and the
// launch check of a Slurm allocation started without srun
// (parallel/mpi_env.h). tests/apps/test_cli_refusals.cpp runs the same cases
// through the real `tessera` program.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "apps/train_config.h"
#include "core/error.h"
#include "parallel/mpi_env.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// A scratch directory removed at the end of the test.
struct ScratchDir {
  ScratchDir()
      : path(fs::temp_directory_path() / ("tessera_flags_" + std::to_string(::getpid()) + "_" +
                                          ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
  fs::path path;
};

// `tessera train ARGS` parsed as apps/main.cpp does: CLI11, the --config file,
// then the check of settings given but unused.
class TrainCommand {
 public:
  TrainCommand() { app::add_train_options(command_, config_); }

  // Parses `args` (what follows `tessera train`); throws what main() would catch.
  void parse(std::vector<std::string> args) {
    std::reverse(args.begin(), args.end());  // CLI11 pops from the back
    command_.parse(args);
    from_file_ = app::apply_config_file(command_, config_);
  }
  void refuse_unused() const { app::refuse_unused_settings(command_, config_, from_file_); }

  const app::TrainConfig& config() const { return config_; }
  const CLI::App& command() const { return command_; }

 private:
  app::TrainConfig config_;
  CLI::App command_;
  app::ConfigFileLines from_file_;
};

// The message of the tessera::Error that `parse` (with `args`) throws, or a
// failure when it throws none.
std::string config_error(const fs::path& toml, const std::vector<std::string>& args = {}) {
  TrainCommand command;
  std::vector<std::string> all = {"--config", toml.string()};
  all.insert(all.end(), args.begin(), args.end());
  try {
    command.parse(all);
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "no error for --config " << toml;
  return "";
}

void write(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

void expect_parts(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& part : parts)
    EXPECT_NE(text.find(part), std::string::npos) << "no '" << part << "' in:\n" << text;
}

// Issue 21, case 2: CLI11's reader segfaulted on `key = []` and on an
// unterminated `key = [2`, and `num-layers = [3, 5]` set 5.
TEST(ConfigFile, AnArrayWhereOneValueGoesNamesTheKeyAndLine) {
  ScratchDir dir;
  const fs::path toml = dir.path / "e.toml";
  for (const std::string key : {"num-layers", "lr", "model", "seed", "recompute"}) {
    for (const std::string array : {"[]", "[3, 5]", "[\n  3,\n]"}) {
      SCOPED_TRACE(key + " = " + array);
      write(toml, "# a run\n" + key + " = " + array + "\n");
      expect_parts(config_error(toml), {"e.toml line 2", "'" + key + "' takes one value", "array"});
    }
  }
}

TEST(ConfigFile, AnEmptyListIsRefused) {
  ScratchDir dir;
  const fs::path toml = dir.path / "e.toml";
  write(toml, "hidden = []\n");
  expect_parts(config_error(toml), {"line 1", "'hidden' is given an empty array"});
  write(toml, "hidden = [\"\"]\n");
  expect_parts(config_error(toml), {"line 1", "'hidden'", "needs a number"});
}

// Text that is not TOML is refused by the parser (toml++) with the line;
// before, CLI11's reader swallowed the lines after an unterminated array
// (`lr = 0.5` vanished into it) or crashed.
TEST(ConfigFile, InvalidTomlNamesTheLine) {
  ScratchDir dir;
  const fs::path toml = dir.path / "e.toml";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"num-layers = [2", "line 1"},
      {"num-layers = [2\n", "line 1"},
      {"num-layers = [2\nlr = 0.5\n", "line 2"},
      {"synthetic = true\nmodel = \"gpt\n", "line 2"},
      {"data = 'runs/x.h5\n", "line 1"},
      {"[tessera\nseed = 1\n", "line 1"},
      {"lr 0.5\n", "line 1"},
      {"\n\nlr =\n", "line 3"},
      {"model = gpt\n",
       "line 1: not valid TOML: Error while parsing value: could not determine value type (text values need quotes: "
       "model = \"gpt\")"},
      {"hidden = [1 2]\n", "line 1"},
      {"hidden = [1,,2]\n", "line 1"},
      {"data = \"a\\qb\"\n", "line 1"},
      {"= 3\n", "line 1"},
      {"seed = 1\nlr = 0.5\nlr = 0.25\n", "line 3"},
  };
  for (const auto& [text, line] : cases) {
    SCOPED_TRACE(text);
    write(toml, text);
    expect_parts(config_error(toml),
                 {"--config " + toml.string() + " " + line.substr(0, line.find(':')) + ": not valid TOML: ", line});
  }
}

// Valid TOML that no flag can take, and values a flag refuses.
TEST(ConfigFile, ValuesNoFlagTakesNameTheKeyAndLine) {
  ScratchDir dir;
  const fs::path toml = dir.path / "e.toml";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"hidden = [[1, 2]]\n", {"line 1", "'hidden' holds an array of arrays"}},
      {"model = {kind = \"gpt\"}\n", {"line 1", "'model' is an inline table"}},
      {"[[runs]]\nseed = 1\n", {"line 1", "'runs' holds an array of arrays, tables"}},
      {"seed = 1979-05-27\n", {"line 1", "'seed' is a date or time"}},
      {"hidden_size = 64\nhidden-size = 32\n", {"line 2", "'hidden-size' is set twice (first on line 1)"}},
      {"lr = 0.5\n[tessera]\nlr = 0.25\n", {"line 3", "'lr' is set twice (first on line 1)"}},
      {"recompute = \"yes\"\n", {"line 1", "'recompute' is true or false"}},
      {"config = \"other.toml\"\n", {"line 1", "cannot name another"}},
      {"num-layers = \"four\"\n", {"line 1", "bad value for 'num-layers'"}},
      {"seed = \"\"\n", {"line 1", "bad value for 'seed'", "needs a number"}},
      {"lr = nan\n", {"line 1", "bad value for 'lr'", "finite"}},
      {"lr = inf\n", {"line 1", "bad value for 'lr'", "finite"}},
  };
  for (const auto& [text, parts] : cases) {
    SCOPED_TRACE(text);
    write(toml, text);
    expect_parts(config_error(toml), parts);
  }
}

TEST(ConfigFile, UnknownKeysGetTheFlagTheyProbablyMeant) {
  ScratchDir dir;
  const fs::path toml = dir.path / "e.toml";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"learning_rate = 0.1\n", "unknown setting 'learning_rate'; did you mean `lr`?"},
      {"learning-rate = 0.1\n", "did you mean `lr`?"},
      {"train-step = 3\n", "did you mean `train-steps`?"},
      {"num_attention_heads = 8\n", "did you mean `num-heads`?"},
      {"bf16 = true\n", "did you mean `precision = \"bf16\"`?"},
      {"use-distributed-optimizer = true\n", "did you mean `zero = 1`?"},
      {"a.b = 1\n", "unknown setting 'b'"},
      {"help = true\n", "unknown setting 'help'"},
  };
  for (const auto& [text, part] : cases) {
    SCOPED_TRACE(text);
    write(toml, text);
    expect_parts(config_error(toml), {"line 1", part, "flags of `tessera train --help`"});
  }
}

// What CLI11's reader got wrong and TOML allows: '#' inside strings, spaces
// in strings, escapes, digit separators, arrays over lines with comments and
// a trailing comma, CRLF line ends, a byte-order mark, quoted keys, tables
// (whose keys apply like top-level ones).
TEST(ConfigFile, WhatTomlAllowsIsReadRight) {
  ScratchDir dir;
  const fs::path toml = dir.path / "run.toml";
  write(toml,
        "\xEF\xBB\xBF# a run (after a byte-order mark)\r\n"
        "[tessera]\r\n"
        "model = 'mlp'\r\n"
        "hidden = [   # widths\n"
        "  64,        # first\n"
        "  32,\n"
        "]\n"
        "data = \"runs/a #1/caf\\u00e9 \\\"x\\\".h5\"  # comment\n"
        "train-steps = 10_000\n"
        "\"lr\"=0.5\n"
        "micro_batch_size = 16\n"
        "synthetic = false\n"
        "[more.settings]\n"
        "seed = 7\n");
  TrainCommand command;
  command.parse({"--config", toml.string()});
  const app::TrainConfig& c = command.config();
  EXPECT_EQ(c.model, nn::ModelKind::mlp);
  EXPECT_EQ(c.hidden, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(c.data, "runs/a #1/caf\xc3\xa9 \"x\".h5");
  EXPECT_EQ(c.train_steps, 10000);
  EXPECT_FLOAT_EQ(c.lr, 0.5f);
  EXPECT_EQ(c.micro_batch_size, 16);
  EXPECT_FALSE(c.synthetic);
  EXPECT_EQ(c.seed, 7u);

  // A list flag also takes one value, or its values in a string; flags on the
  // command line still win over the file.
  write(toml, "hidden = \"24,12\"\nlr = 0.5\n");
  TrainCommand other;
  other.parse({"--config", toml.string(), "--lr", "0.125"});
  EXPECT_EQ(other.config().hidden, (std::vector<int64_t>{24, 12}));
  EXPECT_FLOAT_EQ(other.config().lr, 0.125f);
  write(toml, "hidden = 48\n");
  TrainCommand single;
  single.parse({"--config", toml.string()});
  EXPECT_EQ(single.config().hidden, (std::vector<int64_t>{48}));
}

// Random files: lines of a real or made-up key, maybe `=`, and a few tokens
// of TOML's punctuation, strings, numbers and words; then the same with
// characters inserted, deleted or the file cut short. Every one is read or
// refused with a tessera::Error naming the file (a crash ends the test binary,
// as CLI11's reader did for `num-layers = []` and `lr = [2`).
TEST(ConfigFile, NoInputCrashesTheReader) {
  TESSERA_SEED_TRACE();
  ScratchDir dir;
  const fs::path toml = dir.path / "r.toml";
  std::mt19937_64 rng = make_rng();
  const auto pick = [&rng](const std::vector<std::string>& from) { return from[rng() % from.size()]; };
  const std::vector<std::string> keys = {"num-layers",  "lr",     "model", "hidden", "recompute", "data", "seed",
                                         "hidden_size", "\"lr\"", "a.b",   "[t]",    "[[t]]",     "",     "x"};
  const std::vector<std::string> tokens = {"[",    "]", ",",  "\"",      "'",     "\"\"\"", "#c",   "\\",
                                           "{",    "}", "=",  "3",       "-1",    "1e-3",   "10_0", "gpt",
                                           "true", " ", "\n", "\"a b\"", "'c#d'", "\\u12"};
  const std::string alphabet = "[]{}=,.#'\"\\\n\r\t u_-+eE0123456789abcdelmnrstyz";
  int refused = 0, read = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string text;
    for (int line = int(rng() % 4); line >= 0; --line) {
      text += pick(keys);
      if (rng() % 8 != 0) text += " = ";
      for (int n = int(rng() % 5); n > 0; --n) text += pick(tokens);
      if (rng() % 8 != 0) text += "\n";
    }
    if (i % 2 == 1)
      for (int edits = 1 + int(rng() % 3); edits > 0; --edits) {
        const size_t at = rng() % (text.size() + 1);
        switch (rng() % 3) {
          case 0:
            text.insert(at, 1, alphabet[rng() % alphabet.size()]);
            break;
          case 1:
            if (at < text.size()) text.erase(at, 1);
            break;
          default:
            text.resize(at);
            break;
        }
      }
    write(toml, text);
    TrainCommand command;
    try {
      command.parse({"--config", toml.string()});
      ++read;
    } catch (const Error& error) {
      ++refused;
      EXPECT_NE(std::string(error.what()).find("--config " + toml.string()), std::string::npos) << error.what();
    } catch (const std::exception& error) {
      ADD_FAILURE() << "not a tessera::Error for:\n" << text << "\n" << error.what();
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(read, 0);
}

// Issue 21, case 5: settings given but unused are refused with the reason.
TEST(UnusedSettings, AreRefusedWithTheReasonAndTheFix) {
  ScratchDir dir;
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"--model", "mlp", "--hidden-size", "64"}, {"--hidden-size 64", "GPT's width", "--hidden 64,64"}},
      {{"--num-layers", "3"}, {"--num-layers 3", "--model mlp (the default)", "--hidden 1024,1024,1024"}},
      {{"--vocab-size", "100"}, {"--vocab-size 100", "GPT's vocabulary"}},
      {{"--seq-length", "64"}, {"--seq-length 64", "context length"}},
      {{"--num-heads", "2"}, {"--num-heads 2"}},
      {{"--ffn-hidden-size", "8"}, {"--ffn-hidden-size 8"}},
      {{"--recompute"}, {"--recompute:", "Transformer blocks"}},
      {{"--hidden-dropout", "0.1"}, {"--hidden-dropout 0.1", "no dropout"}},
      {{"--attention-dropout", "0.1"}, {"--attention-dropout 0.1", "--model mlp (the default) has no attention"}},
      {{"--model", "cnn", "--attention-dropout", "0.2"}, {"--attention-dropout 0.2", "--model cnn has no attention"}},
      {{"--model", "cnn", "--hidden", "64,64"}, {"--hidden 64,64", "--model cnn", "CNN's layers are fixed"}},
      {{"--model", "cnn", "--num-layers", "2"}, {"--num-layers 2", "--model cnn"}},
      {{"--model", "gpt", "--hidden", "64"}, {"--hidden 64", "--hidden-size", "--num-layers"}},
      {{"--nesterov"}, {"--nesterov:", "--optimizer adamw (the default)", "add --optimizer sgd"}},
      {{"--sgd-momentum", "0.5"}, {"--sgd-momentum 0.5", "--optimizer sgd"}},
      {{"--optimizer", "sgd", "--adam-beta2", "0.9"}, {"--adam-beta2 0.9", "AdamW setting"}},
      {{"--sequence-parallel"}, {"--sequence-parallel:", "--tensor-parallel 1 (the default)"}},
      {{"--model", "gpt", "--tp", "1", "--sequence-parallel"}, {"--tensor-parallel 1 has none"}},
      {{"--pipeline-schedule", "gpipe"}, {"--pipeline-schedule gpipe", "--pipeline-parallel 1"}},
      {{"--model", "gpt", "--virtual-pipeline-stages", "2"},
       {"--virtual-pipeline-stages 2", "--pipeline-parallel 1 (the default)", "add --pipeline-parallel P"}},
      {{"--lr-decay-style", "constant", "--min-lr", "0.0001"}, {"--min-lr 0.0001", "constant"}},
      {{"--eval-interval", "5"}, {"--eval-interval 5", "--eval-data"}},
      {{"--eval-iters", "5"}, {"--eval-iters 5", "--eval-data"}},
      {{"--zero-prefetch", "2"}, {"--zero-prefetch 2", "--zero 0 (the default)", "add --zero 2 or 3"}},
      {{"--zero", "1", "--zero-prefetch", "0"}, {"--zero-prefetch 0", "--zero 1 has none"}},
      {{"--zero", "3", "--bucket-size-mb", "4"}, {"--bucket-size-mb 4", "--zero 3 reduces one unit"}},
      {{"--ckpt-format", "gathered", "--async-save"},
       {"--async-save:", "--ckpt-format gathered is written by rank 0", "use --ckpt-format sharded"}},
      {{"--model", "llama", "--moe-router-topk", "1"},
       {"--moe-router-topk 1", "mixture-of-experts layers, and there are none", "add --num-experts E"}},
      {{"--model", "gpt", "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01"},
       {"--moe-layer-freq 2", "--moe-aux-loss-coeff 0.01", "add --num-experts E"}},
      {{"--model", "llama", "--ep", "2"}, {"--expert-model-parallel-size 2", "add --num-experts E"}},
      {{"--model", "mlp", "--num-experts", "4"}, {"--num-experts 4", "--model mlp has none", "use --model gpt or llama"}},
      // Several at once: all named.
      {{"--hidden-size", "64", "--nesterov"}, {"these settings", "--hidden-size 64", "--nesterov"}},
  };
  for (const auto& [args, parts] : cases) {
    SCOPED_TRACE(::testing::PrintToString(args));
    TrainCommand command;
    command.parse(args);
    try {
      command.refuse_unused();
      ADD_FAILURE() << "not refused";
    } catch (const Error& error) {
      expect_parts(error.what(), parts);
    }
  }

  // From the --config file: the message names its line.
  const fs::path toml = dir.path / "u.toml";
  write(toml, "synthetic = true\nhidden-size = 64\n");
  TrainCommand from_file;
  from_file.parse({"--config", toml.string()});
  try {
    from_file.refuse_unused();
    ADD_FAILURE() << "not refused";
  } catch (const Error& error) {
    expect_parts(error.what(), {"--hidden-size 64 (" + toml.string() + " line 2)", "--hidden 64,64"});
  }
}

// Defaults never count; neither does a boolean flag given as false; and a
// setting the run uses is never refused.
TEST(UnusedSettings, DefaultsAndUsedSettingsPass) {
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"--model", "mlp", "--hidden", "64,64"},
      {"--model", "gpt", "--num-layers", "2", "--hidden-size", "32", "--num-heads", "2", "--seq-length", "16",
       "--vocab-size", "100", "--ffn-hidden-size", "64", "--hidden-dropout", "0.1", "--recompute"},
      {"--model", "gpt", "--attention-dropout", "0.1"},
      {"--model", "llama", "--attention-dropout", "0.1"},
      {"--recompute=false", "--nesterov=false", "--sequence-parallel=false"},
      {"--optimizer", "sgd", "--nesterov", "--sgd-momentum", "0.8"},
      {"--optimizer", "adamw", "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--adam-eps", "1e-6"},
      {"--model", "gpt", "--tp", "2", "--sequence-parallel"},
      {"--pp", "2", "--pipeline-schedule", "gpipe"},
      {"--model", "gpt", "--pp", "2", "--virtual-pipeline-stages", "2"},
      {"--model", "gpt", "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2"},
      {"--min-lr", "0.0001"},
      {"--eval-data", "x.h5", "--eval-iters", "5", "--eval-interval", "10"},
      {"--model", "cnn"},
      {"--zero", "3", "--zero-prefetch", "2"},
      {"--zero", "1", "--bucket-size-mb", "4"},
      {"--ckpt-format", "sharded", "--async-save"},
      {"--ckpt-format", "gathered", "--no-async-save"},
  };
  for (const std::vector<std::string>& args : cases) {
    SCOPED_TRACE(::testing::PrintToString(args));
    TrainCommand command;
    command.parse(args);
    EXPECT_NO_THROW(command.refuse_unused());
  }
}

TEST(FlagSuggestions, TyposAndOtherTrainersNames) {
  TrainCommand train;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--learning-rate", "did you mean `--lr`?"},
      {"--learning_rate=3", "did you mean `--lr`?"},
      {"-lr", "did you mean `--lr`?"},
      {"--train-step", "did you mean `--train-steps`?"},
      {"--train-iters", "did you mean `--train-steps`?"},
      {"--max-steps", "did you mean `--train-steps`?"},
      {"--micro_batch_size", "did you mean `--micro-batch-size`?"},
      {"--micro-batch", "did you mean `--micro-batch-size`?"},
      {"--batch-size", "did you mean `--micro-batch-size`?"},
      {"--num-attention-heads", "did you mean `--num-heads`?"},
      {"--num-layer", "did you mean `--num-layers`?"},
      {"--n-embd", "did you mean `--hidden-size`?"},
      {"--tensor-model-parallel-size", "did you mean `--tensor-parallel`?"},
      {"--bf16", "did you mean `--precision bf16`?"},
      {"--recompute-activations", "did you mean `--recompute`?"},
      {"--attn-pdrop", "did you mean `--attention-dropout`?"},
      {"--attention-probs-dropout-prob", "did you mean `--attention-dropout`?"},
      {"--gradient-accumulation-steps", "did you mean `--global-batch-size`?"},
      {"--nproc-per-node", "mpirun -np N"},
      {"--fsdp", "did you mean `--zero 3`?"},
      {"--zero-stage", "did you mean `--zero`?"},
      {"--forward-prefetch", "did you mean `--zero-prefetch`?"},
      {"--lerning-rate", "did you mean `--lr`?"},
  };
  for (const auto& [unknown, text] : cases) {
    const std::string suggestion = app::suggestion_text(app::suggest_flag(train.command(), unknown));
    EXPECT_NE(suggestion.find(text), std::string::npos) << unknown << " -> '" << suggestion << "'";
  }
  EXPECT_TRUE(app::suggest_flag(train.command(), "--xyzzy").empty());
  EXPECT_TRUE(app::suggest_flag(train.command(), "--").empty());

  const std::vector<std::string> commands = {"train", "prepare", "plot", "checkpoint", "topo", "info", "selfcheck"};
  EXPECT_EQ(app::closest_name("trian", commands), "train");
  EXPECT_EQ(app::closest_name("trains", commands), "train");
  EXPECT_EQ(app::closest_name("prepar", commands), "prepare");
  EXPECT_EQ(app::closest_name("foo", commands), "");
  EXPECT_EQ(app::closest_name("", commands), "");
}

size_t longest_digit_run(const std::string& text) {
  size_t longest = 0, run = 0;
  for (char ch : text) {
    run = ch >= '0' && ch <= '9' ? run + 1 : 0;
    longest = std::max(longest, run);
  }
  return longest;
}

// Issue 21, case 10: CLI11's PositiveNumber/NonNegativeNumber printed the
// range as "0.000000 to 1797693...(309 digits).000000". Every numeric flag,
// given a negative number, an empty value, inf or nan, is either taken or
// refused with a message that names it and has no such number.
TEST(NumericFlags, RangeMessagesAreWords) {
  TrainCommand train;
  std::vector<std::string> numeric;
  for (const CLI::Option* option : train.command().get_options()) {
    const std::string type = option->get_type_name();
    if (type == "INT" || type == "UINT" || type == "FLOAT") numeric.push_back(option->get_name());
  }
  ASSERT_GT(numeric.size(), 20u);
  for (const std::string& flag : numeric)
    for (const std::string value : {"-1", "0", "", "inf", "nan", "1e400"}) {
      TrainCommand command;
      try {
        command.parse({flag, value});
      } catch (const CLI::ParseError& error) {
        const std::string what = error.what();
        EXPECT_NE(what.find(flag), std::string::npos) << what;
        EXPECT_LT(longest_digit_run(what), 20u) << flag << " " << value << ": " << what;
      }
    }

  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--comm-timeout", "-1"}, "--comm-timeout: must be a number of seconds from 0 (no limit) to 31536000"},
      {{"--comm-timeout", "1e300"}, "--comm-timeout: must be a number of seconds"},
      {{"--comm-timeout", "nan"}, "--comm-timeout: must be a number of seconds"},
      {{"--tensor-parallel", "0"}, "--tensor-parallel: must be a whole number >= 1, got '0'"},
      {{"--pp", "-2"}, "--pipeline-parallel: must be a whole number >= 1, got '-2'"},
      {{"--seed", ""}, "--seed: needs a number"},
      {{"--lr", "inf"}, "--lr: must be a finite number, got 'inf'"},
  };
  for (const auto& [args, text] : cases) {
    TrainCommand command;
    try {
      command.parse(args);
      ADD_FAILURE() << ::testing::PrintToString(args) << " was taken";
    } catch (const CLI::ParseError& error) {
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
    }
  }
  TrainCommand fine;
  fine.parse({"--comm-timeout", "0", "--tp", "2"});
  EXPECT_EQ(fine.config().comm_timeout, 0.0);
  EXPECT_EQ(fine.config().tensor_parallel, 2);
}

// The learning rates, AdamW's betas and ε and the weight decay are read as
// doubles, as Megatron's arguments and torch.optim.AdamW hold them (AdamW's
// bias corrections 1 − β^step are computed from them): --adam-beta2 0.95 is
// 0.95, not the f32 0.949999988, from the command line and from --config.
TEST(NumericFlags, OptimizerSettingsAreDoubles) {
  const std::vector<std::pair<std::string, std::string>> flags = {{"--lr", "3e-4"},          {"--min-lr", "3e-5"},
                                                                  {"--weight-decay", "0.1"}, {"--adam-beta1", "0.9"},
                                                                  {"--adam-beta2", "0.95"},  {"--adam-eps", "1e-8"}};
  const auto read_values = [](const app::TrainConfig& c) {
    return std::vector<double>{c.lr, c.min_lr, c.weight_decay, c.adam_beta1, c.adam_beta2, c.adam_eps};
  };
  std::vector<std::string> args;
  for (const auto& [flag, value] : flags) args.insert(args.end(), {flag, value});
  TrainCommand command;
  command.parse(args);
  const std::vector<double> values = read_values(command.config());
  for (size_t i = 0; i < flags.size(); ++i)
    EXPECT_EQ(values[i], std::strtod(flags[i].second.c_str(), nullptr)) << flags[i].first;

  ScratchDir dir;
  const fs::path toml = dir.path / "optimizer.toml";
  std::string text;
  for (const auto& [flag, value] : flags) text += flag.substr(2) + " = " + value + "\n";
  write(toml, text);
  TrainCommand from_file;
  from_file.parse({"--config", toml.string()});
  EXPECT_EQ(read_values(from_file.config()), values);
}

// Issue 21, case 9: environments as Slurm and the launchers set them (the
// batch step's taken from a real sbatch --ntasks=2 script: SLURM_PROCID=0
// but no SLURM_STEP_ID).
TEST(LaunchCheck, APlainStartInASlurmAllocationOfSeveralTasksIsRefused) {
  using Env = std::map<std::string, std::string>;
  const Env batch = {{"SLURM_JOB_ID", "1"}, {"SLURM_JOBID", "1"},          {"SLURM_NTASKS", "2"},
                     {"SLURM_NPROCS", "2"}, {"SLURM_PROCID", "0"},         {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", "0"}, {"SLURM_GTIDS", "0"},          {"SLURM_JOB_NUM_NODES", "1"},
                     {"SLURM_NNODES", "1"}, {"SLURM_TASKS_PER_NODE", "2"}, {"SLURM_CPUS_ON_NODE", "2"}};
  const auto with = [](Env env, const Env& more) {
    for (const auto& [name, value] : more) env[name] = value;
    return env;
  };
  const auto problem = [](const Env& env, bool open_mpi = true) {
    return parallel::launch_problem(
        [&env](const char* name) -> const char* {
          const auto found = env.find(name);
          return found == env.end() ? nullptr : found->second.c_str();
        },
        open_mpi);
  };
  expect_parts(problem(batch),
               {"started plainly", "Slurm job 1", "2 tasks (SLURM_NTASKS=2)", "srun --mpi=pmix tessera train",
                "mpirun -np 2 tessera train", "TESSERA_LAUNCH_CHECK=0"});
  Env nodes = with(batch, {{"SLURM_JOB_NUM_NODES", "2"}, {"SLURM_NNODES", "2"}});
  nodes.erase("SLURM_NTASKS");
  nodes.erase("SLURM_NPROCS");
  expect_parts(problem(nodes), {"2 nodes (SLURM_JOB_NUM_NODES=2)", "srun --mpi=pmix"});

  // Launched properly, or one task: nothing to say.
  EXPECT_EQ(problem({}), "");
  EXPECT_EQ(problem(with(batch, {{"SLURM_NTASKS", "1"}, {"SLURM_NPROCS", "1"}})), "");
  EXPECT_EQ(problem(with(batch, {{"SLURM_STEP_ID", "0"}, {"SLURM_STEPID", "0"}, {"PMIX_RANK", "1"}})), "");
  EXPECT_EQ(problem(with(batch, {{"SLURM_STEP_ID", "0"}, {"PMI_RANK", "1"}, {"PMI_FD", "11"}})), "");
  EXPECT_EQ(problem(with(batch, {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}})), "");
  EXPECT_EQ(problem(with(batch, {{"TESSERA_LAUNCH_CHECK", "0"}})), "");

  // srun --mpi=none: Open MPI's MPI_Init cannot work; other MPIs may read Slurm's PMI directly.
  const Env no_plugin = with(batch, {{"SLURM_STEP_ID", "3"}, {"SLURM_STEPID", "3"}, {"SLURM_PROCID", "1"}});
  expect_parts(problem(no_plugin), {"started by srun", "step 3", "without an MPI plugin", "srun --mpi=pmix"});
  EXPECT_EQ(problem(no_plugin, /*open_mpi=*/false), "");
}

}  // namespace
}  // namespace tessera::testing
