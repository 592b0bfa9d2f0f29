// `tessera generate` (apps/generate_command.h): the flags, then the library:
// the checkpoint's model built for this rank's tensor-parallel shard
// (models::build_stage_model), its weights read (io::read_parameters), the
// prompt encoded with the dataset's tokenizer (io/tokenizer.h), the tokens
// generated (models::generate) and printed by rank 0 as they come.
#include "apps/generate_command.h"

#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/error.h"
#include "core/units.h"
#include "io/checkpoint.h"
#include "io/model_weights.h"
#include "io/tokenizer.h"
#include "models/generation.h"
#include "parallel/layout.h"
#include "parallel/process_group.h"
#include "models/stage_model.h"
#include "parallel/tensor_parallel.h"

namespace tessera::app {
namespace {

struct GenerateArguments {
  std::string checkpoint, prompt, prompt_ids, tokenizer, device = "cpu";
  models::GenerationOptions generation;
  int tensor_parallel = 0;  // 0: every rank
  int threads = 0;
  bool print_ids = false;
};

// --prompt-ids "3,17,4" → ids, each inside the model's vocabulary of `vocab_size`.
std::vector<int32_t> parse_prompt_ids(const std::string& text, int64_t vocab_size) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TESSERA_CHECK(used == item.size() && used > 0 && id >= 0 && id <= INT32_MAX, "--prompt-ids: '", item,
                  "' is not a token id; give non-negative integers separated by commas (--prompt-ids 15,7,42)");
    TESSERA_CHECK(id < vocab_size, "--prompt-ids: id ", id, " (at position ", ids.size() + 1,
                  " of the list) is outside the checkpoint's vocabulary of ", vocab_size,
                  " tokens; give ids from 0 to ", vocab_size - 1);
    ids.push_back(int32_t(id));
  }
  return ids;
}

// The tokenizer of --tokenizer, or of the dataset the checkpoint was trained on.
io::Tokenizer open_tokenizer(const GenerateArguments& args, const io::CheckpointReader& reader, int64_t vocab_size) {
  if (!args.tokenizer.empty()) return io::Tokenizer::of_dataset(args.tokenizer, vocab_size, "generate: --tokenizer");
  const auto data = reader.metadata().find("config.data");
  TESSERA_CHECK(data != reader.metadata().end() && !data->second.empty(), "generate: checkpoint ", reader.path(),
                " does not name its training data (trained on --synthetic data?); give --tokenizer DATASET.h5, "
                "or --prompt-ids with --print-ids");
  const std::string& path = data->second;
  std::error_code error;
  TESSERA_CHECK(std::filesystem::exists(path, error), "generate: the checkpoint was trained on ", path,
                ", which is not here (a relative path is relative to where `tessera train` ran); give --tokenizer "
                "with that dataset's path, or --prompt-ids with --print-ids");
  std::optional<io::Tokenizer> tokenizer = io::Tokenizer::for_model_data(path, vocab_size);
  TESSERA_CHECK(tokenizer.has_value(), "generate: ", path, " stores no tokenizer and the model's vocabulary is ",
                vocab_size,
                ", not the 256 bytes of `prepare text`; give --tokenizer (a dataset from `prepare text "
                "--tokenizer bpe`), or --prompt-ids with --print-ids");
  return std::move(*tokenizer);
}

// Refuses a rank count the trained model does not split over, naming those it does.
void check_rank_count(const nn::ModelConfig& config, int ranks) {
  if (parallel::tensor_parallel_problem(config, ranks, false).empty()) return;
  std::vector<std::string> counts;
  for (const int size : parallel::tensor_parallel_sizes(config)) counts.push_back(std::to_string(size));
  TESSERA_THROW("generate: the checkpoint's GPT (", config.num_heads, " heads, a vocabulary of ", config.vocab_size,
                ", an MLP of ", config.ffn(), ") cannot be split over ", ranks,
                " ranks: each rank must hold whole heads and an equal share of the vocabulary and the MLP, and a "
                "trained model's sizes are fixed; run generate on ",
                human_list(counts, "or"), " rank(s) (mpirun -np N)");
}

// Bytes to stdout as they are (a token may hold any byte, NUL included).
void write_text(const std::string& bytes) {
  std::fwrite(bytes.data(), 1, bytes.size(), stdout);
}

// Rank 0 prints each token's text as it comes (or its id).
class TokenPrinter {
 public:
  TokenPrinter(const io::Tokenizer* tokenizer, bool print_ids, bool speak)
      : tokenizer_(tokenizer), print_ids_(print_ids), speak_(speak) {}
  void operator()(int32_t token) const {
    if (!speak_) return;
    if (print_ids_ || !tokenizer_)
      std::printf("%d ", token);
    else
      write_text(tokenizer_->decode(std::span<const int32_t>(&token, 1)));
    std::fflush(stdout);
  }

 private:
  const io::Tokenizer* tokenizer_;
  bool print_ids_, speak_;
};

