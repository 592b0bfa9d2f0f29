// The training loop: set-up from TrainConfig (MPI world, process grid,
// data-parallel replica, sharded loader, resuming from a checkpoint), the
// steps (each one parallel::TrainStep::run over the step's micro-batches:
// parallel/train_step.h; here the stop after too many non-finite steps),
// sharded evaluation, checkpoints (on an interval, at the end, and when the
// ranks agree that a preemption signal arrived), and rank 0's
// progress/metrics plus every rank's trace.
#include "apps/trainer.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "apps/preemption.h"
#include "apps/rank_agreement.h"
#include "apps/train_checkpoint.h"
#include "apps/train_monitor.h"
#include "apps/train_tracking.h"
#include "apps/train_samples.h"
#include "core/context.h"
#include "core/device_runtime.h"
#include "core/fault.h"
#include "core/process_end.h"
#include "io/checkpoint.h"
#include "io/dataset.h"
#include "io/loader.h"
#include "io/metrics.h"
#include "io/model_weights.h"
#include "io/progress.h"
#include "io/save_lock.h"
#include "io/trace.h"
#include "kernels/ops.h"
#include "nn/grad_scaler.h"
#include "nn/loss.h"
#include "nn/lr_schedule.h"
#include "nn/models.h"
#include "nn/optimizer.h"
#include "parallel/memory_plan.h"
#include "parallel/data_parallel.h"
#include "parallel/library_versions.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_env.h"
#include "parallel/pipeline.h"
#include "parallel/process_grid.h"
#include "parallel/process_group.h"
#include "models/stage_model.h"
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

