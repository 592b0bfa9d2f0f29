// The `checkpoint` subcommand: `inspect` prints what a checkpoint holds and
// verifies its checksums (exit code 1 naming the corrupt tensors); `list`
// shows a save directory's checkpoints, the one `latest` names and leftovers
// of interrupted saves.
#include "apps/checkpoint_command.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/units.h"
#include "io/checkpoint.h"
#include "io/export.h"
#include "io/safetensors_directory.h"

namespace tessera::app {
namespace {

namespace fs = std::filesystem;

// A step directory or HDF5 file as given, or a save directory's latest checkpoint.
std::string resolve(const std::string& path) {
  return io::resolve_checkpoint(path, "tessera checkpoint");
}

// `value` on one line, cut to `limit` characters.
std::string shorten(const std::string& value, size_t limit = 100) {
  std::string line = value.substr(0, std::min(value.size(), limit));
  std::replace(line.begin(), line.end(), '\n', ' ');
  if (value.size() > limit) line += "... (" + std::to_string(value.size()) + " characters)";
  return line;
}

std::string layout_of(const io::CheckpointMetadata& metadata) {
  std::string layout;
  for (const char* key : {"dp", "tp", "pp", "zero"}) {
    for (const std::string& name : {std::string(key), std::string("layout.") + key}) {
      const auto found = metadata.find(name);
      if (found == metadata.end()) continue;
      layout += (layout.empty() ? "" : " ") + std::string(key) + "=" + found->second;
      break;
    }
  }
  return layout.empty() ? "not recorded" : layout;
}

int inspect(const std::string& given) {
  const std::string path = resolve(given);
  const io::CheckpointReader reader(path);
  std::printf("checkpoint %s\n", reader.path().c_str());
  std::printf("step: %lld\n", static_cast<long long>(reader.step()));
  std::printf("saved by: %d rank%s\n", reader.ranks_saved(), reader.ranks_saved() == 1 ? "" : "s");
  std::printf("format: %lld (%s)\n", static_cast<long long>(reader.format()),
              reader.format() >= 2 ? "every rank's file and an index of whole tensors" : "one file written by rank 0");
  std::printf("layout: %s\n", layout_of(reader.metadata()).c_str());
  std::printf("metadata: %zu key%s\n", reader.metadata().size(), reader.metadata().size() == 1 ? "" : "s");
  for (const auto& [key, value] : reader.metadata()) std::printf("  %s = %s\n", key.c_str(), shorten(value).c_str());

  std::printf("rank state:\n");
  for (int rank = 0; rank < reader.ranks_saved(); ++rank) {
    std::string keys;
    for (const std::string& key : reader.rank_state_keys(rank)) {
      const auto bytes = reader.rank_state(rank, key);
      keys += (keys.empty() ? "" : ", ") + key + " (" + std::to_string(bytes ? bytes->size() : 0) + " B)";
    }
    if (!keys.empty()) std::printf("  rank %d: %s\n", rank, keys.c_str());
  }

  const std::vector<std::string> bad = reader.verify();
  size_t name_width = 4, shape_width = 5;
  double total = 0;
  for (const io::StoredTensor& tensor : reader.tensors()) {
    name_width = std::max(name_width, tensor.name.size());
    shape_width = std::max(shape_width, tensor.shape.to_string().size());
    total += double(tensor.shape.numel()) * double(dtype_size(tensor.dtype));
  }
  std::printf("tensors: %zu (%s)\n", reader.tensors().size(), human_bytes(total).c_str());
  const bool pieces = reader.format() >= 2;  // a CRC per stored piece, not per tensor
  std::printf("  %-*s  %-*s  %-5s  %10s  %-10s  %s\n", int(name_width), "name", int(shape_width), "shape", "dtype",
              "size", pieces ? "crc32s" : "crc32", "checksum");
  for (const io::StoredTensor& tensor : reader.tensors()) {
    const bool ok = std::find(bad.begin(), bad.end(), tensor.name) == bad.end();
    const double bytes = double(tensor.shape.numel()) * double(dtype_size(tensor.dtype));
    char crc[32];
    if (pieces)
      std::snprintf(crc, sizeof crc, "%d piece%s", tensor.pieces, tensor.pieces == 1 ? "" : "s");
    else
      std::snprintf(crc, sizeof crc, "0x%08x", tensor.crc32);
    std::printf("  %-*s  %-*s  %-5s  %10s  %-10s  %s\n", int(name_width), tensor.name.c_str(), int(shape_width),
                tensor.shape.to_string().c_str(), std::string(dtype_name(tensor.dtype)).c_str(),
                human_bytes(bytes).c_str(), crc, ok ? "ok" : "MISMATCH");
  }
  for (const auto& [name, complaint] : reader.damaged())
    std::printf("  %-*s  DAMAGED: HDF5 cannot read its header (%s)\n", int(name_width), name.c_str(),
                complaint.c_str());
  if (bad.empty()) {
    std::printf("checksums: all %zu tensors verified\n", reader.tensors().size());
    return 0;
  }
  std::string names;
  for (const std::string& name : bad) names += (names.empty() ? "" : ", ") + name;
  const size_t damaged = reader.damaged().size();
  std::printf("checksums: %zu of %zu tensors do not match%s\n", bad.size() - damaged, reader.tensors().size(),
              damaged ? (", " + std::to_string(damaged) + " damaged").c_str() : "");
  std::fprintf(stderr,
               "tessera checkpoint inspect: checksum mismatch%s in %zu tensor%s of %s: %s; the checkpoint is corrupt, "
               "use an earlier one\n",
               damaged ? " or a damaged header" : "", bad.size(), bad.size() == 1 ? "" : "s", reader.path().c_str(),
               names.c_str());
  return 1;
}

int list(const std::string& dir) {
  std::error_code error;
  TESSERA_CHECK(fs::is_directory(dir, error), "tessera checkpoint list: ", dir, " is not a directory");
  const std::vector<std::string> checkpoints = io::list_checkpoints(dir);
  const auto latest = io::find_latest_checkpoint(dir);
  std::printf("%s: %zu checkpoint%s%s\n", dir.c_str(), checkpoints.size(), checkpoints.size() == 1 ? "" : "s",
              latest ? (", latest " + fs::path(*latest).filename().string()).c_str() : "");
  for (const std::string& path : checkpoints) {
    const auto size = fs::file_size(fs::path(path) / "checkpoint.h5", error);
    std::printf("  %s  %10s%s\n", fs::path(path).filename().c_str(), error ? "?" : human_bytes(double(size)).c_str(),
                latest && *latest == path ? "  <- latest" : "");
  }
  std::vector<std::string> leftovers;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.starts_with(".step_") && name.ends_with(".tmp")) leftovers.push_back(name);
  }
  std::sort(leftovers.begin(), leftovers.end());
  for (const std::string& name : leftovers)
    std::printf("  %s  incomplete (an interrupted save; the next save removes it)\n", name.c_str());
  return 0;
}

}  // namespace

