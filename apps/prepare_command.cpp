// The `prepare` subcommand: flags for io::prepare_idx and io::prepare_text,
// a terminal progress line, and a summary of what was written.
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

struct IdxArguments {
  std::string images, labels, output;
  int64_t num_classes = 0;
};

struct TextArguments {
  std::vector<std::string> files;
  std::string output, eval_output;
  double eval_fraction = 0.05;
};

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
      "text", "Text files into a byte-level token stream (uint8, vocabulary 256), the tail held out for eval");
  text->add_option("files", text_arguments->files, "Text files, concatenated in this order")->required();
  text->add_option("-o,--output", text_arguments->output, "The training HDF5 file to write")->required();
  text->add_option("--eval-output", text_arguments->eval_output,
                   "The evaluation HDF5 file: the last --eval-fraction of the bytes (default: the output's name "
                   "with .eval.h5)");
  text->add_option("--eval-fraction", text_arguments->eval_fraction,
                   "Fraction of the bytes (the tail) held out for evaluation; 0: no eval file")
      ->capture_default_str();
  text->callback([text_arguments, &exit_code] {
    TextArguments args = *text_arguments;
    // A held-out split by default: out.h5 -> out.eval.h5.
    if (args.eval_output.empty() && args.eval_fraction > 0) {
      const std::filesystem::path out(args.output);
      args.eval_output = (out.parent_path() / (out.stem().string() + ".eval.h5")).string();
    }
    const io::TextPrepareResult result =
        io::prepare_text(args.files, args.output, args.eval_output, args.eval_fraction, terminal_progress());
    std::printf("wrote %s: %s\n", result.train.path.c_str(), result.train.describe().c_str());
    if (!result.eval.path.empty())
      std::printf("wrote %s: %s\n", result.eval.path.c_str(), result.eval.describe().c_str());
    exit_code = 0;
  });
}

}  // namespace tessera::app
