// The training run: set-up from TrainConfig (MPI world, process layout,
// data-parallel replica, sharded loader, resuming from a checkpoint), the
// run's features registered as components of the training loop
// (io/training_events.h: metrics, progress, Prometheus and stragglers,
// MLflow, evaluation, samples, checkpoint cadence, stop decisions), and the
// steps (StepLoop: each one parallel::TrainStep::run over the step's
// micro-batches, parallel/train_step.h; here the stop after too many
// non-finite steps), each raising the loop's events for the components.
#include "apps/trainer.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "apps/expert_load.h"
#include "apps/plan_command.h"
#include "apps/preemption.h"
#include "apps/rank_agreement.h"
#include "apps/train_checkpoint.h"
#include "apps/train_evaluation.h"
#include "apps/train_monitor.h"
#include "apps/train_reports.h"
#include "apps/train_samples.h"
#include "apps/train_stops.h"
#include "apps/train_tracking.h"
#include "core/context.h"
#include "core/device_runtime.h"
#include "core/fault.h"
#include "core/process_end.h"
#include "io/checkpoint.h"
#include "io/dataset.h"
#include "io/hf_llama.h"
#include "io/loader.h"
#include "io/metrics.h"
#include "io/model_weights.h"
#include "io/progress.h"
#include "io/save_lock.h"
#include "io/trace.h"
#include "io/training_events.h"
#include "kernels/ops.h"
#include "models/stage_model.h"
#include "nn/grad_scaler.h"
#include "nn/lr_schedule.h"
#include "nn/models.h"
#include "nn/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/layout.h"
#include "parallel/library_versions.h"
#include "parallel/local_communicator.h"
#include "parallel/memory_plan.h"
#include "parallel/mpi_env.h"
#include "parallel/pipeline.h"
#include "parallel/process_group.h"
#include "parallel/ring_attention.h"
#include "parallel/tensor_parallel.h"
#include "parallel/topology.h"
#include "parallel/train_step.h"

