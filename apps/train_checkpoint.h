// What a training checkpoint holds and how the trainer writes and restores
// it, on top of io/checkpoint.h (the layout-independent HDF5 format):
//
//   tensors (each logical tensor whole, under its name)
//     <parameter>                      the model's dtype, the parameter's shape
//     <parameter>.exp_avg, .exp_avg_sq AdamW moments (f32)
//     <parameter>.momentum_buffer      SGD with momentum (f32)
//     <parameter>.master               f32 master weights (bf16/fp16 runs)
//   metadata (string attributes)
//     config.<flag>       every setting of the run (flag names without dashes)
//     model.<field>       the model as built (flags and the data's shapes), checked on resume
//     layout.world/dp/tp/pp/zero
//     optimizer.kind, optimizer.step_count
//     schedule.iteration/num_steps/style/lr/min_lr/warmup_steps/total_steps
//                         (num_steps: successful updates, the schedule's position)
//     scaler.enabled/scale/growth_tracker
//     sampler.epoch, sampler.samples  (the next global batch starts at this
//                                      sample of the epoch's order)
//     train.skipped_steps, train.consecutive_skips
//   per rank: rng  ("seed=S next_step=N dp_rank=r dp_size=n": every random
//                   draw is a pure function of these, see core/rng.h)
//
// Each element is written once, by the rank that owns it (--ckpt-format
// sharded: into its own file; gathered: through rank 0): tensors every rank
// holds whole by world rank 0, tensor-parallel shards (Parameter::shard) by
// the tp ranks of data-parallel rank 0, and under ZeRO each rank its own
// ranges of the optimizer state (DataParallel::optimizer_state_slices) and,
// under ZeRO-3, of the values. Restoring reads each rank's own slices, so a
// checkpoint loads under another dp size, tp size or --zero setting.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/dtype.h"
#include "io/checkpoint.h"
#include "io/save_lock.h"
#include "io/trace.h"
#include "io/training_events.h"
#include "nn/grad_scaler.h"
#include "nn/lr_schedule.h"
#include "nn/models.h"
#include "nn/parameter.h"
#include "parallel/communicator.h"
#include "parallel/data_parallel.h"

namespace tessera::app {

// Where the data sampler stands: the next global batch starts at sample
// `samples` of epoch `epoch`'s order (io/loader.h), a count that does not
// depend on the number of ranks.
struct SamplerPosition {
  int64_t epoch = 0;
  int64_t samples = 0;
};

// The run's state that checkpoints save and restore (all pointers non-null).
struct TrainState {
  const TrainConfig* config = nullptr;
  const nn::ModelConfig* model = nullptr;
  DType dtype = DType::f32;
  std::vector<nn::Parameter*> parameters;
  parallel::DataParallel* replica = nullptr;
  nn::GradScaler* scaler = nullptr;
  const nn::LrScheduleConfig* schedule = nullptr;
  parallel::Communicator* world = nullptr;
  // dp: the ranks reading different samples (data parallelism × expert
  // parallelism, parallel::data_group); ep: its expert-parallel part.
  int dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  int virtual_stages = 1;  // --virtual-pipeline-stages (chunks per pipeline stage)
  int dp_rank = 0, tp_rank = 0, pp_rank = 0, cp_rank = 0, ep_rank = 0;
  int dp_axis_rank = 0;  // the coordinate on the dp axis alone
  int64_t global_micro_batch = 0;  // samples of one micro-batch over the data-parallel ranks
  // Rank 0 under --mlflow-uri: the MLflow run's id once the server gave it
  // (stored in checkpoints, so that a resumed run goes on with the same run).
  std::function<std::string()> tracking_run_id;
  // Rank 0 under --save: the directory's lock, checked before every save.
  io::SaveDirectoryLock* save_lock = nullptr;
};

struct Counters {
  int64_t step = 0;  // optimizer steps done (skipped ones included)
  SamplerPosition sampler;
  int64_t skipped_steps = 0, consecutive_skips = 0;
  // Successful updates: where the learning-rate schedule stands. A skipped
  // step advances `step` and the data but not this, as Megatron's scheduler
  // steps only when the update succeeded (its num_steps, counted in steps).
  int64_t updates = 0;
};

// The run's checkpoints (--save): each save synchronous or, with
// --async-save, written by every rank's background thread while training
// goes on (io::CheckpointSaver) and published at a later step boundary; the
// figures each save adds to the next metrics line; the line a person reads
// when one is published (rank 0, through `say`).
class TrainingCheckpoints {
 public:
  TrainingCheckpoints(const TrainState& state, std::function<void(const std::string&)> say);

