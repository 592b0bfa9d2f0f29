// The `prepare` subcommand: flags for io::prepare_idx, io::prepare_text
// (bytes or BPE) and io::prepare_token_files (Megatron indexed datasets,
// llm.c shards), a terminal progress line, and a summary of what was written.
#include "apps/prepare_command.h"

#include <filesystem>

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "io/prepare.h"

namespace tessera::app {
namespace {

// "\rimages  45% (4500/10000)" on stderr when it is a terminal, redrawn only
// when the percentage or the stage changes; a newline when a stage finishes.
// Nothing when stderr is a file or a pipe (logs stay clean).
io::PrepareProgress terminal_progress() {
  if (!isatty(fileno(stderr))) return {};
  auto last = std::make_shared<std::pair<std::string, int>>("", -1);
  return [last](std::string_view stage, int64_t done, int64_t total) {
    const int percent = total > 0 ? int(100 * done / total) : 100;
    if (last->first == stage && last->second == percent) return;
    last->first = std::string(stage);
    last->second = percent;
    std::fprintf(stderr, "\r%-8.*s %3d%% (%lld/%lld)", int(stage.size()), stage.data(), percent, (long long)done,
                 (long long)total);
    if (done >= total) std::fputc('\n', stderr);
    std::fflush(stderr);
  };
}

struct IdxArguments {
  std::string images, labels, output;
  int64_t num_classes = 0;
};

struct TextArguments {
  std::vector<std::string> files;
  std::string output, eval_output;
  double eval_fraction = 0.05;
  int64_t vocab_size = 0;  // token files only
  io::TextTokenizerOptions tokenizer;  // text only
};

// A held-out split by default: out.h5 -> out.eval.h5.
std::string default_eval_output(const TextArguments& args) {
  if (!args.eval_output.empty() || args.eval_fraction <= 0) return args.eval_output;
  const std::filesystem::path out(args.output);
  return (out.parent_path() / (out.stem().string() + ".eval.h5")).string();
}

void print_result(const io::TextPrepareResult& result) {
  if (!result.note.empty()) std::printf("note: %s\n", result.note.c_str());
  std::printf("wrote %s: %s\n", result.train.path.c_str(), result.train.describe().c_str());
  if (!result.eval.path.empty())
    std::printf("wrote %s: %s\n", result.eval.path.c_str(), result.eval.describe().c_str());
}

// The output flags every token-stream preparation shares.
void add_split_options(CLI::App& command, TextArguments& args, const char* unit) {
  command.add_option("-o,--output", args.output, "The training HDF5 file to write")->required();
  command.add_option("--eval-output", args.eval_output,
                     std::string("The evaluation HDF5 file: the last --eval-fraction of the ") + unit +
                         " (default: the output's name with .eval.h5)");
  command
      .add_option("--eval-fraction", args.eval_fraction,
                  std::string("Fraction of the ") + unit + " (the tail) held out for evaluation; 0: no eval file")
      ->capture_default_str();
}

// `prepare megatron` and `prepare llmc`: other tools' token files, opened by `open`.
void add_token_file_command(CLI::App& prepare, const char* name, const char* description, const char* inputs,
                            io::TokenSource (*open)(const std::string&), int& exit_code) {
  auto args = std::make_shared<TextArguments>();
  auto* command = prepare.add_subcommand(name, description);
  command->add_option("inputs", args->files, inputs)->required();
  add_split_options(*command, *args, "tokens");
  command
      ->add_option("--vocab-size", args->vocab_size,
                   "The tokenizer's vocabulary size, stored with the data and checked against every id (0: the "
                   "largest id + 1)")
      ->capture_default_str();
  command->callback([args, open, &exit_code] {
    std::vector<io::TokenSource> sources;
    for (const std::string& input : args->files) sources.push_back(open(input));
    print_result(io::prepare_token_files(sources, args->output, default_eval_output(*args), args->eval_fraction,
                                         args->vocab_size, terminal_progress()));
    exit_code = 0;
  });
}

}  // namespace

void register_prepare_command(CLI::App& app, int& exit_code) {
  auto* prepare = app.add_subcommand("prepare", "Turn raw data into Tessera HDF5 datasets");
  prepare->require_subcommand(1);

  auto idx_arguments = std::make_shared<IdxArguments>();
  auto* idx =
      prepare->add_subcommand("idx", "MNIST-style IDX images and labels (plain or .gz) into a classification file");
  idx->add_option("--images", idx_arguments->images, "IDX image file, e.g. train-images-idx3-ubyte.gz")->required();
  idx->add_option("--labels", idx_arguments->labels, "IDX label file, e.g. train-labels-idx1-ubyte.gz")->required();
  idx->add_option("-o,--output", idx_arguments->output, "The HDF5 file to write")->required();
  idx->add_option("--num-classes", idx_arguments->num_classes, "Number of classes (0: the largest label + 1)")
      ->capture_default_str();
  idx->callback([idx_arguments, &exit_code] {
    const io::DatasetInfo info = io::prepare_idx(idx_arguments->images, idx_arguments->labels, idx_arguments->output,
                                                 terminal_progress(), idx_arguments->num_classes);
    std::printf("wrote %s: %s\n", info.path.c_str(), info.describe().c_str());
    exit_code = 0;
  });

  auto text_arguments = std::make_shared<TextArguments>();
  auto* text = prepare->add_subcommand(
      "text",
      "Text files into a token stream, byte-level (uint8, vocabulary 256) or through a byte-level BPE tokenizer "
      "trained on the text or loaded from GPT-2's files (stored with the data), the tail held out for eval");
  text->add_option("files", text_arguments->files, "Text files, concatenated in this order")->required();
  add_split_options(*text, *text_arguments, "tokens");
  io::TextTokenizerOptions& tokenizer = text_arguments->tokenizer;
  text->add_option("--tokenizer", tokenizer.tokenizer,
                   "bytes: one token per byte (the default); bpe: GPT-2's byte-level BPE, trained on the text to "
                   "--vocab-size tokens or loaded from --vocab and --merges (the default when they are given)")
      ->check(CLI::IsMember({"bytes", "bpe"}));
  text->add_option("--vocab-size", tokenizer.vocab_size,
                   "BPE training: the vocabulary to learn, 257..1048576 (256 bytes, then one token per merge)");
  text->add_option("--vocab", tokenizer.vocab_json,
                   "A Hugging Face GPT-2 vocab.json to load instead of training (with --merges)");
  text->add_option("--merges", tokenizer.merges_txt, "The merges.txt that goes with --vocab");
  text->callback([text_arguments, &exit_code] {
    print_result(io::prepare_text(text_arguments->files, text_arguments->output, default_eval_output(*text_arguments),
                                  text_arguments->eval_fraction, terminal_progress(), text_arguments->tokenizer));
    exit_code = 0;
  });

  add_token_file_command(*prepare, "megatron",
                         "A Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx, as preprocess_data.py writes) into "
                         "a token stream, the tail held out for eval",
                         "Dataset prefixes (PREFIX, PREFIX.bin or PREFIX.idx), concatenated in this order",
                         io::open_megatron_dataset, exit_code);
  add_token_file_command(*prepare, "llmc",
                         "llm.c token shards (256-int32 header, magic 20240520) into a token stream, the tail held "
                         "out for eval",
                         "Shard files (e.g. fineweb_train_000001.bin), concatenated in this order", io::open_llmc_shard,
                         exit_code);
}

}  // namespace tessera::app