namespace tessera::app {
namespace {

using Clock = std::chrono::steady_clock;

DType compute_dtype(const std::string& precision) {
  if (precision == "bf16") return DType::bf16;
  if (precision == "fp16") return DType::f16;
  return DType::f32;
}

// The GPT's vocabulary without --vocab-size and without data (--synthetic).
constexpr int64_t kSyntheticVocabSize = 256;

// `vocab` rounded up to a multiple of `multiple` (Megatron-LM's
// --make-vocab-size-divisible-by: rows of the table that no token uses, for
// GEMM-friendly shapes).
int64_t padded_vocab_size(int64_t vocab, int64_t multiple) {
  return (vocab + multiple - 1) / multiple * multiple;
}

// Without --vocab-size: where the GPT's vocabulary came from, for the start-up lines.
std::string describe_vocabulary(const TrainConfig& c, const nn::ModelConfig& m,
                                const std::optional<io::DatasetInfo>& data) {
  if (!nn::model_traits(m.kind).reads_tokens || c.vocab_size > 0) return {};
  if (!data)
    return "vocabulary: " + std::to_string(m.vocab_size) + " (--synthetic; --vocab-size to change it)";
  std::string text = "vocabulary: " + std::to_string(m.vocab_size) + " from " + data->path;
  if (m.vocab_size != data->vocab_size)
    text += " (its " + std::to_string(data->vocab_size) + " tokens padded to a multiple of " +
            std::to_string(c.make_vocab_size_divisible_by) + ", --make-vocab-size-divisible-by)";
  return text + "; --vocab-size to choose another";
}

// Whether --init-from names a Hugging Face Llama or Mixtral (a directory with a config.json) for --model llama.
bool init_from_hf_llama(const TrainConfig& c) {
  std::error_code error;
  return c.model == nn::ModelKind::llama && !c.init_from.empty() &&
         std::filesystem::is_regular_file(std::filesystem::path(c.init_from) / "config.json", error);
}

// A Mixtral's experts (every block's MLP); flags that ask for another
// mixture, or for experts in a Llama, refused naming both values.
template <typename Take>
void take_hf_experts(const TrainConfig& c, const io::HfLlamaConfig& hf, nn::ModelConfig& m, const Take& take) {
  const std::string file = (std::filesystem::path(c.init_from) / "config.json").string();
  if (!hf.mixtral()) {
    TESSERA_CHECK(c.num_experts == 0, "--num-experts ", c.num_experts, " disagrees with ", file,
                  ": a LlamaForCausalLM has dense MLPs; drop --num-experts (or give a Mixtral)");
    return;
  }
  take("--num-experts", "num_local_experts", m.num_experts, hf.num_local_experts);
  take("--moe-router-topk", "num_experts_per_tok", m.moe_router_topk, hf.num_experts_per_tok);
  take("--moe-ffn-hidden-size", "intermediate_size", m.moe_ffn_hidden_size, hf.intermediate_size);
  TESSERA_CHECK(m.moe_layer_freq == "1", "--moe-layer-freq ", m.moe_layer_freq, " disagrees with ", file,
                ": a Mixtral has experts in every block; drop --moe-layer-freq");
}

// --init-from DIR holding a Hugging Face Llama: its config.json gives the
// model's dimensions where the flags do not; a flag that disagrees is refused
// naming both values.
void take_hf_llama_dimensions(const TrainConfig& c, nn::ModelConfig& m) {
  const io::HfLlamaConfig hf = io::read_hf_llama_config(c.init_from);
  const std::string file = (std::filesystem::path(c.init_from) / "config.json").string();
  const auto take = [&](const char* flag, const char* key, auto& field, auto value) {
    using Field = std::decay_t<decltype(field)>;
    TESSERA_CHECK(!c.given.count(flag) || field == Field(value), flag, " ", field, " disagrees with ", key, " ",
                  value, " in ", file, ": the weights are of that size; drop ", flag, " (it is taken from there)");
    field = Field(value);
  };
  TESSERA_CHECK(c.normalization != "LayerNorm" && c.position_embedding_type != "learned_absolute",
                c.normalization == "LayerNorm" ? "--normalization LayerNorm" : "--position-embedding-type learned_absolute",
                " disagrees with ", file, ": a Hugging Face Llama has RMSNorm and rotary embeddings; drop the flag");
  take("--hidden-size", "hidden_size", m.hidden_size, hf.hidden_size);
  take("--num-layers", "num_hidden_layers", m.num_layers, hf.num_hidden_layers);
  take("--num-heads", "num_attention_heads", m.num_heads, hf.num_attention_heads);
  take("--num-query-groups", "num_key_value_heads", m.num_query_groups, hf.num_key_value_heads);
  if (!hf.mixtral())  // a Mixtral's intermediate_size is its experts' width (every block has experts)
    take("--ffn-hidden-size", "intermediate_size", m.ffn_hidden_size, hf.intermediate_size);
  take("--rotary-base", "rope_theta", m.rotary_base, hf.rope_theta);
  take("--norm-epsilon", "rms_norm_eps", m.norm_epsilon, hf.rms_norm_eps);
  take_hf_experts(c, hf, m, take);
  TESSERA_CHECK(!c.given.count("--untie-embeddings-and-output-weights") || !hf.tie_word_embeddings,
                "--untie-embeddings-and-output-weights disagrees with tie_word_embeddings true in ", file,
                ": the model has no LM head of its own; drop the flag");
  m.untie_embeddings = !hf.tie_word_embeddings;
  TESSERA_CHECK(!c.given.count("--vocab-size") || c.vocab_size == hf.vocab_size, "--vocab-size ", c.vocab_size,
                " disagrees with vocab_size ", hf.vocab_size, " in ", file,
                ": the weights are of that size; drop --vocab-size (it is taken from there)");
  m.vocab_size = hf.vocab_size;
}

// The model's configuration from the flags and, when there is data, from the
// dataset (input shape and classes, or vocabulary).
nn::ModelConfig model_config(const TrainConfig& c, const std::optional<io::DatasetInfo>& data) {
  nn::ModelConfig m;
  m.kind = c.model;
  m.hidden = c.hidden;
  m.vocab_size = c.vocab_size > 0 ? c.vocab_size : kSyntheticVocabSize;
  m.seq_length = c.seq_length;
  m.num_layers = c.num_layers;
  m.num_heads = c.num_heads;
  m.hidden_size = c.hidden_size;
  m.ffn_hidden_size = c.ffn_hidden_size;
  m.dropout = c.hidden_dropout;
  m.attention_dropout = c.attention_dropout;
  m.recompute = c.recompute;
  m.num_query_groups = c.group_query_attention ? c.num_query_groups : 0;
  m.rotary_base = c.rotary_base;
  m.norm_epsilon = c.norm_epsilon;
  m.num_experts = c.num_experts;
  m.moe_router_topk = c.moe_router_topk;
  m.moe_layer_freq = c.moe_layer_freq;
  m.moe_ffn_hidden_size = c.moe_ffn_hidden_size;
  m.moe_aux_loss_coeff = c.moe_aux_loss_coeff;
  m.moe_z_loss_coeff = c.moe_z_loss_coeff;
  m.moe_expert_capacity_factor = c.moe_expert_capacity_factor;
  // The decoder's switches given (each on its own); the others keep the model's defaults.
  if (!c.normalization.empty())
    m.normalization = c.normalization == "RMSNorm" ? nn::Normalization::rms_norm : nn::Normalization::layer_norm;
  if (!c.position_embedding_type.empty()) m.rotary = c.position_embedding_type == "rope";
  if (c.swiglu) m.swiglu = true;
  if (c.disable_bias_linear) m.bias = false;
  if (c.untie_embeddings) m.untie_embeddings = true;
  if (init_from_hf_llama(c)) take_hf_llama_dimensions(c, m);
  if (!data) return m;
  const bool wants_tokens = nn::model_traits(m.kind).reads_tokens;
  const bool has_tokens = data->kind == io::DatasetKind::tokens;
  TESSERA_CHECK(wants_tokens == has_tokens, "--model ", c.model, " needs ",
                wants_tokens ? "a token dataset (tessera prepare text)" : "an image dataset (tessera prepare idx)",
                " but ", data->path, " holds ", has_tokens ? "tokens" : "images");
  if (has_tokens && init_from_hf_llama(c)) {
    TESSERA_CHECK(data->vocab_size <= m.vocab_size, data->path, " holds token ids up to ", data->vocab_size - 1,
                  ", outside the vocabulary of ", m.vocab_size, " of --init-from ", c.init_from,
                  "; prepare the data with that model's tokenizer");
  } else if (has_tokens && c.vocab_size == 0) {
    m.vocab_size = padded_vocab_size(data->vocab_size, c.make_vocab_size_divisible_by);
  } else if (has_tokens) {
    TESSERA_CHECK(c.vocab_size >= data->vocab_size, "--vocab-size ", c.vocab_size, " is smaller than the vocabulary (",
                  data->vocab_size, ") of ", data->path, "; raise --vocab-size to at least ", data->vocab_size);
  } else {
    m.channels = data->channels;
    m.height = data->height;
    m.width = data->width;
    m.num_classes = data->num_classes;
  }
  return m;
}

// Where batches come from: a prepared file through the background loader, or
// one fixed random batch of the model's shapes (--synthetic). Either way rank
// r of `ranks` data-parallel ranks gets samples [r·B, (r+1)·B) of a global
// batch of ranks·B, so N ranks with micro-batch B see what one rank sees with
// micro-batch N·B.
//
// A resumed run starts at `start`: the sample of the epoch's order where the
// checkpointed run's next global batch began, which must fall on a global
// batch boundary of this run (micro-batch x ranks).
class BatchSource {
 public:
  // token_positions: under context parallelism the positions of each
  // sequence this rank holds (its zigzag share); empty: all.
  BatchSource(Context& ctx, const TrainConfig& c, const nn::ModelConfig& m, Device device, DType dtype, int rank,
              int ranks, const SamplerPosition& start, const std::vector<int64_t>& token_positions = {})
      : global_(c.micro_batch_size * ranks) {
    if (!c.synthetic) {
      io::LoaderOptions options;
      options.token_positions = token_positions;
      options.batch_size = c.micro_batch_size;
      options.seed = c.seed;
      options.device = device;
      options.input_dtype = dtype;
      options.seq_length = c.seq_length;
      options.shard_rank = rank;
      options.shard_count = ranks;
      options.start_epoch = start.epoch;
      TESSERA_CHECK(start.samples % global_ == 0, "--resume: the checkpoint's data position is sample ", start.samples,
                    " of epoch ", start.epoch, ", not a multiple of this run's micro-batch over all ranks (",
                    c.micro_batch_size, " x ", ranks, " = ", global_,
                    "); resume with a --micro-batch-size and rank count whose product divides it");
      if (const int64_t step = start.samples / global_; step > 0) {
        // This layout's epoch may hold fewer global batches than the saving
        // run's (the dropped remainder differs): then the epoch is over.
        const int64_t steps = io::DataLoader(ctx, c.data, options).batches_per_epoch();
        if (step < steps)
          options.start_step = step;
        else
          ++options.start_epoch;
      }
      loader_ = std::make_unique<io::DataLoader>(ctx, c.data, options);
      ctx_ = &ctx;
      path_ = c.data;
      options_ = options;
      return;
    }
    // The global batch, drawn whole on every rank (sample i is the i-th draw
    // of its generator, whatever the number of ranks); this rank keeps its slice.
    const int64_t b = c.micro_batch_size, global = b * ranks, first = int64_t(rank) * b;
    if (nn::model_traits(m.kind).reads_tokens) {
      const int64_t t = c.seq_length;
      std::mt19937_64 ids_rng(c.seed), next_rng(c.seed ^ 0x9e3779b97f4a7c15ull);
      std::uniform_int_distribution<int32_t> token(0, int32_t(m.vocab_size - 1));
      std::vector<int32_t> ids(size_t(global * t)), next(ids.size());
      for (auto& v : ids) v = token(ids_rng);
      for (auto& v : next) v = token(next_rng);
      std::vector<int64_t> kept = token_positions;
      if (kept.empty()) {
        kept.resize(size_t(t));
        std::iota(kept.begin(), kept.end(), int64_t(0));
      }
      const auto slice = [&](const std::vector<int32_t>& all) {
        std::vector<int32_t> mine;
        for (int64_t row = first; row < first + b; ++row)
          for (const int64_t position : kept) mine.push_back(all[size_t(row * t + position)]);
        return mine;
      };
      const int64_t columns = int64_t(kept.size());
      synthetic_.inputs = ctx.from_vector(Shape{b, columns}, slice(ids), device);
      synthetic_.targets = ctx.from_vector(Shape{b, columns}, slice(next), device);
    } else {
      synthetic_.inputs = ctx.empty(Shape{b, m.channels, m.height, m.width}, dtype, device);
      synthetic_.inputs.uniform_at_(c.seed, 7, uint64_t(first * m.channels * m.height * m.width), 0.0f, 1.0f);
      std::mt19937_64 rng(c.seed);
      std::uniform_int_distribution<int32_t> label(0, int32_t(m.num_classes - 1));
      std::vector<int32_t> labels(static_cast<size_t>(global));
      for (auto& v : labels) v = label(rng);
      synthetic_.targets =
          ctx.from_vector(Shape{b}, std::vector<int32_t>(labels.begin() + first, labels.begin() + first + b), device);
    }
  }

  io::Batch next() { return loader_ ? loader_->next() : synthetic_; }
  // Batches per epoch; 0 for synthetic data (no epochs).
  int64_t batches_per_epoch() const { return loader_ ? loader_->batches_per_epoch() : 0; }
  // Where the batch after `batch` starts (for checkpoints; synthetic data has no position).
  SamplerPosition after(const io::Batch& batch) const {
    if (!loader_) return {};
    int64_t epoch = batch.epoch, step = batch.step_in_epoch + 1;
    if (step == loader_->batches_per_epoch()) {
      step = 0;
      ++epoch;
    }
    return {epoch, step * global_};
  }

  // TESSERA_FAULT=truncated_data: this rank goes on reading from a copy of
  // its data file cut to half its bytes (in the temporary directory, removed
  // again), so the real readers' checks meet a really truncated file in the
  // middle of a run. Synthetic data reads no file: nothing happens.
  void read_truncated_copy() {
    if (!loader_) return;
    namespace fs = std::filesystem;
    const fs::path copy = fs::temp_directory_path() / ("tessera-truncated-" + std::to_string(::getpid()) + "-" +
                                                       fs::path(path_).filename().string());
    struct RemoveAtEnd {
      fs::path path;
      ~RemoveAtEnd() {
        std::error_code ignored;
        fs::remove(path, ignored);
      }
    } remove_at_end{copy};
    fs::copy_file(path_, copy, fs::copy_options::overwrite_existing);
    fs::resize_file(copy, fs::file_size(copy) / 2);
    loader_ = std::make_unique<io::DataLoader>(*ctx_, copy.string(), options_);
  }

