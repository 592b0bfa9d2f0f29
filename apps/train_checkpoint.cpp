// Training checkpoints: the trainer's state as io::TensorPiece lists and
// metadata, saved through io::CheckpointSaver (synchronously, or in the
// background with --async-save, published at a later step boundary) with
// the figures and lines each save reports, and back (model and precision
// checks, each rank reading its own slices, counters and scaler state).
#include "apps/train_checkpoint.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <filesystem>
#include <map>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "core/number_text.h"
#include "io/checkpoint.h"
#include "io/model_weights.h"
#include "parallel/memory_plan.h"

namespace tessera::app {
namespace {

namespace fs = std::filesystem;

std::string list(const std::vector<int64_t>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) out += (i ? "," : "") + std::to_string(values[i]);
  return out;
}

// One model field a checkpoint records and a resume must match, with what
// sets it (for the refusal message).
struct ModelField {
  std::string key;    // metadata key "model.<field>"
  std::string value;  // as built
  std::string what;   // "--hidden-size", "the image shape of --data", ...
  std::string absent = {};  // what a checkpoint that predates the field holds ("": every checkpoint has it)
};

std::vector<ModelField> model_fields(const nn::ModelConfig& m, DType dtype) {
  std::vector<ModelField> fields = {{"model.kind", std::string(nn::model_name(m.kind)), "--model"}};
  if (nn::model_traits(m.kind).reads_tokens) {
    fields.push_back({"model.vocab_size", std::to_string(m.vocab_size), "--vocab-size"});
    fields.push_back({"model.seq_length", std::to_string(m.seq_length), "--seq-length"});
    fields.push_back({"model.num_layers", std::to_string(m.num_layers), "--num-layers"});
    fields.push_back({"model.num_heads", std::to_string(m.num_heads), "--num-heads"});
    fields.push_back({"model.hidden_size", std::to_string(m.hidden_size), "--hidden-size"});
    fields.push_back({"model.ffn_hidden_size", std::to_string(m.ffn()), "--ffn-hidden-size"});
    for (const io::DecoderField& field : io::decoder_fields(m)) fields.push_back({field.key, field.value, field.flag,
                                                                                   field.absent});
  } else {
    if (m.kind == nn::ModelKind::mlp) fields.push_back({"model.hidden", list(m.hidden), "--hidden"});
    fields.push_back({"model.input_shape",
                      std::to_string(m.channels) + "x" + std::to_string(m.height) + "x" + std::to_string(m.width),
                      "the image shape (channels x height x width) of --data"});
    fields.push_back({"model.num_classes", std::to_string(m.num_classes), "the number of classes of --data"});
  }
  fields.push_back({"model.dtype", std::string(dtype_name(dtype)), "--precision (the parameters' dtype)"});
  return fields;
}

std::string layout_text(int64_t dp, int64_t tp, int64_t pp, int64_t virtual_stages, int64_t zero, int64_t world,
                        int64_t cp, int64_t ep) {
  std::ostringstream out;
  out << "dp=" << dp << " tp=" << tp << " pp=" << pp;
  if (cp > 1) out << " cp=" << cp;
  if (ep > 1) out << " ep=" << ep;
  if (virtual_stages > 1) out << " x " << virtual_stages << " chunks";
  out << " zero=" << zero << " on " << world << " rank(s)";
  return out.str();
}

class Metadata {
 public:
  Metadata(const io::CheckpointMetadata& values, std::string path) : values_(values), path_(std::move(path)) {}