  // Collective: saves after counters.step. `final`: the run ends after it
  // (the end, a signal, --exit-interval), so it is published before this
  // returns; otherwise asynchronous when --async-save is on.
  void save(const Counters& counters, bool final);
  bool pending() const { return saver_.pending(); }
  // Local: this rank's background write is still running / ended in an error
  // (what the ranks agree on at each step boundary).
  bool writing() const { return !saver_.written(); }
  bool failed() const { return saver_.write_failed(); }
  // Collective, while pending(): waits for the writes and publishes (or
  // throws naming the rank and file that failed).
  void publish();

  // checkpoint_stall_ms, checkpoint_write_s, checkpoint_bytes since the last call.
  std::vector<std::pair<std::string, double>> take_figures();
  const std::string& last_published() const { return last_published_; }
  double total_stall_ms() const { return total_stall_ms_; }

 private:
  void keep_directory_locked();
  void add_figure(const std::string& name, double value);
  void add_stall(double seconds);
  void report(const io::PublishedCheckpoint& published, double stall, double save_stall, bool background);

  const TrainState& state_;
  std::function<void(const std::string&)> say_;
  io::CheckpointSaver saver_;
  std::vector<std::pair<std::string, double>> figures_;
  std::string last_published_;
  double total_stall_ms_ = 0.0, pending_stall_s_ = 0.0;
};

// When the run saves, as a component of the training loop
// (io/training_events.h): every --save-interval steps, every
// --save-interval-minutes by rank 0's clock (agreed at the boundary, so
// every rank saves at the same step), at the end and at a stop (the
// boundary's own saves). A background save is published at the first
// boundary where every rank has written it, or where one rank's write failed
// (publishing then stops the run, naming the rank and file), and before the
// run stops; its figures go into the next step's record. Keeps the result's
// checkpoint and stall time current. Does nothing without --save.
class CheckpointCadence : public io::TrainingComponent {
 public:
  // `counters`: what a save records (the loop keeps them current);
  // `say`: rank 0's line for each checkpoint published.
  CheckpointCadence(const TrainState& state, const Counters& counters, TrainResult& result, io::TraceWriter& trace,
                    std::function<void(const std::string&)> say);

  void on_step_end(io::StepEnd& end) override;
  void boundary_flags(const io::BoundaryRound& round, std::vector<int32_t>& flags) override;
  void on_boundary(const io::BoundaryRound& round, std::span<const int32_t> agreed,
                   io::BoundaryDecision& decision) override;
  void on_save(io::Save& save) override;
  void on_stop(const io::Stop&) override;

 private:
  void publish_pending();
  void keep_result_current();

  const TrainConfig& config_;
  const Counters& counters_;
  TrainResult& result_;
  io::TraceWriter& trace_;
  TrainingCheckpoints checkpoints_;
  bool root_;
  // --save-interval-minutes counts from here (rank 0's clock decides).
  std::chrono::steady_clock::time_point last_save_;
};

// The checkpoint --resume names: the newest complete one in --save DIR for
// `auto` (nothing if there is none), the newest in PATH when PATH is a --save
// directory, else PATH itself. Nothing without --resume.
std::optional<std::string> checkpoint_to_resume(const TrainConfig& config);

struct Resumed {
  std::string path;
  Counters counters;
  std::string saved_layout;                   // "dp=2 tp=1 pp=1 zero=1 on 2 ranks"
  bool resharded = false;                     // saved under another dp size or --zero setting
  std::vector<std::string> changed_settings;  // "lr 0.001 -> 0.002", for rank 0's start-up line
  std::string mlflow_run_id, mlflow_uri;      // the MLflow run the checkpoint's run recorded into (empty: none)
};

// Collective over state.world: checks that the checkpoint at `path` was
// written for the same model (refusing with the differing flag and both
// values) and precision, then loads parameters, optimizer state (this
// rank's slices), step counts and loss-scaler state, and returns the
// counters to go on from.
Resumed load_training_checkpoint(const TrainState& state, const std::string& path);

}  // namespace tessera::app