 private:
  int64_t global_;  // samples of one micro-batch over all ranks
  std::unique_ptr<io::DataLoader> loader_;
  io::Batch synthetic_;
  // What made loader_ (for read_truncated_copy).
  Context* ctx_ = nullptr;
  std::string path_;
  io::LoaderOptions options_;
};

// The tensor to name when a run stops on non-finite gradients (this rank's view).
std::string non_finite_gradient_text(parallel::DataParallel& replica) {
  const std::string name = replica.first_non_finite_gradient();
  if (!name.empty()) return name;
  return replica.zero_stage() >= 2 ? "(none in this rank's pieces: another rank's, or the norm itself overflowed)"
                                   : "(none: the norm itself overflowed)";
}

// TESSERA_FAULT (core/fault.h) at the start of step `step` (1-based) on
// world rank `rank`: crash (the process dies at once, SIGKILL), hang (it
// stops for good, never reaching its next collective), slow (it sleeps 2 s),
// truncated_data (its data file is read as a truncated copy from now on),
// device_fault (its device faults as after an illegal memory access).
void inject_step_faults(int64_t step, int rank, BatchSource& source, Device device) {
  const auto announce = [&](const char* kind) {
    std::fprintf(stderr, "tessera: TESSERA_FAULT: %s at step %lld on rank %d\n", kind, static_cast<long long>(step),
                 rank);
    std::fflush(stderr);
  };
  if (fault_due("crash", step, rank)) {
    announce("crash");
    end_process(ProcessEnd::injected_crash, 128 + SIGKILL);
  }
  if (fault_due("hang", step, rank)) {
    announce("hang");
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  if (fault_due("slow", step, rank)) {
    announce("slow");
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  if (fault_due("truncated_data", step, rank)) {
    announce("truncated_data");
    source.read_truncated_copy();
  }
  if (fault_due("device_fault", step, rank)) {
    announce("device_fault");
    provoke_device_fault(device);
  }
}

// TESSERA_FAULT=startup_hang (core/fault.h): this rank stops for good during
// start-up, before the first step, as a check or a load that never ends.
void inject_start_up_fault(int rank) {
  if (!fault_due("startup_hang", 0, rank)) return;
  std::fprintf(stderr, "tessera: TESSERA_FAULT: startup_hang on rank %d\n", rank);
  std::fflush(stderr);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// --device cuda: the local rank's GPU under MPI; --device emu likewise the
// local rank's emulated device; otherwise as given.
Device choose_device(const TrainConfig& c, const parallel::MpiEnv* env) {
  return env ? env->device_for_flag(c.device) : parse_device(c.device);
}

// A device fault (a kernel that failed after it was queued) is found by
// whichever call touches the device next, which did not cause it: say so,
// with the last operation dispatched to the device.
Error explain_device_fault(const Error& error, const Context& ctx, Device device) {
  const std::string last = ctx.last_operation(device);
  return Error(
      ErrorSite{error.library(), error.code(), {}, error.statement(), error.file(), error.line(), error.device()},
      error.message() + ". " + device.to_string() +
          " faulted: a kernel or copy failed after it was queued, and this call only found it. The last "
          "operation dispatched to " +
          device.to_string() + " was " + (last.empty() ? std::string("not recorded") : "'" + last + "'") +
          "; rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the failing kernel, and compute-sanitizer to find "
          "a bad access");
}

// Rank 0's `text` on every rank of `world` (e.g. which checkpoint to resume:
// rank 0 decides, so all ranks load the same one).
std::string broadcast_text(parallel::Communicator& world, Context& ctx, Device device, const std::string& text) {
  if (world.size() == 1) return text;
  Tensor length = ctx.from_vector(Shape{1}, std::vector<int64_t>{int64_t(text.size())}, device);
  world.broadcast(length, 0)->wait();
  const int64_t size = length.to_vector<int64_t>()[0];
  if (size == 0) return {};
  Tensor bytes = world.rank() == 0
                     ? ctx.from_vector(Shape{size}, std::vector<uint8_t>(text.begin(), text.end()), device)
                     : ctx.empty(Shape{size}, DType::u8, device);
  world.broadcast(bytes, 0)->wait();
  const std::vector<uint8_t> out = bytes.to_vector<uint8_t>();
  return std::string(out.begin(), out.end());
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::nth_element(values.begin(), values.begin() + long(values.size() / 2), values.end());
  return values[values.size() / 2];
}

// The communicator of the whole job: MPI_COMM_WORLD through --comm-backend
// (every wait with the --comm-timeout deadline) when `env` is given, the
// caller's `given` otherwise; and how it moves tensors, in words.
struct World {
  std::unique_ptr<parallel::Communicator> owned;
  parallel::Communicator* world = nullptr;
  std::string backend;
};
World open_world(const TrainConfig& c, const parallel::MpiEnv* env, parallel::Communicator* given, Context& ctx,
                 Device device) {
  World out;
  if (!env) {
    out.world = given;
    out.backend = "given by the caller ('" + given->name() + "')";
    return out;
  }
  const parallel::CommBackend choice = parallel::parse_comm_backend(c.comm_backend);
  out.owned = parallel::make_communicator(MPI_COMM_WORLD, "world", ctx, device, choice);
  out.owned->set_timeout(c.comm_timeout);
  out.world = out.owned.get();
  out.backend = std::string(parallel::comm_backend_name(choice));
  if (choice == parallel::CommBackend::automatic)
    out.backend += device.is_cuda() && parallel::nccl_compiled() ? " (NCCL for device tensors, MPI for host tensors)"
                   : device.is_cuda()                            ? " (MPI, device tensors staged through host memory)"
                   : device.is_emulated() ? " (the emulated device channel for device tensors, MPI for host tensors)"
                                          : " (MPI)";
  return out;
}

nn::OptimizerConfig optimizer_config(const TrainConfig& c) {
  nn::OptimizerConfig opt;
  opt.kind = nn::parse_optimizer_kind(c.optimizer);
  opt.lr = c.lr;
  opt.weight_decay = c.weight_decay;
  opt.beta1 = c.adam_beta1;
  opt.beta2 = c.adam_beta2;
  opt.eps = c.adam_eps;
  if (opt.kind == nn::OptimizerKind::sgd) {
    opt.momentum = c.sgd_momentum;
    opt.nesterov = c.nesterov;
  }
  return opt;
}

// The schedule's model chunks per pipeline stage (--virtual-pipeline-stages;
// two under zbv) and how they sit on the stages (a V under zbv).
int pipeline_chunks(const TrainConfig& c) {
  return c.pipeline_schedule == "zbv" && c.pipeline_parallel > 1 ? 2 : c.virtual_pipeline_stages;
}
parallel::ChunkPlacement pipeline_placement(const TrainConfig& c) {
  return c.pipeline_parallel > 1 ? parallel::chunk_placement(parallel::parse_pipeline_schedule(c.pipeline_schedule))
                                 : parallel::ChunkPlacement::loop;
}

// Micro-batches per step on each rank: --global-batch-size over
// --micro-batch-size x the data-parallel ranks (1 without a global batch);
// interleaved, a multiple of the `stages` of the pipeline.
int64_t micro_batches_per_step(const TrainConfig& c, int data_parallel, int stages) {
  const int64_t per_step = c.micro_batch_size * data_parallel;  // samples of one micro-batch over all ranks
  TESSERA_CHECK(c.global_batch_size % per_step == 0, "--global-batch-size ", c.global_batch_size,
                " is not a multiple of --micro-batch-size ", c.micro_batch_size, " x ", data_parallel,
                " data-parallel ranks = ", per_step, "; use a multiple of ", per_step,
                " (or change --micro-batch-size or the number of ranks)");
  const int64_t accumulation = c.global_batch_size > 0 ? c.global_batch_size / per_step : 1;
  const bool interleaved = c.virtual_pipeline_stages > 1 && c.pipeline_schedule == "1f1b";
  TESSERA_CHECK(!interleaved || accumulation % stages == 0, "--virtual-pipeline-stages ",
                c.virtual_pipeline_stages, ": a step's ", accumulation, " micro-batches (--global-batch-size ",
                c.global_batch_size, " / (--micro-batch-size ", c.micro_batch_size, " x ", data_parallel,
                " data-parallel ranks)) must be a multiple of --pipeline-parallel ", stages,
                "; use --global-batch-size ", c.micro_batch_size * data_parallel * stages, " or a multiple of it");
  return accumulation;
}

// The replica's options: --zero, its units and --zero-prefetch, --bucket-size-mb, the norm's groups and
// rule (a tied copy counts nowhere, a replicated parameter on tp rank 0), the
// tied table reduced after its two copies are summed, events into the trace.
parallel::DataParallelOptions data_parallel_options(const TrainConfig& c, parallel::Layout& layout,
                                                    parallel::Communicator* model_group,
                                                    const nn::Parameter* tied_table, nn::Module& model,
                                                    io::TraceWriter& trace) {
  parallel::DataParallelOptions options;
  options.zero_stage = c.zero;
  options.bucket_size_mb = c.bucket_size_mb;
  if (c.zero >= 2) options.units = nn::sharding_units(model);  // blocks, embeddings, ln_f; the MLP's/CNN's layers
  options.prefetch = int(c.zero_prefetch);
  options.model_parallel = model_group ? model_group : &layout.group("tp");
  const int tp_rank = layout.rank("tp");
  options.counts_in_norm = [tp_rank](const nn::Parameter& p) {
    return !p.tied_copy && (p.shard.split || tp_rank == 0);
  };
  // The tied table's gradient is whole only after the two end stages sum it
  // (under a V, after both of stage 0's chunks used it); the other buckets
  // are reduced while backward runs.
  options.reduced_after_backward = [tied_table](const nn::Parameter& p) { return &p == tied_table; };
  if (trace.enabled()) {
    options.clock = [&trace] { return trace.now_ns(); };
    options.on_event = [&trace](const parallel::CommEvent& event) {
      trace.complete(event.name + (event.unit ? " unit " : " bucket ") + std::to_string(event.bucket), event.category,
                     event.start_ns, event.end_ns);
    };
  }
  return options;
}

// Ring attention's blocks, exchanges and waits (--context-parallel-size >
// 1) and the experts' exchanges (--expert-model-parallel-size > 1) into the
// trace: recorded through the cp and ep groups' events.
void trace_group_work(parallel::Layout& layout, io::TraceWriter& trace) {
  if (!trace.enabled()) return;
  for (const char* axis : {"cp", "ep"})
    if (layout.size(axis) > 1)
      layout.group(axis).set_events(parallel::GroupEvents{
          [&trace] { return trace.now_ns(); },
          [&trace](const std::string& name, const std::string& category, int64_t start, int64_t end) {
            trace.complete(name, category, start, end);
          }});
}

// The pipeline schedule (one stage: 1F1B, i.e. F0 B0 F1 B1 ...) and its events into the trace.
parallel::PipelineOptions pipeline_options(const TrainConfig& c, int stages, io::TraceWriter& trace) {
  parallel::PipelineOptions options;
  options.schedule =
      stages > 1 ? parallel::parse_pipeline_schedule(c.pipeline_schedule) : parallel::PipelineScheduleKind::one_f_one_b;
  if (trace.enabled()) {
    options.clock = [&trace] { return trace.now_ns(); };
    options.on_event = [&trace](const std::string& name, const std::string& category, int64_t start, int64_t end) {
      trace.complete(name, category, start, end);
    };
  }
  return options;
}

// The checkpoint to resume from, if any (--resume PATH, or --resume auto:
// the newest complete one). Rank 0 picks it, so every rank loads the same even
// if a directory listing differs; every rank then reads its own slices.
std::optional<Resumed> resume_if_asked(const TrainConfig& c, TrainState& state, parallel::Communicator& world,
                                       Context& ctx, Device device) {
  std::string path;
  if (world.rank() == 0)
    if (const std::optional<std::string> found = checkpoint_to_resume(c)) path = *found;
  path = broadcast_text(world, ctx, device, path);
  if (path.empty()) return std::nullopt;
  std::error_code unseen;
  TESSERA_CHECK(std::filesystem::exists(path, unseen), "rank ", world.rank(), " cannot see ", path,
                ", the checkpoint rank 0 chose to resume from: every rank reads its own slices, so --save must "
                "be on a filesystem all ranks share (or the checkpoint copied to the same path on every node)");
  return load_training_checkpoint(state, path);
}

// Rank 0's progress line: live on a terminal, plain lines under a launcher
// (Open MPI forwards a rank's stdout through a pseudo-terminal even when the
// job's output goes to a file); TESSERA_PROGRESS=live or =lines forces either.
io::ProgressOptions progress_options(const TrainConfig& c, bool root) {
  io::ProgressOptions options;
  options.enabled = root;
  options.interval = c.log_interval;
  if (const char* mode = std::getenv("TESSERA_PROGRESS"); mode && std::string_view(mode) == "live")
    options.terminal = true;
  else if ((mode && std::string_view(mode) == "lines") || launcher_rank() >= 0)
    options.terminal = false;
  return options;
}

// "pipeline: 2 stages, 1f1b, blocks [0, 2), [2, 4)" (interleaved: "2 stages
// x 2 chunks, interleaved 1f1b, blocks ..., chunk c on stage c mod 2");
// empty without pipelining.
std::string describe_stages(const TrainConfig& c, const models::StageModel& stage_model, nn::ModelKind kind) {
  if (stage_model.bounds.empty()) return {};
  std::ostringstream text;
  const int v = pipeline_chunks(c);
  const bool v_shape = pipeline_placement(c) == parallel::ChunkPlacement::v_shape;
  text << "pipeline: " << c.pipeline_parallel << " stages";
  text << (v > 1 ? " x " + std::to_string(v) + (v_shape ? " chunks in a V, " : " chunks, interleaved ") : ", ")
       << c.pipeline_schedule << ", "
       << nn::model_traits(kind).layer_word;
  for (size_t s = 0; s + 1 < stage_model.bounds.size(); ++s)
    text << (s ? ", " : " ") << "[" << stage_model.bounds[s] << ", " << stage_model.bounds[s + 1] << ")";
  if (v_shape)
    text << ", chunks c and " << 2 * c.pipeline_parallel - 1 << " - c on stage c";
  else if (v > 1)
    text << ", chunk c on stage c mod " << c.pipeline_parallel;
  return text.str();
}

// Rank 0's start-up lines about the checkpoint resumed from (where, resharded
// from which layout, which settings changed), or that --resume auto found none.
std::string describe_resume(const TrainConfig& c, const std::optional<Resumed>& resumed, const Counters& counters,
                            int64_t total_steps, const TrainState& state) {
  std::ostringstream out;
  if (!resumed) {
    if (c.resume == "auto") out << "no checkpoint in " << c.save << " yet: starting from step 0\n";
    return out.str();
  }
  out << "resumed from " << resumed->path << ": step " << counters.step << " of " << total_steps;
  if (!c.synthetic) out << ", data at sample " << counters.sampler.samples << " of epoch " << counters.sampler.epoch;
  if (counters.skipped_steps > 0)
    out << ", " << counters.skipped_steps << " step(s) skipped so far: the learning-rate schedule at update "
        << counters.updates;
  out << "\n";
  if (resumed->resharded)
    out << "resharding: the checkpoint was saved under " << resumed->saved_layout << ", this run is dp=" << state.dp
        << " tp=" << state.tp << " pp=" << state.pp << (state.cp > 1 ? " cp=" + std::to_string(state.cp) : std::string())
        << (state.ep > 1 ? " ep=" + std::to_string(state.ep) : std::string())
        << (state.virtual_stages > 1 ? " x " + std::to_string(state.virtual_stages) + " chunks" : std::string())
        << " zero=" << c.zero << " on " << state.world->size() << " rank(s); each rank read its own slices\n";
  if (!resumed->changed_settings.empty()) {
    out << "settings changed since the checkpoint: ";
    for (size_t i = 0; i < resumed->changed_settings.size(); ++i)
      out << (i ? ", " : "") << resumed->changed_settings[i];
    out << "\n";
  }
  return out.str();
}

// The micro-batches of one step from `source` (their data waits traced), the
// sampler's position after them in `counters`, the epoch of the last one.
parallel::StepBatches next_batches(BatchSource& source, int64_t micro_batches,
                                   const std::function<Shape(const Tensor&)>& stage_input_shape, io::TraceWriter& trace,
                                   Counters& counters, int64_t& epoch) {
  parallel::StepBatches batches;
  for (int64_t micro = 0; micro < micro_batches; ++micro) {
    auto scope = trace.scope("data_wait", "data");
    io::Batch batch = source.next();
    epoch = batch.epoch;
    counters.sampler = source.after(batch);
    if (micro == 0) batches.stage_input_shape = stage_input_shape(batch.inputs);
    batches.inputs.push_back(std::move(batch.inputs));
    batches.targets.push_back(std::move(batch.targets));
  }
  return batches;
}

// Why the run stopped before its last step (`stop`: what asked, in words),
// and how to go on.
std::string describe_stop(const TrainConfig& c, const io::StopRequest& stop, const TrainResult& result) {
  std::ostringstream why;
  why << stop.why;
  if (!c.save.empty())
    why << "; checkpoint " << result.checkpoint << " written; go on with --resume auto (or --resume "
        << result.checkpoint << ")";
  else if (stop.signal != 0)
    why << "; no --save directory, so nothing was saved; exiting with status " << result.exit_code();
  else
    why << "; no --save directory, so nothing was saved";
  return why.str();
}

// --train-steps, or --epochs over `batches_per_epoch` micro-batches (at least one step).
int64_t total_steps_of(const TrainConfig& c, int64_t batches_per_epoch, int64_t micro_batches_per_step) {
  if (c.epochs <= 0) return c.train_steps;
  const double micro_batches = c.epochs * double(batches_per_epoch);
  return std::max<int64_t>(1, int64_t(micro_batches / double(micro_batches_per_step)));
}

nn::LrScheduleConfig lr_schedule_config(const TrainConfig& c, int64_t total_steps) {
  nn::LrScheduleConfig schedule;
  schedule.style = nn::parse_lr_style(c.lr_decay_style);
  schedule.lr = c.lr;
  schedule.min_lr = c.min_lr;
  schedule.warmup_steps = c.warmup_steps;
  schedule.total_steps = total_steps;
  return schedule;
}

// The prediction for the parameters of `model` whose gradients are averaged
// over `axes` (their ZeRO shards split over that group of `data_parallel` ranks).
parallel::MemoryPlan predict_group(const TrainConfig& c, nn::Module& model, const std::vector<std::string>& axes,
                                   int data_parallel, int64_t micro_batches, DType dtype) {
  parallel::MemoryPlanInput input;
  for (nn::Module* unit : nn::sharding_units(model)) {
    // This rank's elements (its tensor-parallel shards), and whether it is the
    // GPT's table (or its tied copy): used by the head at the start of
    // backward and by the embedding at its end, its gradient lives throughout.
    int64_t elements = 0;
    bool held = false;
    for (const nn::Parameter* p : unit->parameters()) {
      if (p->gradient_axes != axes) continue;
      elements += p->value.numel();
      held |= p->name == "wte.weight";
    }
    if (elements == 0) continue;
    input.unit_elements.push_back(elements);
    input.unit_held.push_back(held);
  }
  input.value_bytes = int64_t(dtype_size(dtype));
  input.optimizer_bytes = parallel::optimizer_bytes_per_element(optimizer_config(c), dtype);
  input.data_parallel = data_parallel;
  input.zero_stage = c.zero;
  input.prefetch = int(c.zero_prefetch);
  input.accumulates = micro_batches > 1;
  return parallel::predict_memory(input);
}

// --estimate-memory: this rank's predicted model-state bytes
// (parallel/memory_plan.h) from its sharding units, per gradient group (a
// mixture of experts' experts shard over dp x cp, the rest over the ep ranks
// too), gathered to every rank; rank 0 prints one line per rank and the
// formula with its own numbers.
std::vector<std::array<int64_t, 3>> estimate_memory(const TrainConfig& c, nn::Module& model, parallel::Layout& layout,
                                                    int64_t micro_batches, DType dtype, Context& ctx) {
  parallel::Communicator& world = layout.world();
  std::vector<std::vector<std::string>> groups;
  for (const nn::Parameter* p : model.parameters())
    if (std::find(groups.begin(), groups.end(), p->gradient_axes) == groups.end()) groups.push_back(p->gradient_axes);
  parallel::MemoryPlan plan;
  int64_t elements = 0;
  for (const std::vector<std::string>& axes : groups) {
    int replicas = 1;  // the ranks the group's ZeRO shards split over (no communicator made: stages differ)
    for (const std::string& axis : axes) replicas *= layout.size(axis);
    const parallel::MemoryPlan part = predict_group(c, model, axes, replicas, micro_batches, dtype);
    plan.parameters += part.parameters;
    plan.gradients += part.gradients;
    plan.optimizer += part.optimizer;
    plan.formula += (plan.formula.empty() ? "" : "; ") + part.formula;
    elements += std::stoll(part.formula.substr(2));  // "P=<elements> ..."
  }
  if (groups.size() > 1)  // the whole first, then each group's
    plan.formula = "P=" + std::to_string(elements) + " = " + std::to_string(plan.model_state()) + " bytes: " +
                   plan.formula;
  Tensor mine = ctx.from_vector(Shape{3}, std::vector<int64_t>{plan.parameters, plan.gradients, plan.optimizer},
                                Device::cpu());
  Tensor all = ctx.empty(Shape{3 * int64_t(world.size())}, DType::i64, Device::cpu());
  world.all_gather(mine, all)->wait();
  const std::vector<int64_t> values = all.to_vector<int64_t>();
  std::vector<std::array<int64_t, 3>> out;
  for (int r = 0; r < world.size(); ++r) out.push_back({values[size_t(3 * r)], values[size_t(3 * r + 1)],
                                                        values[size_t(3 * r + 2)]});
  if (world.rank() == 0) {
    std::printf("predicted memory per rank (--zero %d, --zero-prefetch %lld; parameters + gradients + optimizer "
                "state, before activations):\n",
                c.zero, static_cast<long long>(c.zero_prefetch));
    for (int r = 0; r < world.size(); ++r) {
      const auto& [parameters, gradients, optimizer] = out[size_t(r)];
      std::printf("  rank %d: %s = parameters %s + gradients %s + optimizer %s\n", r,
                  parallel::byte_text(parameters + gradients + optimizer).c_str(),
                  parallel::byte_text(parameters).c_str(), parallel::byte_text(gradients).c_str(),
                  parallel::byte_text(optimizer).c_str());
    }
    std::printf("rank 0: %s\n", plan.formula.c_str());
    std::fflush(stdout);
  }
  return out;
}

// --estimate-memory on its own: the figures from the model's shapes alone
// (placeholders: nothing is allocated or initialised), so a model of any
// size is estimated at once, on any machine.
TrainResult estimate_only(const TrainConfig& c, const nn::ModelConfig& model_cfg, const nn::ModelSpec& spec,
                          parallel::Layout& layout, int64_t micro_batches, Context& ctx) {
  nn::ModelSpec shapes = spec;
  shapes.shapes_only = true;
  const models::StageModel stage_model = models::build_stage_model(
      model_cfg, shapes, layout, c.sequence_parallel, c.pipeline_split, pipeline_chunks(c), pipeline_placement(c));
  TrainResult estimate;
  estimate.data_parallel_size = parallel::data_group(layout).size();
  estimate.memory_estimate = estimate_memory(c, *stage_model.module, layout, micro_batches, spec.dtype, ctx);
  return estimate;
}

// --zero 1/2/3 shards over the data-parallel ranks: with one it only adds
// memory (the flat buffers and, at 2/3, the units' gathers), so it is refused.
void check_zero_has_ranks(const TrainConfig& c, const parallel::Layout& layout) {
  if (c.zero == 0 || layout.size("dp") * layout.size("ep") > 1) return;
  const int64_t model_ranks = int64_t(layout.size("tp")) * layout.size("pp");
  TESSERA_THROW("--zero ", c.zero, " shards ", c.zero == 1 ? "the optimizer state" : c.zero == 2
                    ? "the optimizer state and gradients" : "the parameters, gradients and optimizer state",
                " over the data-parallel ranks, and this layout has one (", model_ranks, " rank(s) = --tensor-parallel ",
                layout.size("tp"), " x --pipeline-parallel ", layout.size("pp"),
                "): it would only add memory; drop --zero, or start a multiple of ", model_ranks,
                " ranks (e.g. mpirun -np ", 2 * model_ranks, " for 2 data-parallel ranks)");
}

// The MPI and NCCL libraries, and what the topology says this node's rank 0
// should use (and whether the launch applied it: tessera-rank).
std::string describe_libraries_and_topology(const parallel::MpiEnv& env) {
  std::string out = "mpi: " + mpi_library_version() + "; nccl: " + nccl_library_version() + "\n";
  try {
    return out + parallel::describe_topology_decision(env.local_rank(), env.local_size());
  } catch (const Error& error) {
    return out + "topology: not read (" + error.what() + ")\n";
  }
}

// What checkpoints save and restore, and the layout they are written under.
TrainState train_state(const TrainConfig& c, const nn::ModelConfig& model, DType dtype,
                       const std::vector<nn::Parameter*>& parameters, parallel::DataParallel& replica,
                       nn::GradScaler& scaler, parallel::Communicator& world, parallel::Layout& layout) {
  TrainState state;
  state.config = &c;
  state.model = &model;
  state.dtype = dtype;
  state.replica = &replica;
  state.parameters = parameters;
  state.scaler = &scaler;
  state.world = &world;
  parallel::Communicator& data = parallel::data_group(layout);
  state.dp = data.size();
  state.ep = layout.size("ep");
  state.ep_rank = layout.rank("ep");
  state.dp_axis_rank = layout.rank("dp");
  state.tp = layout.size("tp");
  state.pp = layout.size("pp");
  state.cp = layout.size("cp");
  state.cp_rank = layout.rank("cp");
  state.virtual_stages = pipeline_chunks(c);
  state.dp_rank = data.rank();
  state.tp_rank = layout.rank("tp");
  state.pp_rank = layout.rank("pp");
  state.global_micro_batch = c.micro_batch_size * data.size();
  return state;
}

// The training data's and the evaluation data's descriptions (--synthetic:
// no training data), checked to be of one kind.
std::pair<std::optional<io::DatasetInfo>, std::optional<io::DatasetInfo>> inspect_data(const TrainConfig& c) {
  std::optional<io::DatasetInfo> data_info, eval_info;
  if (!c.synthetic) data_info = io::inspect_dataset(c.data);
  if (!c.eval_data.empty()) {
    eval_info = io::inspect_dataset(c.eval_data);
    TESSERA_CHECK(!data_info || eval_info->kind == data_info->kind, "--eval-data ", c.eval_data,
                  " holds another kind of data than --data ", c.data);
  }
  return {data_info, eval_info};
}

// Rank 0 writes checkpoints: the --save directory must take them, and be
// this job's alone for the run (`lock` holds it).
void lock_save_directory(const TrainConfig& c, std::optional<io::SaveDirectoryLock>& lock) {
  if (c.save.empty()) return;
  io::check_save_directory(c.save);
  lock.emplace(c.save);
}

// Under context parallelism the positions of each sequence this rank holds
// (its zigzag share, parallel/ring_attention.h); empty without.
std::vector<int64_t> context_token_positions(parallel::Layout& layout, int64_t seq_length) {
  if (layout.size("cp") == 1) return {};
  return parallel::context_share(layout.group("cp"), seq_length / layout.size("cp"));
}

parallel::LayoutSizes layout_sizes(const TrainConfig& c) {
  parallel::LayoutSizes sizes;
  sizes.tp = c.tensor_parallel;
  sizes.pp = c.pipeline_parallel;
  sizes.cp = c.context_parallel;
  sizes.ep = c.expert_parallel;
  sizes.order = c.rank_order;
  return sizes;
}

// Rank 0's lines for people, above its progress line (other ranks print none).
std::function<void(const std::string&)> lines_above(io::ProgressLine& progress, bool root) {
  return [&progress, root](const std::string& line) {
    if (root) progress.print_above(line);
  };
}

// The result before the first step: where the run starts, and what it trains with.
TrainResult starting_result(int data_parallel, parallel::DataParallel& replica, const Counters& counters,
                            const std::optional<Resumed>& resumed) {
  TrainResult result;
  result.data_parallel_size = data_parallel;
  result.optimizer_state_bytes = replica.optimizer_state_bytes();
  result.start_step = result.final_step = counters.step;
  if (resumed) result.resumed_from = resumed->path;
  return result;
}

// --init-from: the weights of a safetensors file, before the optimizer
// copies them (masters) and ZeRO-3 shards them; a resumed checkpoint
// replaces them.
void load_initial_weights(const TrainConfig& c, const std::vector<nn::Parameter*>& parameters,
                          const nn::ModelConfig& model, bool root) {
  const io::WeightsLoaded loaded =
      init_from_hf_llama(c) ? io::load_hf_llama_weights(c.init_from, parameters, io::read_hf_llama_config(c.init_from))
                            : io::load_safetensors_weights(c.init_from, parameters, model.num_layers);
  if (root)
    std::printf("init-from: %s: %lld tensors under %s names%s\n", c.init_from.c_str(),
                static_cast<long long>(loaded.tensors), loaded.naming.c_str(),
                loaded.ignored ? (", " + std::to_string(loaded.ignored) + " of the file's not used").c_str() : "");
}

// --trace: this rank's file of the run's events (one per rank).
io::TraceOptions trace_options(const TrainConfig& c, const parallel::Communicator& world) {
  io::TraceOptions options;
  options.path = c.trace;
  options.rank = world.rank();
  options.world_size = world.size();
  return options;
}

// What one training step is made of (parallel/train_step.h): this rank's
// stage of the model and its loss, the replica, the loss scaler, the groups
// it talks to, and the pipeline's schedule.
parallel::TrainStepParts train_step_parts(const TrainConfig& c, Context& ctx, Device device,
                                          const models::StageModel& stage_model, parallel::DataParallel& replica,
                                          nn::GradScaler& scaler, parallel::Layout& layout,
                                          const parallel::PipelineGroups& groups, io::TraceWriter& trace) {
  parallel::TrainStepParts parts;
  parts.context = &ctx;
  parts.device = device;
  parts.model = stage_model.module.get();
  parts.chunks = stage_model.chunks;
  parts.loss = stage_model.loss.get();
  parts.replica = &replica;
  parts.scaler = &scaler;
  parts.pipeline = &layout.group("pp");
  parts.data_parallel = &parallel::replicas_along(layout, {"dp", "ep", "cp"});  // the loss's average
  parts.samples = &parallel::data_group(layout);
  parts.embedding_group = groups.embedding.get();
  parts.tied_table = stage_model.tied_table;
  parts.seed = c.seed;
  parts.clip_grad = c.clip_grad;
  parts.pipeline_options = pipeline_options(c, layout.size("pp"), trace);
  return parts;
}

// What the run is, for MLflow's tags (apps/train_tracking.h).
RunFacts run_facts(const TrainConfig& c, parallel::Layout& layout, Device device, const parallel::MpiEnv* env,
                   const std::optional<Resumed>& resumed) {
  RunFacts facts;
  facts.layout = "dp=" + std::to_string(layout.size("dp")) + " tp=" + std::to_string(layout.size("tp")) +
                 " pp=" + std::to_string(layout.size("pp"));
  facts.device = device.to_string();
  facts.precision = c.precision;
  facts.world_size = layout.world().size();
  facts.mpi_library = env ? mpi_library_version() : "";
  if (!resumed) return facts;
  facts.resumed_step = resumed->counters.step;
  facts.resumed_run_id = resumed->mlflow_run_id;
  facts.resumed_uri = resumed->mlflow_uri;
  return facts;
}

// A language model (its throughput in tokens; bits per byte of evaluation text).
bool tokens_of(const nn::ModelConfig& model) {
  return nn::model_traits(model.kind).reads_tokens;
}

// The steps of the run, from where it starts (a resumed checkpoint's step)
// to total_steps: each one's batches through TrainStep::run, its count of
// non-finite steps, and its events for the components (io/training_events.h):
// its begin, its end with its record, and the boundary after it.
class StepLoop {
 public:
  // `micro_batches`: per step on each rank; `tokens`: a language model
  // (throughput in tokens per second); `pipelined`: more than one pipeline
  // stage (the record's pipeline_idle).
  StepLoop(const TrainConfig& config, int world_rank, Device device, DType dtype, BatchSource& source,
           parallel::TrainStep& train_step, const nn::LrSchedule& schedule, const nn::GradScaler& scaler,
           parallel::DataParallel& replica, io::TraceWriter& trace,
           const std::function<Shape(const Tensor&)>& stage_input_shape, int64_t micro_batches, int64_t total_steps,
           int data_parallel, bool tokens, bool pipelined)
      : config_(config),
        world_rank_(world_rank),
        device_(device),
        dtype_(dtype),
        source_(source),
        train_step_(train_step),
        schedule_(schedule),
        scaler_(scaler),
        replica_(replica),
        trace_(trace),
        stage_input_shape_(stage_input_shape),
        micro_batches_(micro_batches),
        total_steps_(total_steps),
        data_parallel_(data_parallel),
        tokens_(tokens),
        pipelined_(pipelined) {}

  // Returns why the run stopped before total_steps ("": it did not).
  std::string run(io::TrainingEvents& events, Counters& counters, TrainResult& result);

 private:
  void count_skipped(int64_t step, io::TrainingEvents& events, Counters& counters, TrainResult& result);
  io::StepRecord record_of(int64_t step, const parallel::StepResult& outcome, double lr, int64_t epoch,
                           double seconds) const;

  const TrainConfig& config_;
  int world_rank_;
  Device device_;
  DType dtype_;
  BatchSource& source_;
  parallel::TrainStep& train_step_;
  const nn::LrSchedule& schedule_;
  const nn::GradScaler& scaler_;
  parallel::DataParallel& replica_;
  io::TraceWriter& trace_;
  const std::function<Shape(const Tensor&)>& stage_input_shape_;
  int64_t micro_batches_, total_steps_;
  int data_parallel_;
  bool tokens_, pipelined_;
};

std::string StepLoop::run(io::TrainingEvents& events, Counters& counters, TrainResult& result) {
  std::vector<double> step_ms;
  std::string stop_reason;
  for (int64_t step = counters.step; step < total_steps_; ++step) {
    const auto start = Clock::now();  // injected faults count: a slow rank's sleep is its own time
    inject_step_faults(step + 1, world_rank_, source_, device_);
    events.step_begin({step + 1});
    const int64_t trace_start = trace_.enabled() ? trace_.now_ns() : 0;
    int64_t epoch = 0;
    const auto data_start = Clock::now();
    parallel::StepBatches batches = next_batches(source_, micro_batches_, stage_input_shape_, trace_, counters, epoch);
    const double data_wait = std::chrono::duration<double>(Clock::now() - data_start).count();
    batches.activation_dtype = dtype_;
    const double lr = schedule_.lr(counters.updates);  // Megatron: skipped steps do not advance the schedule
    // TESSERA_FAULT=nan_grad: this rank's gradients of the step are NaN (through the loss's gradient).
    const parallel::StepResult outcome =
        train_step_.run(step, batches, lr, fault_due("nan_grad", step + 1, world_rank_));
    const parallel::ReductionStats& sync = outcome.reduction;
    if (trace_.enabled()) trace_.counter("buckets_launched_in_backward", double(sync.launched_in_backward));
    if (outcome.skipped) {
      count_skipped(step, events, counters, result);
    } else {
      ++counters.updates;
      counters.consecutive_skips = 0;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    step_ms.push_back(seconds * 1e3);
    if (trace_.enabled()) trace_.complete("step " + std::to_string(step + 1), "step", trace_start, trace_.now_ns());

    io::StepRecord record = record_of(step, outcome, lr, epoch, seconds);
    result.last_loss = record.loss;
    result.losses.push_back(record.loss);
    result.steps = step + 1 - result.start_step;
    result.final_step = counters.step = step + 1;
    const bool last = step + 1 == total_steps_;
    const double sync_seconds = double(sync.reduction_end_ns - sync.backward_end_ns) * 1e-9;
    io::StepEnd end{step + 1, last, record, seconds, data_wait, sync_seconds};
    events.step_end(end);
    if (const std::optional<io::StopRequest> stop = events.step_boundary(step + 1, last)) {
      result.stop_signal = stop->signal;
      stop_reason = describe_stop(config_, *stop, result);
      break;
    }
  }
  result.median_ms_per_step = median(step_ms);
  return stop_reason;
}

// A skipped step (non-finite gradients). Without fp16's loss scaler (which
// backs off and goes on), --max-skipped-steps in a row stop the run: every
// rank together (the skip is agreed), a background save published first.
void StepLoop::count_skipped(int64_t step, io::TrainingEvents& events, Counters& counters, TrainResult& result) {
  ++counters.skipped_steps;
  ++result.skipped_steps;
  if (scaler_.enabled()) return;
  int64_t& consecutive_skips = counters.consecutive_skips;
  const TrainConfig& c = config_;
  if (consecutive_skips + 1 >= c.max_skipped_steps) events.stop({step + 1, {"non-finite gradients"}, true});
  TESSERA_CHECK(++consecutive_skips < c.max_skipped_steps, "step ", step + 1, ": non-finite gradients in ",
                consecutive_skips,
                " consecutive steps (first non-finite gradient: ", non_finite_gradient_text(replica_),
                "); lower --lr, enable --clip-grad, or check the data; the run stops here");
}

// The metrics record of step `step` (0-based) from what TrainStep returned:
// loss, learning rate, norm, time and throughput, the reduction's tail after
// backward and, under pipelining, this stage's idle share of the step (the
// bubble); the components add their figures.
io::StepRecord StepLoop::record_of(int64_t step, const parallel::StepResult& outcome, double lr, int64_t epoch,
                                   double seconds) const {
  io::StepRecord record;
  record.step = step + 1;
  record.total_steps = total_steps_;
  record.loss = outcome.loss;
  record.lr = lr;
  record.grad_norm = outcome.grad_norm;
  record.skipped = outcome.skipped;
  record.epoch = epoch;
  const parallel::ReductionStats& sync = outcome.reduction;
  record.extra.emplace_back("grad_sync_ms", double(sync.reduction_end_ns - sync.backward_end_ns) * 1e-6);
  if (pipelined_) {
    const double span = double(outcome.pipeline.end_ns - outcome.pipeline.start_ns);
    record.extra.emplace_back("pipeline_idle", span > 0 ? double(outcome.pipeline.idle_ns()) / span : 0.0);
  }
  record.ms_per_step = seconds * 1e3;
  const int64_t samples_per_step = micro_batches_ * config_.micro_batch_size * data_parallel_;
  if (tokens_)
    record.tokens_per_s = double(samples_per_step * config_.seq_length) / seconds;
  else
    record.samples_per_s = double(samples_per_step) / seconds;
  if (scaler_.enabled()) record.loss_scale = outcome.loss_scale;
  return record;
}

// The run on `device` of `ctx` (see run()): set-up; the run's features as
// components of the loop (io/training_events.h); the steps (StepLoop).
TrainResult run_on(const TrainConfig& c, const parallel::MpiEnv* env, parallel::Communicator* given, Context& ctx,
                   Device device, const PreemptionSignals& signals) {
  const DType dtype = compute_dtype(c.precision);
  World opened = open_world(c, env, given, ctx, device);
  parallel::Communicator* world = opened.world;

  const auto [data_info, eval_info] = inspect_data(c);
  check_ranks_agree(*world, c, data_info, eval_info);
  std::optional<io::SaveDirectoryLock> save_lock;
  if (world->rank() == 0) lock_save_directory(c, save_lock);

  parallel::Layout layout(*world, layout_sizes(c));
  parallel::Communicator& dp = parallel::data_group(layout);  // the ranks reading different samples
  const bool root = world->rank() == 0;
  check_zero_has_ranks(c, layout);
  const std::string placement =
      env ? env->describe_layout()  // collective over MPI_COMM_WORLD
          : std::to_string(world->size()) + " rank(s) of the communicator '" + world->name() + "'";

  const nn::ModelConfig model_cfg = model_config(c, data_info);
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.device = device;
  spec.dtype = dtype;
  spec.seed = c.seed;
  const int64_t accumulation = micro_batches_per_step(c, dp.size(), layout.size("pp"));
  if (c.estimate_memory) return estimate_only(c, model_cfg, spec, layout, accumulation, ctx);
  // This rank's part of the model: the layers of its pipeline stage, split
  // over its tensor-parallel group, with its loss (models/stage_model.h).
  models::StageModel stage_model = models::build_stage_model(model_cfg, spec, layout, c.sequence_parallel,
                                                                 c.pipeline_split, pipeline_chunks(c),
                                                                 pipeline_placement(c));
  const std::unique_ptr<nn::Module>& model = stage_model.module;
  std::vector<nn::Parameter*> parameters = model->parameters();
  inject_start_up_fault(world->rank());
  if (!c.init_from.empty()) load_initial_weights(c, parameters, model_cfg, root);
  TrainingSamples samples(c, stage_model.causal_lm);
  const parallel::PipelineGroups groups =
      parallel::pipeline_groups(layout, stage_model.tied_table != nullptr);

  // The trace first: the data-parallel reducer, ring attention and the experts' exchange write into it.
  io::TraceWriter trace(trace_options(c, *world));
  trace_group_work(layout, trace);
  // The replicas a gradient is averaged over, as the parameters say (dp, the
  // cp ranks that share its samples and the ep ranks; an expert's over dp
  // and cp only): one group, or the dense and the experts' groups.
  const parallel::GradientGroups gradient_groups = parallel::gradient_groups(layout, parameters);
  parallel::Communicator& replicas = *gradient_groups.replicas;
  parallel::DataParallel replica(gradient_groups, optimizer_config(c),
                                 data_parallel_options(c, layout, groups.model, stage_model.tied_table, *model, trace));
  nn::GradScaler scaler = nn::GradScaler::for_dtype(dtype);
  // The step: the same driver for every layout (one stage is the degenerate pipeline).
  parallel::TrainStep train_step(train_step_parts(c, ctx, device, stage_model, replica, scaler, layout, groups, trace));
  parallel::PipelineEngine* engine = layout.size("pp") > 1 ? &train_step.engine() : nullptr;

  TrainState state = train_state(c, model_cfg, dtype, parameters, replica, scaler, *world, layout);
  state.save_lock = save_lock ? &*save_lock : nullptr;
  const std::optional<Resumed> resumed = resume_if_asked(c, state, *world, ctx, device);
  Counters counters = resumed ? resumed->counters : Counters{};

  BatchSource source(ctx, c, model_cfg, device, dtype, dp.rank(), dp.size(), counters.sampler,
                     context_token_positions(layout, c.seq_length));
  const int64_t total_steps = total_steps_of(c, source.batches_per_epoch(), accumulation);
  const nn::LrScheduleConfig schedule_cfg = lr_schedule_config(c, std::max<int64_t>(total_steps, 1));
  const nn::LrSchedule schedule(schedule_cfg);
  state.schedule = &schedule_cfg;

  // Rank 0's output: the progress line, and above it every other line of the run (`say`).
  io::ProgressLine progress(progress_options(c, root));
  const std::function<void(const std::string&)> say = lines_above(progress, root);
  // The metrics file is opened before the start-up lines, so a path that cannot be written fails first.
  auto metrics = std::make_unique<MetricsLog>(c, root, resumed.has_value(), device, dp.size(), progress);
  const std::string replica_description = replica.describe();  // collective-free, but every rank computes it
  if (root) {
    std::printf("tessera train: %s\n%s\n", ctx.describe().c_str(), describe(c).c_str());
    std::printf("ranks: %s; %s; communicator %s; data parallel: %s\n", placement.c_str(), layout.describe().c_str(),
                opened.backend.c_str(), replica_description.c_str());
    if (const std::string stages = describe_stages(c, stage_model, model_cfg.kind); !stages.empty())
      std::printf("%s\n", stages.c_str());
    if (const std::string vocabulary = describe_vocabulary(c, model_cfg, data_info); !vocabulary.empty())
      std::printf("%s\n", vocabulary.c_str());
    if (env) std::printf("%s", describe_libraries_and_topology(*env).c_str());
    if (data_info) std::printf("data: %s\n", data_info->describe().c_str());
    std::printf("%s", describe_resume(c, resumed, counters, total_steps, state).c_str());
    std::printf(
        "model: %s, %lld parameters, %s on %s; %lld steps of %lld micro-batch(es) of %lld on each of %d rank(s)\n",
        std::string(nn::model_name(c.model)).c_str(), static_cast<long long>(nn::parameter_count(*model)), std::string(dtype_name(dtype)).c_str(),
        device.to_string().c_str(), static_cast<long long>(total_steps), static_cast<long long>(accumulation),
        static_cast<long long>(c.micro_batch_size), dp.size());
    std::fflush(stdout);
  }

  TrainResult result = starting_result(dp.size(), replica, counters, resumed);
  // The run's features: each a component of the loop, receiving every event
  // in this order (io/training_events.h). Those that add figures to a step's
  // record (memory, checkpoint figures, tp traffic, the monitor's exchange)
  // come before those that log it (metrics, progress, MLflow); the
  // evaluation before the samples (its line first); a signal's stop before
  // --exit-interval's; and the signals take over before the --train-steps 0 save.
  io::TrainingEvents events(*world, ctx, device);
  events.add(std::make_unique<PreemptionStop>(signals, world->rank()));
  events.add(std::make_unique<ExitInterval>(c));
  events.add(std::make_unique<StepMemory>(ctx, device, result));
  events.add(std::make_unique<CheckpointCadence>(state, counters, result, trace, say));
  events.add(std::make_unique<TensorParallelTraffic>(layout));
  if (model_cfg.num_experts > 0)
    events.add(std::make_unique<ExpertLoad>(ctx, *model, layout, model_cfg, c.sequence_parallel, accumulation));
  events.add(std::make_unique<TrainingMonitor>(c, layout, ctx, device, say, env ? env->hostname() : "localhost"));
  events.add(std::move(metrics));
  events.add(std::make_unique<ProgressReport>(c, root, progress, result, trace, world->size()));
  const RunTracking& tracking =
      events.add(std::make_unique<RunTracking>(c, root, run_facts(c, layout, device, env, resumed), result));
  if (root && !c.mlflow_uri.empty()) state.tracking_run_id = [&tracking] { return tracking.run_id(); };
  const EvalModel eval_model{ctx,       *model, *stage_model.loss,   device,
                             dtype,     dp,     replicas,            engine,
                             &layout.group("pp"), stage_model.input_shape, context_token_positions(layout, c.seq_length)};
  events.add(std::make_unique<EvaluationCadence>(c, eval_model, trace, tokens_per_byte(eval_info, tokens_of(model_cfg)),
                                                 source.batches_per_epoch(), accumulation, events, result));
  events.add(std::make_unique<SamplesDuringTraining>(samples, say));

  if (root && counters.step >= total_steps && total_steps > 0)
    std::printf("nothing to do: the checkpoint is at step %lld and --train-steps/--epochs ask for %lld\n",
                static_cast<long long>(counters.step), static_cast<long long>(total_steps));
  events.run_start({counters.step, total_steps});
  if (total_steps == 0 && counters.step == 0) {  // --init-from, --train-steps 0: the weights as they came
    io::Save weights{0, true};
    events.save(weights);
  }
  StepLoop steps(c, world->rank(), device, dtype, source, train_step, schedule, scaler, replica, trace,
                 stage_model.input_shape, accumulation, total_steps, dp.size(), tokens_of(model_cfg),
                 engine != nullptr);
  const std::string stop_reason = steps.run(events, counters, result);
  trace.close();
  events.run_end({result.final_step, stop_reason});
  return result;
}

// The whole run: on MPI_COMM_WORLD through --comm-backend when `env` is
// given, on `given` otherwise (a caller's group, or a group of one without MPI).
TrainResult run(const TrainConfig& c, const parallel::MpiEnv* env, parallel::Communicator* given) {
  validate(c);
  // From here until run() returns, SIGTERM and SIGUSR1 only set a flag that
  // the step loop acts on; the previous handlers come back on return or throw.
  const PreemptionSignals signals;
  ContextOptions context_options;
  context_options.cpu_threads = c.threads;
  Context ctx(context_options);
  const Device device = choose_device(c, env);
  bind_thread_to_device(device);  // this thread's device, before anything touches it
  try {
    return run_on(c, env, given, ctx, device, signals);
  } catch (const Error& error) {
    if (device.is_accelerator() && is_device_fault(error)) throw explain_device_fault(error, ctx, device);
    throw;
  }
}

}  // namespace

namespace {

// --plan: the layout axes not given, chosen by `tessera plan` for --cluster (rank 0 says which).
TrainConfig planned(const TrainConfig& c, int world_size, int rank) {
  if (!c.plan) return c;
  std::string chosen;
  TrainConfig out = with_planned_layout(c, world_size, chosen);
  if (rank == 0) std::printf("plan: %s\n", chosen.c_str());
  return out;
}

}  // namespace

TrainResult train(const TrainConfig& given) {
  int mpi_initialised = 0;
  MPI_Initialized(&mpi_initialised);
  if (!mpi_initialised) {
    const TrainConfig c = planned(given, 1, 0);
    validate(c);
    const std::unique_ptr<parallel::Communicator> local = parallel::make_local_communicator("world (no MPI)");
    return run(c, nullptr, local.get());
  }
  const parallel::MpiEnv env;  // MPI is up already: this only reads the layout (and never finalises)
  const TrainConfig c = planned(given, env.world_size(), env.world_rank());
  validate(c);
  return run(c, &env, nullptr);
}

TrainResult train(const TrainConfig& given, parallel::Communicator& world) {
  const TrainConfig c = planned(given, world.size(), world.rank());
  return run(c, nullptr, &world);
}

nn::ModelConfig model_of(const TrainConfig& c) {
  return model_config(c, std::nullopt);
}
DType dtype_of(const TrainConfig& c) {
  return compute_dtype(c.precision);
}
nn::OptimizerConfig optimizer_of(const TrainConfig& c) {
  return optimizer_config(c);
}

}  // namespace tessera::app