  const std::string& get(const std::string& key) const {
    const auto found = values_.find(key);
    TESSERA_CHECK(found != values_.end(), "--resume: checkpoint ", path_, " has no '", key,
                  "' entry; it was not written by `tessera train` of this version");
    return found->second;
  }
  std::optional<std::string> find(const std::string& key) const {
    const auto found = values_.find(key);
    if (found == values_.end()) return std::nullopt;
    return found->second;
  }
  int64_t integer(const std::string& key) const {
    const std::string& value = get(key);
    int64_t out = 0;
    const auto result = std::from_chars(value.data(), value.data() + value.size(), out);
    TESSERA_CHECK(result.ec == std::errc() && result.ptr == value.data() + value.size(), "--resume: checkpoint ", path_,
                  ": '", key, "' is '", value, "', not an integer");
    return out;
  }
  float real(const std::string& key) const {
    const std::string& value = get(key);
    float out = 0;
    const auto result = std::from_chars(value.data(), value.data() + value.size(), out);
    TESSERA_CHECK(result.ec == std::errc() && result.ptr == value.data() + value.size(), "--resume: checkpoint ", path_,
                  ": '", key, "' is '", value, "', not a number");
    return out;
  }

 private:
  const io::CheckpointMetadata& values_;
  std::string path_;
};

// Where the learning-rate schedule stands: the successful updates before
// `counters.step`. Checkpoints written before schedule.num_steps was saved
// have none; every step was then an update or a skip counted in
// train.skipped_steps, so it is step − skipped_steps.
int64_t schedule_position(const Metadata& meta, const Counters& counters, const std::string& path) {
  const int64_t updates =
      meta.find("schedule.num_steps") ? meta.integer("schedule.num_steps") : counters.step - counters.skipped_steps;
  TESSERA_CHECK(updates >= 0 && updates <= counters.step, "--resume: checkpoint ", path, " is for step ", counters.step,
                " but records ", updates, " successful updates (schedule.num_steps, or step minus ",
                "train.skipped_steps); it is damaged");
  return updates;
}

// Reads `piece` from the checkpoint into `destination` (the live tensor: a
// parameter's value, possibly a view into a flat buffer, or optimizer state).
void read_into(const io::CheckpointReader& reader, io::TensorPiece piece, Tensor& destination) {
  piece.local = destination;
  reader.read(piece);
  if (piece.local.data_ptr() != destination.data_ptr()) destination.copy_(piece.local);
}

// Where a piece of optimizer state (or a ZeRO-3 value piece) sits: the
// parameter's shard, or a ZeRO range of that shard's flattening.
io::TensorPiece state_piece(const parallel::OptimizerStateSlice& slice) {
  io::TensorPiece piece;
  piece.name = slice.name;
  piece.global_shape = slice.parameter->shard.global_shape;
  piece.dtype = slice.local->dtype();
  piece.slice =
      slice.flat_range ? io::shard_slice(slice.parameter->shard, slice.begin) : io::shard_slice(slice.parameter->shard);
  return piece;
}

// Whether this rank holds the first of `p`'s replicas: coordinate 0 on
// every axis its gradient is averaged over (an expert under expert
// parallelism is held by one rank of the ep group: each writes its own).
bool first_replica(const TrainState& s, const nn::Parameter& p) {
  const auto replicated_over = [&p](const char* axis) {
    return std::find(p.gradient_axes.begin(), p.gradient_axes.end(), axis) != p.gradient_axes.end();
  };
  return s.dp_axis_rank == 0 && s.cp_rank == 0 && (s.ep_rank == 0 || !replicated_over("ep"));
}

// This rank's pieces of the training state (one owner per element).
std::vector<io::TensorPiece> training_pieces(const TrainState& s) {
  std::vector<io::TensorPiece> pieces;
  // ZeRO-3: the values exist only as each rank's pieces, written like the optimizer state's.
  std::vector<parallel::OptimizerStateSlice> slices = s.replica->value_slices();
  if (slices.empty()) {
    for (nn::Parameter* p : s.parameters) {
      io::TensorPiece piece = io::parameter_piece(*p);
      piece.local = p->value;
      // One writer per element: data-parallel replicas and, for tensors every
      // tensor-parallel rank holds whole, the tp ranks after the first write
      // nothing; nor does the last pipeline stage's tied copy of the embedding.
      piece.owner = first_replica(s, *p) && (p->shard.split || s.tp_rank == 0) && !p->tied_copy;
      pieces.push_back(std::move(piece));
    }
  }
  for (parallel::OptimizerStateSlice& slice : s.replica->optimizer_state_slices()) slices.push_back(std::move(slice));
  for (const parallel::OptimizerStateSlice& slice : slices) {
    io::TensorPiece piece = state_piece(slice);
    piece.local = *slice.local;
    piece.owner = slice.owner && (slice.parameter->shard.split || s.tp_rank == 0) && !slice.parameter->tied_copy;
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

io::CheckpointMetadata training_metadata(const TrainState& s, const Counters& k) {
  const TrainConfig& c = *s.config;
  io::CheckpointMetadata meta;
  for (const auto& [key, value] : settings(c)) meta["config." + key] = value;
  for (const ModelField& field : model_fields(*s.model, s.dtype)) meta[field.key] = field.value;
  meta["layout.world"] = std::to_string(s.world->size());
  meta["layout.dp"] = std::to_string(s.dp);
  meta["layout.tp"] = std::to_string(s.tp);
  meta["layout.pp"] = std::to_string(s.pp);
  meta["layout.cp"] = std::to_string(s.cp);
  meta["layout.ep"] = std::to_string(s.ep);
  meta["layout.virtual_stages"] = std::to_string(s.virtual_stages);
  meta["layout.zero"] = std::to_string(s.replica->zero_stage());
  meta["optimizer.kind"] = nn::optimizer_kind_name(s.replica->optimizer().config().kind);
  meta["optimizer.step_count"] = std::to_string(s.replica->optimizer().step_count());
  meta["schedule.iteration"] = std::to_string(k.step);
  meta["schedule.num_steps"] = std::to_string(k.updates);
  meta["schedule.style"] = nn::lr_style_name(s.schedule->style);
  meta["schedule.lr"] = shortest_text(s.schedule->lr);
  meta["schedule.min_lr"] = shortest_text(s.schedule->min_lr);
  meta["schedule.warmup_steps"] = std::to_string(s.schedule->warmup_steps);
  meta["schedule.total_steps"] = std::to_string(s.schedule->total_steps);
  meta["scaler.enabled"] = s.scaler->enabled() ? "true" : "false";
  meta["scaler.scale"] = shortest_text(s.scaler->scale());
  meta["scaler.growth_tracker"] = std::to_string(s.scaler->growth_tracker());
  if (const std::string run = s.tracking_run_id ? s.tracking_run_id() : ""; !run.empty()) {
    meta["tracking.mlflow_run_id"] = run;
    meta["tracking.mlflow_uri"] = c.mlflow_uri;
  }
  meta["sampler.epoch"] = std::to_string(k.sampler.epoch);
  meta["sampler.samples"] = std::to_string(k.sampler.samples);
  meta["sampler.global_micro_batch"] = std::to_string(s.global_micro_batch);
  meta["train.skipped_steps"] = std::to_string(k.skipped_steps);
  meta["train.consecutive_skips"] = std::to_string(k.consecutive_skips);
  meta["rng.kind"] = "philox4x32-10: (seed, stream, index); dropout streams by (step, micro-batch·dp + dp rank)";
  return meta;
}

io::SaveOptions training_save_options(const TrainState& s, const Counters& k) {
  const TrainConfig& c = *s.config;
  io::SaveOptions options;
  options.keep = c.keep_checkpoints;
  options.timeout_s = c.save_timeout;
  options.writers = c.ckpt_format == "gathered" ? io::CheckpointWriters::rank_zero : io::CheckpointWriters::every_rank;
  const std::string rng = "seed=" + std::to_string(c.seed) + " next_step=" + std::to_string(k.step) +
                          " dp_rank=" + std::to_string(s.dp_rank) + " dp_size=" + std::to_string(s.dp);
  options.rank_state["rng"] = std::vector<uint8_t>(rng.begin(), rng.end());
  return options;
}

}  // namespace

TrainingCheckpoints::TrainingCheckpoints(const TrainState& state, std::function<void(const std::string&)> say)
    : state_(state), say_(std::move(say)), saver_(*state.world) {}

void TrainingCheckpoints::save(const Counters& counters, bool final) {
  using Clock = std::chrono::steady_clock;
  const TrainConfig& c = *state_.config;
  if (saver_.pending()) publish();  // the previous save first (waiting for its writes if need be)
  keep_directory_locked();
  const auto start = Clock::now();
  // A final save goes the same way (host copy, background write) and is
  // published at once: every checkpoint of an --async-save run is written by
  // one mechanism.
  const bool async = c.async_save && c.ckpt_format != "gathered";
  const std::optional<io::PublishedCheckpoint> published =
      saver_.save(c.save, counters.step, training_pieces(state_), training_metadata(state_, counters),
                  training_save_options(state_, counters), async);
  const double stall = std::chrono::duration<double>(Clock::now() - start).count();
  if (published) {
    report(*published, stall, stall, false);
  } else {
    add_stall(stall);  // the loop's wait to start it, reported now; publishing it adds its own
    pending_stall_s_ = stall;
    if (final) publish();
  }
}

// Rank 0, before each save: a --save directory removed (or replaced) during
// the run no longer keeps another job out, so it is made again and locked
// again, with a warning; if another job has taken it meanwhile, the run stops
// rather than write into that job's checkpoints.
void TrainingCheckpoints::keep_directory_locked() {
  io::SaveDirectoryLock* lock = state_.save_lock;
  if (lock == nullptr || lock->still_in_place()) return;
  const std::string& dir = state_.config->save;
  say_("warning: --save " + dir +
       " was removed or replaced during the run; taking it again (checkpoints written there before are gone)");
  try {
    lock->take_again();
  } catch (const Error& taken) {
    TESSERA_THROW(taken.message(), " (it was removed during this run, and the job named took it since; this run ",
                  "stops without saving there)");
  }
}

void TrainingCheckpoints::publish() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const io::PublishedCheckpoint published = saver_.finish();
  const double stall = std::chrono::duration<double>(Clock::now() - start).count();
  report(published, stall, pending_stall_s_ + stall, true);
  pending_stall_s_ = 0.0;
}

void TrainingCheckpoints::add_stall(double seconds) {
  total_stall_ms_ += seconds * 1e3;
  add_figure("checkpoint_stall_ms", seconds * 1e3);
}

// `stall`: the loop's wait now; `save_stall`: the whole save's (an
// asynchronous one: starting it and publishing it), for the line.
void TrainingCheckpoints::report(const io::PublishedCheckpoint& published, double stall, double save_stall,
                                 bool background) {
  last_published_ = published.path;
  add_stall(stall);
  add_figure("checkpoint_write_s", published.write_seconds);
  add_figure("checkpoint_bytes", double(published.bytes));
  char line[160];
  if (!background)
    std::snprintf(line, sizeof line, " (%.3f s, %s from rank 0)", save_stall,
                  parallel::byte_text(published.bytes).c_str());
  else
    std::snprintf(line, sizeof line, " (written in %.3f s in the background; training waited %.1f ms; %s from rank 0)",
                  published.write_seconds, save_stall * 1e3, parallel::byte_text(published.bytes).c_str());
  if (say_) say_("checkpoint: " + published.path + line);
}

void TrainingCheckpoints::add_figure(const std::string& name, double value) {
  for (auto& [key, sum] : figures_)
    if (key == name) {
      sum += value;
      return;
    }
  figures_.emplace_back(name, value);
}

std::vector<std::pair<std::string, double>> TrainingCheckpoints::take_figures() {
  return std::exchange(figures_, {});
}

CheckpointCadence::CheckpointCadence(const TrainState& state, const Counters& counters, TrainResult& result,
                                     io::TraceWriter& trace, std::function<void(const std::string&)> say)
    : config_(*state.config),
      counters_(counters),
      result_(result),
      trace_(trace),
      checkpoints_(state, std::move(say)),
      root_(state.world->rank() == 0),
      last_save_(std::chrono::steady_clock::now()) {}

void CheckpointCadence::on_step_end(io::StepEnd& end) {
  for (const auto& figure : checkpoints_.take_figures()) end.record.extra.push_back(figure);
}

// Round 1: whether rank 0's clock says a --save-interval-minutes save is due,
// and whether this rank's background write still runs / failed.
void CheckpointCadence::boundary_flags(const io::BoundaryRound& round, std::vector<int32_t>& flags) {
  if (round.after_save) return;
  const double since_save = std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save_).count();
  const bool clock_due = config_.save_interval_minutes > 0 && since_save >= 60.0 * config_.save_interval_minutes;
  flags.push_back(root_ && clock_due ? 1 : 0);
  flags.push_back(checkpoints_.writing() ? 1 : 0);
  flags.push_back(checkpoints_.failed() ? 1 : 0);
}