// The model's configuration from the flags and, when there is data, from the
// dataset (input shape and classes, or vocabulary).
nn::ModelConfig model_config(const TrainConfig& c, const std::optional<io::DatasetInfo>& data) {
  nn::ModelConfig m;
  m.kind = nn::parse_model_kind(c.model);
  m.hidden = c.hidden;
  m.vocab_size = c.vocab_size > 0 ? c.vocab_size : kSyntheticVocabSize;
  m.seq_length = c.seq_length;
  m.num_layers = c.num_layers;
  m.num_heads = c.num_heads;
  m.hidden_size = c.hidden_size;
  m.ffn_hidden_size = c.ffn_hidden_size;
  m.dropout = c.hidden_dropout;
  m.recompute = c.recompute;
  m.num_query_groups = c.group_query_attention ? c.num_query_groups : 0;
  m.rotary_base = c.rotary_base;
  m.norm_epsilon = c.norm_epsilon;
  if (!data) return m;
  const bool wants_tokens = nn::model_traits(m.kind).reads_tokens;
  const bool has_tokens = data->kind == io::DatasetKind::tokens;
  TESSERA_CHECK(wants_tokens == has_tokens, "--model ", c.model, " needs ",
                wants_tokens ? "a token dataset (tessera prepare text)" : "an image dataset (tessera prepare idx)",
                " but ", data->path, " holds ", has_tokens ? "tokens" : "images");
  if (has_tokens && c.vocab_size == 0) {
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
  BatchSource(Context& ctx, const TrainConfig& c, const nn::ModelConfig& m, Device device, DType dtype, int rank,
              int ranks, const SamplerPosition& start)
      : global_(c.micro_batch_size * ranks) {
    if (!c.synthetic) {
      io::LoaderOptions options;
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
      const auto slice = [&](const std::vector<int32_t>& all) {
        return std::vector<int32_t>(all.begin() + first * t, all.begin() + (first + b) * t);
      };
      synthetic_.inputs = ctx.from_vector(Shape{b, t}, slice(ids), device);
      synthetic_.targets = ctx.from_vector(Shape{b, t}, slice(next), device);
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

// The name of the first parameter whose gradient holds an inf or NaN (for the
// message when the run has to stop).
// The tensor to name when a run stops on non-finite gradients (this rank's view).
std::string non_finite_gradient_text(parallel::DataParallel& replica) {
  const std::string name = replica.first_non_finite_gradient();
  if (!name.empty()) return name;
  return replica.zero_stage() >= 2 ? "(none in this rank's pieces: another rank's, or the norm itself overflowed)"
                                   : "(none: the norm itself overflowed)";
}

// Evaluation sharded over the data-parallel ranks: each evaluates its share
// of every global batch (the loader splits the last partial one evenly, so
// all ranks run the same number of batches), then the loss sums, target
// counts and correct counts are summed over the ranks. --eval-iters counts
// global batches.
// Under pipeline parallelism (`pipeline` non-null) the batches flow through
// the stages and the last one computes the sums, which it then shares with
// the other stages.
struct PipelineEval {
  parallel::PipelineEngine* engine = nullptr;
  parallel::Communicator* stages = nullptr;         // the pipeline axis
  std::function<Shape(const Tensor&)> input_shape;  // what a stage after the first receives for a batch's inputs
};

EvalResult evaluate(Context& ctx, nn::Module& model, const nn::Loss& loss, const TrainConfig& c, Device device,
                    DType dtype, io::TraceWriter& trace, parallel::Communicator& dp, const PipelineEval& pipeline) {
  auto scope = trace.scope("eval", "eval");
  io::LoaderOptions options;
  options.batch_size = c.micro_batch_size;
  options.seed = c.seed;
  options.shuffle = false;
  options.drop_last = false;
  options.device = device;
  options.input_dtype = dtype;
  options.seq_length = c.seq_length;
  options.shard_rank = dp.rank();
  options.shard_count = dp.size();
  io::DataLoader loader(ctx, c.eval_data, options);
  const int64_t batches =
      c.eval_iters > 0 ? std::min(c.eval_iters, loader.batches_per_epoch()) : loader.batches_per_epoch();
  const bool classifier = !nn::model_traits(nn::parse_model_kind(c.model)).reads_tokens;
  double loss_sum = 0.0;
  int64_t count = 0, correct = 0;
  model.eval();
  for (int64_t i = 0; i < batches; ++i) {
    io::Batch batch = loader.next();
    if (batch.targets.numel() == 0) continue;
    nn::Saved saved, loss_saved;
    const nn::Pass pass{c.seed, 0, 0};
    Tensor logits = pipeline.engine
                        ? pipeline.engine->forward_only(batch.inputs, pipeline.input_shape(batch.inputs), dtype, pass)
                        : model.forward(batch.inputs, saved, pass);
    if (!logits.defined()) continue;  // a pipeline stage before the last
    if (classifier) correct += nn::count_correct(logits, batch.targets);
    const nn::LossValue value = loss.forward(logits, batch.targets, loss_saved);
    loss_sum += value.loss * double(value.count);
    count += value.count;
  }
  model.train();
  // Summed over the data-parallel replicas; under pipeline parallelism
  // computed by the last stage and handed to the others.
  const bool pipelined = pipeline.engine && pipeline.stages->size() > 1;
  if (dp.size() > 1 || pipelined) {
    Tensor sum = ctx.from_vector(Shape{1}, std::vector<float>{float(loss_sum)}, device);
    Tensor counts = ctx.from_vector(Shape{2}, std::vector<int64_t>{count, correct}, device);
    parallel::share_last_stage_values({sum, counts}, *pipeline.stages, dp, parallel::ReduceOp::sum);
    loss_sum = sum.to_vector<float>()[0];
    const std::vector<int64_t> totals = counts.to_vector<int64_t>();
    count = totals[0];
    correct = totals[1];
  }
  EvalResult result;
  result.count = count;
  result.loss = count > 0 ? loss_sum / double(count) : 0.0;
  if (classifier) result.accuracy = count > 0 ? double(correct) / double(count) : 0.0;
  return result;
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

// What the ranks agree on at a step boundary, the same on every rank: the
// first preemption signal any rank received, the highest rank that got one,
// whether rank 0's clock says a --save-interval-minutes save is due (one
// clock decides, so every rank saves at the same step), and whether any
// rank's background checkpoint write still runs or failed. One tiny all-reduce
// (max), issued by every rank at the same point of the step; the tensor
// lives on the training device, which every --comm-backend can move.
struct StepBoundary {
  int signal = 0, signal_rank = -1;
  bool time_save_due = false;
  bool save_writing = false, save_failed = false;  // a background checkpoint write still runs / failed on some rank
};

StepBoundary agree_at_step_boundary(parallel::Communicator& world, Context& ctx, Device device,
                                    const PreemptionSignals& signals, bool time_save_due,
                                    const TrainingCheckpoints& checkpoints) {
  const int local = signals.received();
  std::vector<int32_t> flags = {local, local ? world.rank() : -1, world.rank() == 0 && time_save_due ? 1 : 0,
                                checkpoints.writing() ? 1 : 0, checkpoints.failed() ? 1 : 0};
  if (world.size() > 1) {
    Tensor agreed = ctx.from_vector(Shape{int64_t(flags.size())}, flags, device);
    world.all_reduce(agreed, parallel::ReduceOp::max)->wait();
    flags = agreed.to_vector<int32_t>();
  }
  return {flags[0], flags[1], flags[2] != 0, flags[3] != 0, flags[4] != 0};
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

// Under pipeline parallelism (collective over the world, so every rank makes
// them): `model`, the ranks of one replica's model (tp x pp, for the gradient
// norm), and `embedding`, the first and last stage of one tensor-parallel
// rank (the tied embedding). Both null without pipelining.
struct PipelineGroups {
  std::unique_ptr<parallel::Communicator> model, embedding;
};
PipelineGroups split_pipeline_groups(parallel::Communicator& world, parallel::ProcessGrid& grid,
                                     const nn::StageLayers& stage) {
  PipelineGroups groups;
  if (grid.pp_size() == 1) return groups;
  groups.model = world.split(grid.dp_rank(), world.rank(), "model");
  const bool end_stage = stage.first() || stage.last();
  const int color =
      end_stage ? grid.dp_rank() * grid.tp_size() + grid.tp_rank() : grid.dp_size() * grid.tp_size() + world.rank();
  groups.embedding = world.split(color, world.rank(), "embedding");
  return groups;
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

// Micro-batches per step on each rank: --global-batch-size over
// --micro-batch-size x the data-parallel ranks (1 without a global batch).
int64_t micro_batches_per_step(const TrainConfig& c, int data_parallel) {
  const int64_t per_step = c.micro_batch_size * data_parallel;  // samples of one micro-batch over all ranks
  TESSERA_CHECK(c.global_batch_size % per_step == 0, "--global-batch-size ", c.global_batch_size,
                " is not a multiple of --micro-batch-size ", c.micro_batch_size, " x ", data_parallel,
                " data-parallel ranks = ", per_step, "; use a multiple of ", per_step,
                " (or change --micro-batch-size or the number of ranks)");
  return c.global_batch_size > 0 ? c.global_batch_size / per_step : 1;
}

// The replica's options: --zero, its units and --zero-prefetch, --bucket-size-mb, the norm's groups and
// rule (a tied copy counts nowhere, a replicated parameter on tp rank 0), the
// tied table reduced after its two copies are summed, events into the trace.
parallel::DataParallelOptions data_parallel_options(const TrainConfig& c, parallel::ProcessGrid& grid,
                                                    parallel::Communicator* model_group,
                                                    const nn::Parameter* tied_table, nn::Module& model,
                                                    io::TraceWriter& trace) {
  parallel::DataParallelOptions options;
  options.zero_stage = c.zero;
  options.bucket_size_mb = c.bucket_size_mb;
  if (c.zero >= 2) options.units = nn::sharding_units(model);  // blocks, embeddings, ln_f; the MLP's/CNN's layers
  options.prefetch = int(c.zero_prefetch);
  options.model_parallel = model_group ? model_group : &grid.tp();
  const int tp_rank = grid.tp_rank();
  options.counts_in_norm = [tp_rank](const nn::Parameter& p) {
    return !p.tied_copy && (p.shard.split || tp_rank == 0);
  };
  // The tied table's gradient is whole only after the two end stages sum it;
  // the other buckets are reduced while backward runs.
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
  const int v = c.virtual_pipeline_stages;
  text << "pipeline: " << c.pipeline_parallel << " stages";
  text << (v > 1 ? " x " + std::to_string(v) + " chunks, interleaved " : ", ") << c.pipeline_schedule << ", "
       << nn::model_traits(kind).layer_word;
  for (size_t s = 0; s + 1 < stage_model.bounds.size(); ++s)
    text << (s ? ", " : " ") << "[" << stage_model.bounds[s] << ", " << stage_model.bounds[s + 1] << ")";
  if (v > 1) text << ", chunk c on stage c mod " << c.pipeline_parallel;
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
        << " tp=" << state.tp << " pp=" << state.pp
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

// The metrics record of step `step` (0-based) from what TrainStep returned:
// loss, learning rate, norm, the reduction's tail after backward and, under
// pipelining, this stage's idle share of the step (the bubble).
io::StepRecord step_record(int64_t step, int64_t total_steps, const parallel::StepResult& outcome, double lr,
                           int64_t epoch, bool pipelined) {
  io::StepRecord record;
  record.step = step + 1;
  record.total_steps = total_steps;
  record.loss = outcome.loss;
  record.lr = lr;
  record.grad_norm = outcome.grad_norm;
  record.skipped = outcome.skipped;
  record.epoch = epoch;
  const parallel::ReductionStats& sync = outcome.reduction;
  record.extra.emplace_back("grad_sync_ms", double(sync.reduction_end_ns - sync.backward_end_ns) * 1e-6);
  if (pipelined) {
    const double span = double(outcome.pipeline.end_ns - outcome.pipeline.start_ns);
    record.extra.emplace_back("pipeline_idle", span > 0 ? double(outcome.pipeline.idle_ns()) / span : 0.0);
  }
  return record;
}

// An evaluation into the metrics and, on rank 0 (`progress` non-null), a line above the progress bar.
// The evaluation data's tokens per byte of text (a language model's, when
// the file knows its text's bytes: io::DatasetInfo::text_bytes).
std::optional<double> tokens_per_byte(const std::optional<io::DatasetInfo>& eval_data, bool tokens) {
  if (!tokens || !eval_data || !eval_data->text_bytes || *eval_data->text_bytes <= 0) return std::nullopt;
  return double(eval_data->num_tokens) / double(*eval_data->text_bytes);
}

// `tokens_per_byte`: of the evaluation data (a language model's), when its
// text's bytes are known; bits per byte = nats per token / ln 2 x tokens per byte.
io::EvalRecord report_eval(const EvalResult& eval, int64_t step, std::optional<double> tokens_per_byte,
                           io::MetricsWriter& metrics, io::ProgressLine* progress) {
  io::EvalRecord record;
  record.step = step;
  record.eval_loss = eval.loss;
  record.eval_accuracy = eval.accuracy;
  if (tokens_per_byte) record.eval_bits_per_byte = eval.loss / std::log(2.0) * *tokens_per_byte;
  metrics.log_eval(record);
  if (!progress) return record;
  char line[160];
  if (eval.accuracy)
    std::snprintf(line, sizeof line, "eval step %lld: loss %.4f, accuracy %.2f%% (%lld samples)",
                  static_cast<long long>(step), eval.loss, 100.0 * *eval.accuracy, static_cast<long long>(eval.count));
  else
    std::snprintf(line, sizeof line, "eval step %lld: loss %.4f nats/token (%.3f bits) over %lld tokens",
                  static_cast<long long>(step), eval.loss, eval.loss / std::log(2.0),
                  static_cast<long long>(eval.count));
  progress->print_above(line);
  return record;
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

// Why the run stopped before its last step (a signal or --exit-interval at
// `step`, 1-based), and how to go on.
std::string describe_stop(const TrainConfig& c, int signal, int signal_rank, int64_t step, const TrainResult& result) {
  std::ostringstream why;
  if (signal != 0)
    why << signal_name(signal) << " received by rank " << signal_rank << "; stopped after step " << step;
  else
    why << "--exit-interval " << c.exit_interval << " reached at step " << step;
  if (!c.save.empty())
    why << "; checkpoint " << result.checkpoint << " written; go on with --resume auto (or --resume "
        << result.checkpoint << ")";
  else if (signal != 0)
    why << "; no --save directory, so nothing was saved; exiting with status " << result.exit_code();
  else
    why << "; no --save directory, so nothing was saved";
  return why.str();
}

// Rank 0's last lines: why it stopped early (if it did), steps, loss and
// median step time, and where the metrics and traces are.
void print_summary(const TrainConfig& c, const TrainResult& result, const std::string& stop_reason,
                   const std::string& trace_path, int world_size) {
  if (!stop_reason.empty()) std::printf("stopping: %s\n", stop_reason.c_str());
  std::printf("done: %lld steps, last loss %.4f, median %.1f ms/step", static_cast<long long>(result.steps),
              result.last_loss, result.median_ms_per_step);
  if (result.skipped_steps) std::printf(", %lld skipped", static_cast<long long>(result.skipped_steps));
  std::printf("\n");
  const TrainResult::PeakMemory& m = result.peak_memory;
  std::printf("memory (rank 0, peak of a step): parameters %s, gradients %s, optimizer state %s (together %s), "
              "activations and workspaces %s\n",
              parallel::byte_text(m.parameters).c_str(), parallel::byte_text(m.gradients).c_str(),
              parallel::byte_text(m.optimizer).c_str(), parallel::byte_text(m.model_state).c_str(),
              parallel::byte_text(m.activations).c_str());
  if (!c.metrics.empty())
    std::printf("metrics: %s (plot with: tessera plot %s -o curves.svg)\n", c.metrics.c_str(), c.metrics.c_str());
  if (!c.trace.empty())
    std::printf("trace: %s (open in https://ui.perfetto.dev)%s\n", trace_path.c_str(),
                world_size > 1 ? ", one file per rank" : "");
  std::fflush(stdout);
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

// --estimate-memory: this rank's predicted model-state bytes
// (parallel/memory_plan.h) from its sharding units, gathered to every rank;
// rank 0 prints one line per rank and the formula with its own numbers.
std::vector<std::array<int64_t, 3>> estimate_memory(const TrainConfig& c, nn::Module& model, int data_parallel,
                                                    int64_t micro_batches, DType dtype, parallel::Communicator& world,
                                                    Context& ctx) {
  parallel::MemoryPlanInput input;
  for (nn::Module* unit : nn::sharding_units(model)) {
    // This rank's elements (its tensor-parallel shards), and whether it is the
    // GPT's table (or its tied copy): used by the head at the start of
    // backward and by the embedding at its end, its gradient lives throughout.
    int64_t elements = 0;
    bool held = false;
    for (const nn::Parameter* p : unit->parameters()) {
      elements += p->value.numel();
      held |= p->name == "wte.weight";
    }
    input.unit_elements.push_back(elements);
    input.unit_held.push_back(held);
  }
  input.value_bytes = int64_t(dtype_size(dtype));
  input.optimizer_bytes = parallel::optimizer_bytes_per_element(optimizer_config(c), dtype);
  input.data_parallel = data_parallel;
  input.zero_stage = c.zero;
  input.prefetch = int(c.zero_prefetch);
  input.accumulates = micro_batches > 1;
  const parallel::MemoryPlan plan = parallel::predict_memory(input);
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
                          parallel::ProcessGrid& grid, int64_t micro_batches, parallel::Communicator& world,
                          Context& ctx) {
  nn::ModelSpec shapes = spec;
  shapes.shapes_only = true;
  const models::StageModel stage_model = models::build_stage_model(
      model_cfg, shapes, grid, c.sequence_parallel, c.pipeline_split, c.virtual_pipeline_stages);
  TrainResult estimate;
  estimate.data_parallel_size = grid.dp_size();
  estimate.memory_estimate =
      estimate_memory(c, *stage_model.module, grid.dp_size(), micro_batches, spec.dtype, world, ctx);
  return estimate;
}

// This step's peaks (the allocator's counters since the step began) into
// the metrics record and the run's peaks.
void record_memory(const AllocatorStats& stats, io::StepRecord& record, TrainResult::PeakMemory& peak) {
  const auto bytes = [&](MemoryUse use) { return int64_t(stats.peak_by_use[int(use)]); };
  const int64_t values[5] = {bytes(MemoryUse::parameters), bytes(MemoryUse::gradients), bytes(MemoryUse::optimizer),
                             bytes(MemoryUse::other), int64_t(stats.peak_model_state_bytes)};
  const char* names[5] = {"mem_parameters_bytes", "mem_gradients_bytes", "mem_optimizer_bytes",
                          "mem_activations_bytes", "mem_model_state_bytes"};
  int64_t* peaks[5] = {&peak.parameters, &peak.gradients, &peak.optimizer, &peak.activations, &peak.model_state};
  for (int i = 0; i < 5; ++i) {
    record.extra.emplace_back(names[i], double(values[i]));
    *peaks[i] = std::max(*peaks[i], values[i]);
  }
}

// --zero 1/2/3 shards over the data-parallel ranks: with one it only adds
// memory (the flat buffers and, at 2/3, the units' gathers), so it is refused.
void check_zero_has_ranks(const TrainConfig& c, const parallel::ProcessGrid& grid) {
  if (c.zero == 0 || grid.dp_size() > 1) return;
  const int64_t model_ranks = int64_t(grid.tp_size()) * grid.pp_size();
  TESSERA_THROW("--zero ", c.zero, " shards ", c.zero == 1 ? "the optimizer state" : c.zero == 2
                    ? "the optimizer state and gradients" : "the parameters, gradients and optimizer state",
                " over the data-parallel ranks, and this layout has one (", model_ranks, " rank(s) = --tensor-parallel ",
                grid.tp_size(), " x --pipeline-parallel ", grid.pp_size(),
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
                       nn::GradScaler& scaler, parallel::Communicator& world, parallel::ProcessGrid& grid) {
  TrainState state;
  state.config = &c;
  state.model = &model;
  state.dtype = dtype;
  state.replica = &replica;
  state.parameters = parameters;
  state.scaler = &scaler;
  state.world = &world;
  state.dp = grid.dp_size();
  state.tp = grid.tp_size();
  state.pp = grid.pp_size();
  state.virtual_stages = c.virtual_pipeline_stages;
  state.dp_rank = grid.dp_rank();
  state.tp_rank = grid.tp_rank();
  state.pp_rank = grid.pp_rank();
  state.global_micro_batch = c.micro_batch_size * grid.dp_size();
  return state;
}

// The run on `device` of `ctx` (see run()).
TrainResult run_on(const TrainConfig& c, const parallel::MpiEnv* env, parallel::Communicator* given, Context& ctx,
                   Device device, const PreemptionSignals& signals) {
  const DType dtype = compute_dtype(c.precision);
  World opened = open_world(c, env, given, ctx, device);
  parallel::Communicator* world = opened.world;
  const std::string& backend = opened.backend;

  std::optional<io::DatasetInfo> data_info, eval_info;
  if (!c.synthetic) data_info = io::inspect_dataset(c.data);
  if (!c.eval_data.empty()) {
    eval_info = io::inspect_dataset(c.eval_data);
    TESSERA_CHECK(!data_info || eval_info->kind == data_info->kind, "--eval-data ", c.eval_data,
                  " holds another kind of data than --data ", c.data);
  }
  check_ranks_agree(*world, c, data_info, eval_info);
  // Rank 0 writes checkpoints: the directory must take them, and be this job's alone for the run.
  std::optional<io::SaveDirectoryLock> save_lock;
  if (!c.save.empty() && world->rank() == 0) {
    io::check_save_directory(c.save);
    save_lock.emplace(c.save);
  }

  parallel::GridSizes grid_sizes;
  grid_sizes.tp = c.tensor_parallel;
  grid_sizes.pp = c.pipeline_parallel;
  parallel::ProcessGrid grid(*world, grid_sizes);
  parallel::Communicator& dp = grid.dp();
  const bool root = world->rank() == 0;
  check_zero_has_ranks(c, grid);
  const std::string layout =
      env ? env->describe_layout()  // collective over MPI_COMM_WORLD
          : std::to_string(world->size()) + " rank(s) of the communicator '" + world->name() + "'";

  const nn::ModelConfig model_cfg = model_config(c, data_info);
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.device = device;
  spec.dtype = dtype;
  spec.seed = c.seed;
  const int64_t accumulation = micro_batches_per_step(c, dp.size());
  TESSERA_CHECK(c.virtual_pipeline_stages == 1 || accumulation % grid.pp_size() == 0, "--virtual-pipeline-stages ",
                c.virtual_pipeline_stages, ": a step's ", accumulation, " micro-batches (--global-batch-size ",
                c.global_batch_size, " / (--micro-batch-size ", c.micro_batch_size, " x ", dp.size(),
                " data-parallel ranks)) must be a multiple of --pipeline-parallel ", grid.pp_size(),
                "; use --global-batch-size ", c.micro_batch_size * dp.size() * grid.pp_size(), " or a multiple of it");
  if (c.estimate_memory) return estimate_only(c, model_cfg, spec, grid, accumulation, *world, ctx);
  // This rank's part of the model: the layers of its pipeline stage, split
  // over its tensor-parallel group, with its loss (models/stage_model.h).
  models::StageModel stage_model = models::build_stage_model(model_cfg, spec, grid, c.sequence_parallel,
                                                                 c.pipeline_split, c.virtual_pipeline_stages);
  const nn::StageLayers& stage = stage_model.layers;
  const std::string stage_description = describe_stages(c, stage_model, model_cfg.kind);
  const std::unique_ptr<nn::Module>& model = stage_model.module;
  const nn::Loss& loss = *stage_model.loss;
  nn::Parameter* tied_table = stage_model.tied_table;
  const std::function<Shape(const Tensor&)>& stage_input_shape = stage_model.input_shape;
  std::vector<nn::Parameter*> parameters = model->parameters();
  inject_start_up_fault(world->rank());
  if (!c.init_from.empty()) {
    // Before the optimizer copies them (masters) and ZeRO-3 shards them; a resumed checkpoint replaces them.
    const io::WeightsLoaded loaded = io::load_safetensors_weights(c.init_from, parameters, model_cfg.num_layers);
    if (root)
      std::printf("init-from: %s: %lld tensors under %s names%s\n", c.init_from.c_str(),
                  static_cast<long long>(loaded.tensors), loaded.naming.c_str(),
                  loaded.ignored ? (", " + std::to_string(loaded.ignored) + " of the file's not used").c_str() : "");
  }
  TrainingSamples samples(c, stage_model.causal_lm);
  const PipelineGroups groups = split_pipeline_groups(*world, grid, stage);

  // The trace first: the data-parallel reducer writes its communication into it.
  io::TraceOptions trace_options;
  trace_options.path = c.trace;
  trace_options.rank = world->rank();
  trace_options.world_size = world->size();
  io::TraceWriter trace(trace_options);
  parallel::DataParallel replica(parameters, dp, optimizer_config(c),
                                 data_parallel_options(c, grid, groups.model.get(), tied_table, *model, trace));
  nn::GradScaler scaler = nn::GradScaler::for_dtype(dtype);
  // The step: the same driver for every layout (one stage is the degenerate pipeline).
  parallel::TrainStepParts step_parts;
  step_parts.context = &ctx;
  step_parts.device = device;
  step_parts.model = model.get();
  step_parts.chunks = stage_model.chunks;
  step_parts.loss = &loss;
  step_parts.replica = &replica;
  step_parts.scaler = &scaler;
  step_parts.pipeline = &grid.pp();
  step_parts.data_parallel = &dp;
  step_parts.embedding_group = groups.embedding.get();
  step_parts.tied_table = tied_table;
  step_parts.seed = c.seed;
  step_parts.clip_grad = c.clip_grad;
  step_parts.pipeline_options = pipeline_options(c, grid.pp_size(), trace);
  parallel::TrainStep train_step(std::move(step_parts));
  parallel::PipelineEngine* engine = grid.pp_size() > 1 ? &train_step.engine() : nullptr;  // evaluation

  TrainState state = train_state(c, model_cfg, dtype, parameters, replica, scaler, *world, grid);
  state.save_lock = save_lock ? &*save_lock : nullptr;
  const std::optional<Resumed> resumed = resume_if_asked(c, state, *world, ctx, device);
  Counters counters = resumed ? resumed->counters : Counters{};

  BatchSource source(ctx, c, model_cfg, device, dtype, dp.rank(), dp.size(), counters.sampler);
  const int64_t total_steps = total_steps_of(c, source.batches_per_epoch(), accumulation);
  const nn::LrScheduleConfig schedule_cfg = lr_schedule_config(c, std::max<int64_t>(total_steps, 1));
  const nn::LrSchedule schedule(schedule_cfg);
  state.schedule = &schedule_cfg;

  // Rank 0 reports: progress, metrics, Katib lines, start-up and final lines.
  io::ProgressLine progress(progress_options(c, root));
  bool katib_due = true;
  io::MetricsWriter metrics;
  if (root) {
    io::MetricsOptions metrics_options;
    metrics_options.path = c.metrics;
    metrics_options.append = resumed.has_value();  // a resumed run goes on with the same file
    if (c.katib_metrics || io::stdout_read_by_katib())
      metrics_options.katib = [&](std::string_view line) {
        if (katib_due) progress.print_above(line);
      };
    else
      metrics_options.katib = nullptr;
    metrics = io::MetricsWriter(metrics_options);
  }

  const std::string replica_description = replica.describe();  // collective-free, but every rank computes it
  if (root) {
    std::printf("tessera train: %s\n%s\n", ctx.describe().c_str(), describe(c).c_str());
    std::printf("ranks: %s; %s; communicator %s; data parallel: %s\n", layout.c_str(), grid.describe().c_str(),
                backend.c_str(), replica_description.c_str());
    if (!stage_description.empty()) std::printf("%s\n", stage_description.c_str());
    if (const std::string vocabulary = describe_vocabulary(c, model_cfg, data_info); !vocabulary.empty())
      std::printf("%s\n", vocabulary.c_str());
    if (env) std::printf("%s", describe_libraries_and_topology(*env).c_str());
    if (data_info) std::printf("data: %s\n", data_info->describe().c_str());
    std::printf("%s", describe_resume(c, resumed, counters, total_steps, state).c_str());
    std::printf(
        "model: %s, %lld parameters, %s on %s; %lld steps of %lld micro-batch(es) of %lld on each of %d rank(s)\n",
        c.model.c_str(), static_cast<long long>(nn::parameter_count(*model)), std::string(dtype_name(dtype)).c_str(),
        device.to_string().c_str(), static_cast<long long>(total_steps), static_cast<long long>(accumulation),
        static_cast<long long>(c.micro_batch_size), dp.size());
    std::fflush(stdout);
  }
  metrics.log_run({{"model", c.model},
                   {"precision", c.precision},
                   {"device", device.to_string()},
                   {"data_parallel", std::to_string(dp.size())},
                   {"zero", std::to_string(c.zero)}});

  const bool tokens = nn::model_traits(model_cfg.kind).reads_tokens;
  const std::optional<double> eval_tokens_per_byte = tokens_per_byte(eval_info, tokens);
  const int64_t samples_per_step = accumulation * c.micro_batch_size * dp.size();
  const bool evaluate_per_epoch = c.eval_interval == 0 && source.batches_per_epoch() > 0;
  const int64_t steps_per_epoch =
      evaluate_per_epoch ? std::max<int64_t>(1, source.batches_per_epoch() / accumulation) : 0;

  TrainResult result;
  result.data_parallel_size = dp.size();
  result.optimizer_state_bytes = replica.optimizer_state_bytes();
  result.start_step = result.final_step = counters.step;
  if (resumed) result.resumed_from = resumed->path;
  std::vector<double> step_ms;
  int64_t consecutive_skips = counters.consecutive_skips;
  std::string stop_reason;  // why the loop ended before total_steps
  auto last_save = Clock::now();  // --save-interval-minutes counts from here (rank 0's clock decides)
  // Saves (synchronous, or written in the background and published at a
  // later step boundary); their figures go into the next step's metrics.
  TrainingCheckpoints checkpoints(state, [&](const std::string& line) {
    if (root) progress.print_above(line);
  });
  // Every --log-interval steps: stragglers named, Prometheus fed (apps/train_monitor.h).
  TrainingMonitor monitor(c, grid, ctx, device, [&](const std::string& line) { progress.print_above(line); });
  if (root && monitor.metrics_port() > 0)
    std::printf("metrics: Prometheus can scrape http://%s:%d/metrics (every rank's series, refreshed every %lld steps)\n",
                env ? env->hostname().c_str() : "localhost", monitor.metrics_port(),
                static_cast<long long>(c.log_interval));
  // --mlflow-uri: rank 0 records the run in MLflow from a background thread (apps/train_tracking.h).
  RunTracking tracking(c, root,
                       RunFacts{"dp=" + std::to_string(grid.dp_size()) + " tp=" + std::to_string(grid.tp_size()) +
                                    " pp=" + std::to_string(grid.pp_size()),
                                device.to_string(), c.precision, world->size(), env ? mpi_library_version() : "",
                                resumed ? counters.step : -1, resumed ? resumed->mlflow_run_id : "",
                                resumed ? resumed->mlflow_uri : ""});
  if (root && !c.mlflow_uri.empty()) state.tracking_run_id = [&tracking] { return tracking.run_id(); };
  if (root && counters.step >= total_steps && total_steps > 0)
    std::printf("nothing to do: the checkpoint is at step %lld and --train-steps/--epochs ask for %lld\n",
                static_cast<long long>(counters.step), static_cast<long long>(total_steps));
  signals.training_started();  // from here a signal asks for a checkpoint at the next step boundary
  if (total_steps == 0 && counters.step == 0) {  // --init-from, --train-steps 0: the weights as they came
    checkpoints.save(counters, true);
    result.checkpoint = checkpoints.last_published();
  }
  for (int64_t step = counters.step; step < total_steps; ++step) {
    const auto start = Clock::now();  // injected faults count: a slow rank's sleep is its own time
    inject_step_faults(step + 1, world->rank(), source, device);
    ctx.allocator(device).reset_peak_stats();  // this step's memory peaks (record_memory)
    const int64_t trace_start = trace.enabled() ? trace.now_ns() : 0;
    const int64_t tp_bytes_before = grid.tp().counters().total_bytes();
    int64_t epoch = 0;
    const auto data_start = Clock::now();
    parallel::StepBatches batches = next_batches(source, accumulation, stage_input_shape, trace, counters, epoch);
    const double data_wait = std::chrono::duration<double>(Clock::now() - data_start).count();
    batches.activation_dtype = dtype;
    const double lr = schedule.lr(counters.updates);  // Megatron: skipped steps do not advance the schedule
    // TESSERA_FAULT=nan_grad: this rank's gradients of the step are NaN (through the loss's gradient).
    const parallel::StepResult outcome =
        train_step.run(step, batches, lr, fault_due("nan_grad", step + 1, world->rank()));
    const parallel::ReductionStats& sync = outcome.reduction;
    if (trace.enabled()) trace.counter("buckets_launched_in_backward", double(sync.launched_in_backward));
    const bool skipped = outcome.skipped;
    ++(skipped ? counters.skipped_steps : counters.updates);
    if (skipped && !scaler.enabled()) {
      ++result.skipped_steps;
      // Every rank stops here together (the skip is agreed): a background save is published first.
      if (consecutive_skips + 1 >= c.max_skipped_steps && checkpoints.pending()) checkpoints.publish();
      TESSERA_CHECK(++consecutive_skips < c.max_skipped_steps, "step ", step + 1, ": non-finite gradients in ",
                    consecutive_skips,
                    " consecutive steps (first non-finite gradient: ", non_finite_gradient_text(replica),
                    "); lower --lr, enable --clip-grad, or check the data; the run stops here");
    } else if (skipped) {
      ++result.skipped_steps;
    } else {
      consecutive_skips = 0;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    step_ms.push_back(seconds * 1e3);
    if (trace.enabled()) trace.complete("step " + std::to_string(step + 1), "step", trace_start, trace.now_ns());

    io::StepRecord record = step_record(step, total_steps, outcome, lr, epoch, engine != nullptr);
    record.ms_per_step = seconds * 1e3;
    if (tokens)
      record.tokens_per_s = double(samples_per_step * c.seq_length) / seconds;
    else
      record.samples_per_s = double(samples_per_step) / seconds;
    if (scaler.enabled()) record.loss_scale = outcome.loss_scale;
    record_memory(ctx.allocator(device).stats(), record, result.peak_memory);
    if (device.is_accelerator())  // page-locked host memory: the loader's and the checkpoints' staging
      record.extra.emplace_back("mem_pinned_bytes", double(ctx.pinned_allocator(device).stats().reserved_bytes));
    for (const auto& figure : checkpoints.take_figures()) record.extra.push_back(figure);
    // Bytes this rank's tensor-parallel group moved in the step (counted by the communicator).
    if (grid.tp_size() > 1)
      record.extra.emplace_back("tp_comm_bytes", double(grid.tp().counters().total_bytes() - tp_bytes_before));
    katib_due = (step + 1) % c.log_interval == 0 || step + 1 == total_steps;
    StepFigures figures;
    figures.step_seconds = seconds;
    figures.data_wait_seconds = data_wait;
    figures.sync_seconds = double(sync.reduction_end_ns - sync.backward_end_ns) * 1e-9;
    for (const auto& [name, value] : record.extra) {
      if (name == "checkpoint_stall_ms") figures.checkpoint_stall_seconds += value * 1e-3;
      if (name == "checkpoint_write_s") figures.checkpoint_write_seconds = value;
    }
    monitor.record_step(record, figures);
    for (const auto& figure : monitor.exchange(step + 1, step + 1 == total_steps)) record.extra.push_back(figure);
    metrics.log_step(record);
    tracking.log_step(record);
    progress.update(record);
    result.last_loss = record.loss;
    result.losses.push_back(record.loss);
    result.steps = step + 1 - result.start_step;
    result.final_step = step + 1;
    counters.step = step + 1;
    counters.consecutive_skips = consecutive_skips;

    const bool last = step + 1 == total_steps;
    const bool due = c.eval_interval > 0 ? (step + 1) % c.eval_interval == 0
                                         : evaluate_per_epoch && (step + 1) % steps_per_epoch == 0;
    if (!c.eval_data.empty() && (due || last)) {
      const EvalResult eval =
          evaluate(ctx, *model, loss, c, device, dtype, trace, dp, PipelineEval{engine, &grid.pp(), stage_input_shape});
      katib_due = true;  // the metrics writer prints the eval's Katib line
      tracking.log_eval(report_eval(eval, step + 1, eval_tokens_per_byte, metrics, root ? &progress : nullptr));
      monitor.record_eval(eval.loss);
      if (last) result.final_eval = eval;
    }

    if (samples.due(step + 1, last)) {
      const std::string text = samples.sample(step + 1);
      if (root) progress.print_above(text);
    }

    // Step boundary: stop (saving first) when any rank got a preemption
    // signal or --exit-interval says so; save on --save-interval and at the
    // end (a signal during the last step changes nothing: the run is done).
    const bool clock_due = c.save_interval_minutes > 0 &&
                           std::chrono::duration<double>(Clock::now() - last_save).count() >= 60.0 * c.save_interval_minutes;
    const StepBoundary boundary = agree_at_step_boundary(*world, ctx, device, signals, clock_due, checkpoints);
    // A background save every rank has written (or one that failed: the run stops here, naming it) is published.
    if (checkpoints.pending() && (!boundary.save_writing || boundary.save_failed)) checkpoints.publish();
    int signal = last ? 0 : boundary.signal, signal_rank = boundary.signal_rank;
    const bool exit_due = c.exit_interval > 0 && (step + 1) % c.exit_interval == 0 && !last;
    bool stop = signal != 0 || exit_due;
    const bool save_due = !c.save.empty() && (last || stop || boundary.time_save_due ||
                                              (c.save_interval > 0 && (step + 1) % c.save_interval == 0));
    if (save_due) {
      {
        auto scope = trace.scope("checkpoint", "io");
        checkpoints.save(counters, last || stop);
      }
      last_save = Clock::now();
      if (!stop && !last) {
        // A signal that arrived during the save: the checkpoint just written serves.
        const StepBoundary during = agree_at_step_boundary(*world, ctx, device, signals, false, checkpoints);
        signal = during.signal;
        signal_rank = during.signal_rank;
        stop = signal != 0;
        if (stop) checkpoints.publish();
      }
    }
    result.checkpoint = checkpoints.last_published();
    result.checkpoint_stall_ms = checkpoints.total_stall_ms();
    if (stop) {
      if (signal != 0) result.stop_signal = signal;
      stop_reason = describe_stop(c, signal, signal_rank, step + 1, result);
      break;
    }
  }
  progress.finish();
  trace.close();
  result.median_ms_per_step = median(step_ms);
  if (root) print_summary(c, result, stop_reason, trace.path(), world->size());
  tracking.finish(result, !stop_reason.empty());
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

TrainResult train(const TrainConfig& c) {
  validate(c);
  int mpi_initialised = 0;
  MPI_Initialized(&mpi_initialised);
  if (!mpi_initialised) {
    const std::unique_ptr<parallel::Communicator> local = parallel::make_local_communicator("world (no MPI)");
    return run(c, nullptr, local.get());
  }
  const parallel::MpiEnv env;  // MPI is up already: this only reads the layout (and never finalises)
  return run(c, &env, nullptr);
}

TrainResult train(const TrainConfig& c, parallel::Communicator& world) {
  return run(c, nullptr, &world);
}

}  // namespace tessera::app