void register_checkpoint_command(CLI::App& app, int& exit_code) {
  auto* checkpoint = app.add_subcommand("checkpoint", "Inspect and verify checkpoints written by train --save");
  checkpoint->require_subcommand(1);

  auto inspect_path = std::make_shared<std::string>();
  auto* inspect_command = checkpoint->add_subcommand(
      "inspect", "Print a checkpoint's step, layout, metadata and tensors, and verify every checksum");
  inspect_command
      ->add_option("path", *inspect_path, "A step directory, its checkpoint.h5, or a save directory (its latest)")
      ->required();
  inspect_command->callback([inspect_path, &exit_code] { exit_code = inspect(*inspect_path); });

  auto list_dir = std::make_shared<std::string>();
  auto* list_command = checkpoint->add_subcommand("list", "List a save directory's checkpoints and which is latest");
  list_command->add_option("dir", *list_dir, "The save directory (train --save DIR)")->required();
  list_command->callback([list_dir, &exit_code] { exit_code = list(*list_dir); });
}

void register_export_command(CLI::App& app, int& exit_code) {
  struct Arguments {
    std::string checkpoint, output, max_shard_size = "5GB";
    io::ExportOptions options;
  };
  auto args = std::make_shared<Arguments>();
  auto* command = app.add_subcommand("export",
                                     "Write a checkpoint's weights as safetensors (Tessera's names, or Hugging Face "
                                     "GPT-2's or Llama's with a config.json and the tokenizer beside them)");
  command
      ->add_option("checkpoint", args->checkpoint,
                   "A step directory, its checkpoint.h5, or a save directory (its latest)")
      ->required();
  command
      ->add_option("-o,--output", args->output,
                   "tessera: the safetensors file to write; hf-gpt2, hf-llama, hf-mixtral: the directory to write "
                   "model.safetensors (or shards and their index), config.json and the tokenizer into, as "
                   "save_pretrained(DIR) (hf-gpt2 also DIR/NAME.safetensors: one file)")
      ->required();
  command
      ->add_option("--format", args->options.format,
                   "tessera: the parameters under Tessera's names; hf-gpt2: Hugging Face GPT-2's names and layouts "
                   "and config.json, for GPT2LMHeadModel.from_pretrained(DIR); hf-llama: a --model llama checkpoint "
                   "for LlamaForCausalLM and AutoTokenizer.from_pretrained(DIR); hf-mixtral: one with experts in every "
                   "block (--num-experts) for MixtralForCausalLM")
      ->check(CLI::IsMember({"tessera", "hf-gpt2", "hf-llama", "hf-mixtral"}))
      ->capture_default_str();
  command->add_option("--tokenizer", args->options.tokenizer_data,
                      "hf-gpt2, hf-llama, hf-mixtral: the dataset whose tokenizer to write as vocab.json and merges.txt "
                      "(default: the data the checkpoint was trained on)");
  command
      ->add_option("--max-shard-size", args->max_shard_size,
                   "hf-gpt2, hf-llama, hf-mixtral with -o DIR: above this size the weights go into shards "
                   "model-0000i-of-0000N.safetensors with model.safetensors.index.json, as transformers' "
                   "save_pretrained(max_shard_size=...): 5GB, 500MB, 10KB (powers of 1000), 2GiB, or bytes")
      ->capture_default_str();
  command->add_flag("--force", args->options.force,
                    "hf-gpt2, hf-llama, hf-mixtral: write into an existing non-empty directory, replacing the files of the "
                    "export there (and removing weights of an earlier save there)");
  command->callback([args, &exit_code] {
    args->options.max_shard_bytes = io::parse_shard_size(args->max_shard_size, "export: --max-shard-size");
    const io::ExportResult result = io::export_checkpoint(resolve(args->checkpoint), args->output, args->options);
    std::printf("wrote %s: %lld tensors, %s\n", result.weights.c_str(), static_cast<long long>(result.tensors),
                human_bytes(double(result.bytes)).c_str());
    if (!result.shards.empty()) std::printf("  and the %zu shards it names\n", result.shards.size());
    for (const std::string* written : {&result.config, &result.vocab, &result.merges, &result.tokenizer_config})
      if (!written->empty()) std::printf("wrote %s\n", written->c_str());
    if (!result.tokenizer_note.empty()) std::printf("%s\n", result.tokenizer_note.c_str());
    exit_code = 0;
  });
}

}  // namespace tessera::app