void CheckpointCadence::on_boundary(const io::BoundaryRound& round, std::span<const int32_t> agreed,
                                    io::BoundaryDecision& decision) {
  if (round.after_save) return;
  const bool clock_due = agreed[0] != 0, writing = agreed[1] != 0, failed = agreed[2] != 0;
  // A background save every rank has written (or one that failed: the run stops here, naming it) is published.
  if (checkpoints_.pending() && (!writing || failed)) publish_pending();
  if (config_.save.empty()) return;
  if (clock_due || (config_.save_interval > 0 && round.step % config_.save_interval == 0)) decision.request_save();
}

void CheckpointCadence::on_save(io::Save& save) {
  if (config_.save.empty()) return;
  {
    auto scope = trace_.scope("checkpoint", "io");
    checkpoints_.save(counters_, save.final);
  }
  last_save_ = std::chrono::steady_clock::now();
  save.written = true;
  keep_result_current();
}

// Every rank stops here together: a background save is published first.
void CheckpointCadence::on_stop(const io::Stop&) {
  if (checkpoints_.pending()) publish_pending();
}

void CheckpointCadence::publish_pending() {
  checkpoints_.publish();
  keep_result_current();
}

void CheckpointCadence::keep_result_current() {
  result_.checkpoint = checkpoints_.last_published();
  result_.checkpoint_stall_ms = checkpoints_.total_stall_ms();
}