void run_generate(const GenerateArguments& args, const parallel::MpiEnv& env) {
  ContextOptions context_options;
  context_options.cpu_threads = args.threads;
  Context ctx(context_options);
  const Device device = env.device_for_flag(args.device);
  const bool root = env.world_rank() == 0;
  const std::string path = io::resolve_checkpoint(args.checkpoint, "tessera generate");
  const io::CheckpointReader reader(path);
  const io::CheckpointModel saved = io::checkpoint_model(reader);
  TESSERA_CHECK(nn::model_traits(saved.config.kind).reads_tokens, "generate: checkpoint ", path, " holds a ",
                nn::model_name(saved.config.kind), " model; only language models (gpt, llama) generate text");
  const int tp = args.tensor_parallel > 0 ? args.tensor_parallel : env.world_size();
  TESSERA_CHECK(tp == env.world_size(), "generate: --tensor-parallel ", tp, " must equal the number of ranks (",
                env.world_size(), "): generation runs one tensor-parallel group");
  check_rank_count(saved.config, tp);
  // The prompt before the weights: a prompt that cannot run is refused at once.
  std::optional<io::Tokenizer> tokenizer;
  if (args.prompt_ids.empty() || !args.print_ids) tokenizer = open_tokenizer(args, reader, saved.config.vocab_size);
  const std::vector<int32_t> prompt = args.prompt_ids.empty()
                                          ? tokenizer->encode(args.prompt)
                                          : parse_prompt_ids(args.prompt_ids, saved.config.vocab_size);
  models::check_prompt(saved.config, prompt, args.generation);

  std::unique_ptr<parallel::Communicator> world =
      parallel::make_communicator(MPI_COMM_WORLD, "world", ctx, device, parallel::CommBackend::automatic);
  parallel::LayoutSizes sizes;
  sizes.tp = tp;
  parallel::Layout layout(*world, sizes);
  nn::ModelSpec spec{&ctx, device, saved.dtype, 0};
  models::StageModel stage = models::build_stage_model(saved.config, spec, layout, false, "");
  io::read_parameters(reader, stage.module->parameters());
  TESSERA_CHECK(stage.causal_lm != nullptr, "generate: ", path, " holds --model ", nn::model_name(saved.config.kind),
                ", which does not generate text; only language models do (gpt, llama)");
  models::CausalLm& model = *stage.causal_lm;

  if (root) {
    std::fprintf(stderr, "generate: %s (step %lld, %s), %zu prompt tokens, on %d rank(s), %s\n", path.c_str(),
                 static_cast<long long>(reader.step()), std::string(dtype_name(saved.dtype)).c_str(), prompt.size(), tp,
                 device.to_string().c_str());
    if (args.print_ids || !tokenizer)
      for (const int32_t id : prompt) std::printf("%d ", id);
    else
      write_text(tokenizer->decode(prompt));
  }
  const TokenPrinter print(tokenizer ? &*tokenizer : nullptr, args.print_ids, root);
  models::GenerationOptions options = args.generation;
  if (tokenizer) options.vocab_limit = tokenizer->vocab_size();  // never the padding ids, which no text has
  const models::GenerationResult result = models::generate(model, prompt, options, print);
  if (!root) return;
  std::printf("\n");
  std::fflush(stdout);
  std::fprintf(stderr, "generate: %zu tokens; the prompt in %.3f s, then %.1f tokens/s; KV cache %s per rank\n",
               result.tokens.size(), result.prompt_seconds, result.tokens_per_second(),
               human_bytes(double(result.cache_bytes)).c_str());
}

}  // namespace

void register_generate_command(CLI::App& app, std::optional<parallel::MpiEnv>& mpi, int& exit_code) {
  auto args = std::make_shared<GenerateArguments>();
  auto* command = app.add_subcommand(
      "generate", "Generate text with a trained GPT (a checkpoint of any layout; under mpirun, tensor-parallel)");
  command
      ->add_option("checkpoint", args->checkpoint,
                   "A step directory, its checkpoint.h5, or a save directory (its latest)")
      ->required();
  auto* prompt = command->add_option("--prompt", args->prompt, "The text to continue (encoded with the tokenizer)");
  command->add_option("--prompt-ids", args->prompt_ids, "The prompt as token ids: 15,7,42")->excludes(prompt);
  command->add_option("--max-new-tokens", args->generation.max_new_tokens, "Tokens to generate")->capture_default_str();
  command
      ->add_option("--temperature", args->generation.sampling.temperature,
                   "Softmax temperature; 0 is greedy (the most likely token each time)")
      ->capture_default_str();
  command->add_option("--top-k", args->generation.sampling.top_k, "Sample from the k most likely tokens (0: all)")
      ->capture_default_str();
  command
      ->add_option("--top-p", args->generation.sampling.top_p,
                   "Sample from the fewest most likely tokens whose probability reaches p (1: all)")
      ->capture_default_str();
  command->add_option("--seed", args->generation.sampling.seed, "Seed of the draws (the same seed, the same text)")
      ->capture_default_str();
  command->add_option(
      "--tokenizer", args->tokenizer,
      "A dataset from `tessera prepare text` whose tokenizer to use (default: the checkpoint's --data)");
  command->add_flag("--print-ids", args->print_ids, "Print token ids instead of text");
  command->add_flag("--kv-cache,!--no-kv-cache", args->generation.use_cache,
                    "Keep every layer's keys and values (default); --no-kv-cache runs the whole sequence for every "
                    "token (for comparisons)");
  command->add_option("--device", args->device, "cpu, cuda (the local rank's GPU), cuda:N or emu")
      ->capture_default_str();
  command->add_option("--tensor-parallel,--tp", args->tensor_parallel,
                      "Ranks the model is split over (default: every rank of mpirun; must equal them)");
  command->add_option("--threads", args->threads, "CPU threads (0: OpenMP's default)");
  command->callback([args, &mpi, &exit_code] {
    TESSERA_CHECK(!args->prompt.empty() || !args->prompt_ids.empty(),
                  "generate: give a prompt: --prompt TEXT or --prompt-ids 15,7,42");
    mpi.emplace();
    run_generate(*args, *mpi);
    exit_code = 0;
  });
}

}  // namespace tessera::app