std::optional<std::string> checkpoint_to_resume(const TrainConfig& c) {
  if (c.resume.empty()) return std::nullopt;
  if (c.resume == "auto") {
    if (!fs::exists(c.save)) return std::nullopt;  // the first run of a job: a fresh start
    return io::find_latest_checkpoint(c.save);
  }
  TESSERA_CHECK(fs::exists(c.resume), "--resume ", c.resume,
                ": no such checkpoint; give a checkpoint directory (DIR/step_XXXXXXXX), a --save directory, or "
                "--resume auto");
  // A --save directory (step_* directories, `latest`): its newest checkpoint.
  if (fs::is_directory(c.resume))
    if (std::optional<std::string> latest = io::find_latest_checkpoint(c.resume)) return latest;
  return c.resume;
}

Resumed load_training_checkpoint(const TrainState& s, const std::string& path) {
  const TrainConfig& c = *s.config;
  io::CheckpointReader reader(path);
  const Metadata meta(reader.metadata(), path);

  // The same model, or a refusal naming what differs.
  for (const ModelField& field : model_fields(*s.model, s.dtype)) {
    std::optional<std::string> saved = meta.find(field.key);
    if (!saved && !field.absent.empty()) saved = field.absent;
    TESSERA_CHECK(saved.has_value(), "--resume: checkpoint ", path, " has no '", field.key,
                  "' entry; it was not written by `tessera train` of this version");
    TESSERA_CHECK(*saved == field.value, "--resume: checkpoint ", path, " holds another model: ", field.what, " is ",
                  field.value, " here but ", *saved, " in the checkpoint; resume with the checkpoint's settings ",
                  "(`tessera checkpoint inspect ", path, "` lists them) or start afresh with another --save directory");
  }
  const std::string saved_optimizer = meta.get("optimizer.kind");
  TESSERA_CHECK(saved_optimizer == c.optimizer, "--resume: checkpoint ", path, " holds the state of --optimizer ",
                saved_optimizer, ", this run uses --optimizer ", c.optimizer, "; resume with --optimizer ",
                saved_optimizer);
  TESSERA_CHECK(reader.step() == meta.integer("schedule.iteration"), "--resume: checkpoint ", path, " is for step ",
                reader.step(), " but records iteration ", meta.integer("schedule.iteration"), "; it is damaged");

  // Parameters whole on every rank (ZeRO-3: this rank's pieces); optimizer state as this rank's slices.
  const std::vector<parallel::OptimizerStateSlice> value_slices = s.replica->value_slices();
  for (nn::Parameter* p : s.parameters)
    TESSERA_CHECK(reader.has_tensor(p->name), "--resume: checkpoint ", path, " has no tensor '", p->name,
                  "' for the model's parameter of that name");
  if (value_slices.empty())
    for (nn::Parameter* p : s.parameters) read_into(reader, io::parameter_piece(*p), p->value);
  for (const parallel::OptimizerStateSlice& slice : value_slices) read_into(reader, state_piece(slice), *slice.local);
  for (const parallel::OptimizerStateSlice& slice : s.replica->optimizer_state_slices()) {
    TESSERA_CHECK(reader.has_tensor(slice.name), "--resume: checkpoint ", path, " has no optimizer state '", slice.name,
                  "'; it was saved with --optimizer ", saved_optimizer, " --sgd-momentum ",
                  meta.get("config.sgd-momentum"), " (resume with the same optimizer settings)");
    read_into(reader, state_piece(slice), *slice.local);
  }
  nn::Optimizer& optimizer = s.replica->optimizer();
  optimizer.set_step_count(meta.integer("optimizer.step_count"));
  optimizer.values_from_masters();  // the values are the masters' roundings (no-op for f32)
  s.replica->gather_values();       // ZeRO-1/2: every rank's pieces to every rank
  if (s.scaler->enabled()) s.scaler->load_state(meta.real("scaler.scale"), meta.integer("scaler.growth_tracker"));

  Resumed out;
  out.path = path;
  out.counters.step = reader.step();
  out.counters.sampler.epoch = meta.integer("sampler.epoch");
  out.counters.sampler.samples = meta.integer("sampler.samples");
  out.counters.skipped_steps = meta.integer("train.skipped_steps");
  out.counters.consecutive_skips = meta.integer("train.consecutive_skips");
  out.counters.updates = schedule_position(meta, out.counters, path);
  const int64_t saved_dp = meta.integer("layout.dp"), saved_zero = meta.integer("layout.zero");
  // Checkpoints from before interleaving have no layout.virtual_stages: one chunk per stage.
  const int64_t saved_chunks = meta.find("layout.virtual_stages") ? meta.integer("layout.virtual_stages") : 1;
  // Checkpoints from before context parallelism have no layout.cp: whole sequences.
  const int64_t saved_cp = meta.find("layout.cp") ? meta.integer("layout.cp") : 1;
  // ... and before expert parallelism no layout.ep: every expert on every rank.
  const int64_t saved_ep = meta.find("layout.ep") ? meta.integer("layout.ep") : 1;
  out.saved_layout = layout_text(saved_dp, meta.integer("layout.tp"), meta.integer("layout.pp"), saved_chunks,
                                 saved_zero, meta.integer("layout.world"), saved_cp, saved_ep);
  out.resharded = saved_dp != s.dp || saved_zero != s.replica->zero_stage() || meta.integer("layout.tp") != s.tp ||
                  meta.integer("layout.pp") != s.pp || saved_chunks != s.virtual_stages || saved_cp != s.cp ||
                  saved_ep != s.ep;
  if (const auto run = meta.find("tracking.mlflow_run_id")) out.mlflow_run_id = *run;
  if (const auto uri = meta.find("tracking.mlflow_uri")) out.mlflow_uri = *uri;
  for (const auto& [key, value] : settings(c)) {
    if (key == "resume") continue;
    const std::optional<std::string> saved = meta.find("config." + key);
    if (saved && *saved != value)
      out.changed_settings.push_back(key + " " + (saved->empty() ? "''" : *saved) + " -> " +
                                     (value.empty() ? "''" : value));
  }
  return out;
}

}  // namespace tessera::app
