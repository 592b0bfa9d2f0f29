// Checkpoints in training, in-process (a world of one): 2N straight steps
// against N steps, a new train() call with --resume auto and N more, compared
// bit for bit (parameters, optimizer state, counters) for the MLP in every
// precision, the GPT with dropout and gradient accumulation, and across
// --zero settings; refusal of another model or precision; --resume auto on an
// empty directory; a missing --resume path; flag validation; a step skipped
// for non-finite fp16 gradients, which leaves the learning-rate schedule where
// it was (Megatron's rule), in a straight run and across a resume; and a
// preemption signal stopping the run at a step boundary with a checkpoint,
// also when it arrives while a synchronous interval save is written.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "nn/lr_schedule.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// A tiny MLP on a 240-sample random image set: micro-batches of 8, two per
// step (accumulation), 15 steps per epoch, AdamW with warm-up, cosine decay,
// weight decay and clipping; seeded fresh each run.
app::TrainConfig mlp_config(const std::string& data, std::mt19937_64& rng) {
  app::TrainConfig c;
  c.model = nn::ModelKind::mlp;
  c.hidden = {24, 16};
  c.data = data;
  c.micro_batch_size = 8;
  c.global_batch_size = 16;
  c.optimizer = "adamw";
  c.lr = 3e-3f;
  c.min_lr = 1e-4f;
  c.warmup_steps = 3;
  c.weight_decay = 0.01f;
  c.clip_grad = 0.5f;
  c.seed = rng();
  c.threads = 1;
  return c;
}

// A tiny GPT with dropout on random text, two micro-batches per step.
app::TrainConfig gpt_config(const std::string& data, std::mt19937_64& rng) {
  app::TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.data = data;
  c.vocab_size = 256;
  c.seq_length = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.hidden_size = 32;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;  // masks drawn by (seed, step, micro-batch): a resume draws the straight run's
  c.micro_batch_size = 4;
  c.global_batch_size = 8;
  c.lr = 2e-3f;
  c.warmup_steps = 2;
  c.weight_decay = 0.1f;
  c.seed = rng();
  c.threads = 1;
  return c;
}

std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

// Trains `total` steps straight (saving at the end) and, separately, `half`
// steps (stopped by --exit-interval, with the same --train-steps so the
// schedule is the same) followed by a new train() call with --resume auto;
// expects identical final checkpoints and identical losses after the resume.
// `resumed_change` edits the resumed run's config (e.g. another --zero).
void expect_bit_exact_resume(const app::TrainConfig& base, int64_t total, int64_t half, const fs::path& dir,
                             const std::function<void(app::TrainConfig&)>& resumed_change = {}) {
  app::TrainConfig straight = base;
  straight.train_steps = total;
  straight.save = (dir / "straight").string();
  const app::TrainResult reference = app::train(straight);
  ASSERT_EQ(reference.final_step, total);
  ASSERT_EQ(fs::path(reference.checkpoint).filename().string(), step_name(total));

  app::TrainConfig first = base;
  first.train_steps = total;
  first.exit_interval = half;
  first.save = (dir / "split").string();
  first.resume = "auto";
  const app::TrainResult stopped = app::train(first);
  EXPECT_EQ(stopped.start_step, 0);
  EXPECT_EQ(stopped.final_step, half);
  EXPECT_EQ(stopped.stop_signal, 0);
  EXPECT_EQ(stopped.exit_code(), 0);
  ASSERT_FALSE(stopped.checkpoint.empty());

  app::TrainConfig second = first;
  second.exit_interval = 0;  // it would stop the resumed run at 2 x half
  if (resumed_change) resumed_change(second);
  const app::TrainResult resumed = app::train(second);
  EXPECT_EQ(resumed.resumed_from, stopped.checkpoint);
  EXPECT_EQ(resumed.start_step, half);
  EXPECT_EQ(resumed.final_step, total);
  EXPECT_EQ(resumed.steps, total - half);

  EXPECT_TRUE(checkpoints_identical(reference.checkpoint, resumed.checkpoint));
  // The losses after the resume are those of the straight run, bit for bit.
  ASSERT_EQ(resumed.losses.size(), size_t(total - half));
  for (int64_t i = 0; i < total - half; ++i)
    EXPECT_EQ(resumed.losses[size_t(i)], reference.losses[size_t(half + i)]) << "step " << half + i + 1;
  // So were the losses before it.
  ASSERT_EQ(stopped.losses.size(), size_t(half));
  for (int64_t i = 0; i < half; ++i) EXPECT_EQ(stopped.losses[size_t(i)], reference.losses[size_t(i)]);
}

class ResumeMlp : public ::testing::TestWithParam<const char*> {};

// Steps 1-7 stop mid-epoch (sample 224 of 240 is not reached: 7 x 16 = 112),
// and the resumed run crosses into epoch 1 at step 16.
TEST_P(ResumeMlp, StraightAndResumedRunsAreBitIdentical) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  app::TrainConfig c = mlp_config(write_image_dataset(dir.path, 240, 6, 5, 4, rng), rng);
  c.precision = GetParam();
  expect_bit_exact_resume(c, 18, 7, dir.path);
}

INSTANTIATE_TEST_SUITE_P(Precisions, ResumeMlp, ::testing::Values("fp32", "bf16", "fp16"));

// Each logged step's learning rate is that of the schedule the run recorded
// in `checkpoint` (schedule.*) at the number of successful updates before
// it; returns how many steps were skipped.
int64_t expect_schedule_read_at_updates(const std::string& metrics, const std::string& checkpoint, int64_t total) {
  const io::CheckpointMetadata meta = io::CheckpointReader(checkpoint).metadata();
  const auto real = [&](const char* key) { return std::stod(meta.at(key)); };
  const auto integer = [&](const char* key) { return std::stoll(meta.at(key)); };
  const nn::LrSchedule schedule({.style = nn::parse_lr_style(meta.at("schedule.style")),
                                 .lr = real("schedule.lr"),
                                 .min_lr = real("schedule.min_lr"),
                                 .warmup_steps = integer("schedule.warmup_steps"),
                                 .total_steps = integer("schedule.total_steps")});
  const std::vector<io::StepRecord> steps = io::read_metrics(metrics).steps;
  EXPECT_EQ(int64_t(steps.size()), total) << metrics;
  int64_t updates = 0, skipped = 0;
  for (const io::StepRecord& record : steps) {
    EXPECT_EQ(record.lr, schedule.lr(updates)) << "step " << record.step << " after " << updates << " updates";
    ++(record.skipped ? skipped : updates);
  }
  return skipped;
}

// Removes a metadata entry from a checkpoint's index, as one written before
// that entry existed lacks it.
void remove_metadata_entry(const fs::path& checkpoint, const char* key) {
  const std::string index = (checkpoint / "checkpoint.h5").string();
  const hid_t file = H5Fopen(index.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(file, 0) << index;
  const hid_t group = H5Gopen2(file, "metadata", H5P_DEFAULT);
  EXPECT_GE(group, 0) << index;
  EXPECT_GE(H5Adelete(group, key), 0) << key << " in " << index;
  H5Gclose(group);
  H5Fclose(file);
}

// fp16 with step 3's gradients NaN (TESSERA_FAULT=nan_grad@3): the step is
// skipped and the loss scale backs off, but the learning-rate schedule stays
// where it was (Megatron's scheduler steps only after a successful update),
// so step 4 gets the learning rate step 3 would have had. Stopped after step
// 5 and resumed, the run is bit-identical to the straight one and its
// learning rates keep the rule; so is a resume from that checkpoint without
// schedule.num_steps (one written before it was saved: step − skipped steps).
TEST(ResumeSkippedStep, ScheduleAdvancesOnlyOnSuccessfulUpdates) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  app::TrainConfig c = mlp_config(write_image_dataset(dir.path, 240, 6, 5, 4, rng), rng);
  c.precision = "fp16";
  c.train_steps = 10;
  const FaultEnvironment fault("nan_grad@3");

  app::TrainConfig straight = c;
  straight.save = (dir.path / "straight").string();
  straight.metrics = (dir.path / "straight.jsonl").string();
  const app::TrainResult reference = app::train(straight);
  ASSERT_EQ(reference.final_step, 10);
  EXPECT_GE(reference.skipped_steps, 1);
  EXPECT_EQ(expect_schedule_read_at_updates(straight.metrics, reference.checkpoint, 10), reference.skipped_steps);
  const std::vector<io::StepRecord> steps = io::read_metrics(straight.metrics).steps;
  ASSERT_EQ(steps.size(), 10u);
  EXPECT_TRUE(steps[2].skipped);
  EXPECT_EQ(steps[3].lr, steps[2].lr);  // the skipped step's learning rate again
  EXPECT_EQ(steps[0].lr, 0.0);          // warm-up: the first update at 0, as Megatron's

  app::TrainConfig first = straight;
  first.save = (dir.path / "split").string();
  first.metrics = (dir.path / "split.jsonl").string();
  first.resume = "auto";
  first.exit_interval = 5;
  const app::TrainResult stopped = app::train(first);
  ASSERT_EQ(stopped.final_step, 5);
  app::TrainConfig second = first;
  second.exit_interval = 0;
  const app::TrainResult resumed = app::train(second);
  EXPECT_EQ(resumed.start_step, 5);
  EXPECT_TRUE(checkpoints_identical(reference.checkpoint, resumed.checkpoint));
  expect_schedule_read_at_updates(first.metrics, resumed.checkpoint, 10);  // the resumed run appended its steps
  EXPECT_EQ(io::CheckpointReader(stopped.checkpoint).metadata().at("schedule.num_steps"),
            std::to_string(5 - reference.skipped_steps));

  const fs::path old_style = dir.path / "old_style";
  fs::copy(stopped.checkpoint, old_style, fs::copy_options::recursive);
  remove_metadata_entry(old_style, "schedule.num_steps");
  ASSERT_FALSE(io::CheckpointReader(old_style.string()).metadata().contains("schedule.num_steps"));
  app::TrainConfig from_old = straight;
  from_old.save = (dir.path / "from_old").string();
  from_old.metrics = "";
  from_old.resume = old_style.string();
  const app::TrainResult resumed_old = app::train(from_old);
  EXPECT_EQ(resumed_old.start_step, 5);
  EXPECT_TRUE(checkpoints_identical(reference.checkpoint, resumed_old.checkpoint));
}

TEST(Resume, GptWithDropoutAndAccumulationIsBitIdentical) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  const app::TrainConfig c = gpt_config(write_text_dataset(dir.path, 3000, rng), rng);
  expect_bit_exact_resume(c, 10, 5, dir.path);
}

void expect_train_error(const app::TrainConfig& c, const std::vector<std::string>& fragments) {
  try {
    app::train(c);
    ADD_FAILURE() << "no error; expected one mentioning '" << fragments.front() << "'";
  } catch (const Error& error) {
    for (const std::string& fragment : fragments)
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
          << "'" << fragment << "' missing from: " << error.what();
  }
}

// --zero at one data-parallel rank only adds memory, so it is refused (a
// resume from ZeRO-1 pieces onto one rank, and back, is the 2-rank
// Resharding.SavedUnderTwoRanksZeroResumedOnOneAndTheReverse, tests/multiprocess).
TEST(Resume, ZeroOnOneRankIsRefusedWithTheReason) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  app::TrainConfig c = mlp_config(write_image_dataset(dir.path, 240, 6, 5, 4, rng), rng);
  c.train_steps = 2;
  for (const int zero : {1, 2, 3}) {
    c.zero = zero;
    expect_train_error(c, {"--zero " + std::to_string(zero) + " shards", "this layout has one",
                           "it would only add memory; drop --zero"});
  }
}

app::TrainConfig synthetic_gpt(const std::string& save) {
  app::TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.synthetic = true;
  c.vocab_size = 29;
  c.seq_length = 8;
  c.num_layers = 1;
  c.num_heads = 2;
  c.hidden_size = 16;
  c.micro_batch_size = 2;
  c.train_steps = 2;
  c.threads = 1;
  c.save = save;
  c.resume = "auto";
  return c;
}

TEST(Resume, AnotherModelOrPrecisionIsRefusedNamingTheFlagAndBothValues) {
  ScratchDirectory dir("tessera_resume_");
  const app::TrainConfig saved = synthetic_gpt(dir / "run");
  ASSERT_EQ(app::train(saved).final_step, 2);
  const std::string checkpoint = dir / "run/step_00000002";

  app::TrainConfig wider = saved;
  wider.hidden_size = 24;
  wider.train_steps = 4;
  expect_train_error(wider, {"--hidden-size", "24", "16", checkpoint});
  app::TrainConfig deeper = saved;
  deeper.num_layers = 3;
  deeper.train_steps = 4;
  expect_train_error(deeper, {"--num-layers", "3", "1"});
  app::TrainConfig other = saved;
  other.model = nn::ModelKind::mlp;
  other.train_steps = 4;
  expect_train_error(other, {"--model", "mlp", "gpt"});
  app::TrainConfig half = saved;
  half.precision = "bf16";
  half.train_steps = 4;
  expect_train_error(half, {"--precision", "bf16", "f32"});
  app::TrainConfig sgd = saved;
  sgd.optimizer = "sgd";
  sgd.train_steps = 4;
  expect_train_error(sgd, {"--optimizer", "adamw", "sgd"});

  // The same model with other training settings resumes (and says what changed).
  app::TrainConfig longer = saved;
  longer.train_steps = 3;
  longer.lr = 5e-4f;
  const app::TrainResult resumed = app::train(longer);
  EXPECT_EQ(resumed.start_step, 2);
  EXPECT_EQ(resumed.final_step, 3);
}

TEST(Resume, MlpOfOtherWidthIsRefused) {
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  app::TrainConfig c = mlp_config(write_image_dataset(dir.path, 64, 4, 4, 3, rng), rng);
  c.train_steps = 1;
  c.warmup_steps = 0;
  c.save = dir / "run";
  app::train(c);
  c.hidden = {24, 17};
  c.resume = "auto";
  c.train_steps = 2;
  expect_train_error(c, {"--hidden", "24,17", "24,16"});
}

TEST(Resume, AutoWithoutCheckpointStartsFresh) {
  ScratchDirectory dir("tessera_resume_");
  for (const std::string& save : {dir / "not_yet_made", dir.path.string()}) {
    SCOPED_TRACE(save);
    app::TrainConfig c = synthetic_gpt(save);
    c.train_steps = 3;
    c.save_interval = 2;
    c.keep_checkpoints = 1;
    const app::TrainResult result = app::train(c);
    EXPECT_EQ(result.start_step, 0);
    EXPECT_TRUE(result.resumed_from.empty());
    EXPECT_EQ(result.steps, 3);
    EXPECT_EQ(fs::path(result.checkpoint).filename().string(), step_name(3));
    EXPECT_EQ(io::find_latest_checkpoint(save), result.checkpoint);
    EXPECT_FALSE(fs::exists(save + "/step_00000002")) << "--keep-checkpoints 1 keeps only the newest";
    // Done already: resuming runs no step and writes nothing new.
    const app::TrainResult again = app::train(c);
    EXPECT_EQ(again.start_step, 3);
    EXPECT_EQ(again.steps, 0);
    EXPECT_TRUE(again.checkpoint.empty());
    fs::remove_all(save);
  }
}

TEST(Resume, PathOfAnotherRunOrCheckpointResumes) {
  ScratchDirectory dir("tessera_resume_");
  app::TrainConfig c = synthetic_gpt(dir / "first");
  c.save_interval = 1;
  app::train(c);
  // A checkpoint directory, or a --save directory (its newest checkpoint).
  for (const std::string& path : {dir / "first/step_00000001", dir / "first"}) {
    SCOPED_TRACE(path);
    app::TrainConfig next = c;
    next.save = dir / "second";
    next.resume = path;
    next.train_steps = 3;
    const app::TrainResult result = app::train(next);
    EXPECT_EQ(result.start_step, path.ends_with("1") ? 1 : 2);
    EXPECT_EQ(result.final_step, 3);
    fs::remove_all(next.save);
  }
}

TEST(Resume, MissingPathAndBadFlagsAreNamed) {
  ScratchDirectory dir("tessera_resume_");
  app::TrainConfig missing = synthetic_gpt(dir / "run");
  missing.resume = dir / "nope/step_00000007";
  expect_train_error(missing, {"--resume", missing.resume, "no such checkpoint"});

  app::TrainConfig auto_without_save = synthetic_gpt("");
  expect_train_error(auto_without_save, {"--resume auto", "--save"});
  app::TrainConfig interval_without_save = synthetic_gpt("");
  interval_without_save.resume.clear();
  interval_without_save.save_interval = 5;
  expect_train_error(interval_without_save, {"--save-interval", "--save DIR"});
  app::TrainConfig negative = synthetic_gpt(dir / "run");
  negative.keep_checkpoints = -1;
  expect_train_error(negative, {"--keep-checkpoints", "-1"});
  app::TrainConfig negative_exit = synthetic_gpt(dir / "run");
  negative_exit.exit_interval = -2;
  expect_train_error(negative_exit, {"--exit-interval", "-2"});
  app::TrainConfig all_dropped = synthetic_gpt(dir / "run");
  all_dropped.attention_dropout = 1.0f;
  expect_train_error(all_dropped, {"--attention-dropout must be in [0, 1), got 1"});

  // Not a checkpoint at all.
  const std::string junk = dir / "junk";
  fs::create_directories(junk);
  std::ofstream(junk + "/checkpoint.h5") << "not HDF5";
  app::TrainConfig bad = synthetic_gpt(dir / "run");
  bad.resume = junk;
  expect_train_error(bad, {junk});
}

// Every flag of `tessera train` is one key of the settings a checkpoint records.
TEST(Resume, SettingsRecordEveryFlag) {
  app::TrainConfig c;
  CLI::App command;
  app::add_train_options(command, c);
  const auto settings = app::settings(c);
  std::set<std::string> keys;
  for (const auto& [key, value] : settings) EXPECT_TRUE(keys.insert(key).second) << "duplicate key " << key;
  size_t flags = 0;
  for (const CLI::Option* option : command.get_options()) {
    if (option->get_lnames().empty()) continue;  // --help
    const std::string name = option->get_lnames().front();
    if (name == "help") continue;
    ++flags;
    EXPECT_TRUE(keys.count(name)) << "--" << name << " is not recorded in checkpoints (app::settings)";
  }
  EXPECT_EQ(flags, keys.size());
}

// Polls `metrics` until it has `lines` step records (or a deadline passes).
bool wait_for_steps(const std::string& metrics, int lines, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(metrics);
    int count = 0;
    for (std::string line; std::getline(in, line);) count += line.find("\"step\"") != std::string::npos;
    if (count >= lines) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// train(c) while `send` runs on a thread of its own (it sends SIGUSR1 when
// it sees fit). SIGUSR1 is ignored around the call, so a signal arriving late
// can do no harm, and the previous handler comes back after it;
// `kept_ignoring` says whether train() had put back the handler it found.
app::TrainResult train_while(const app::TrainConfig& c, const std::function<void()>& send,
                             bool* kept_ignoring = nullptr) {
  struct sigaction ignore {
  }, before{}, after{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  EXPECT_EQ(sigaction(SIGUSR1, &ignore, &before), 0);
  std::thread sender(send);
  app::TrainResult result;
  try {
    result = app::train(c);
  } catch (...) {
    sender.join();
    sigaction(SIGUSR1, &before, nullptr);
    throw;
  }
  sender.join();
  sigaction(SIGUSR1, &before, &after);
  if (kept_ignoring) *kept_ignoring = after.sa_handler == SIG_IGN;
  return result;
}

// A run that a signal stops long before its last step, saving into DIR/run
// (the LR is constant, so a resumed run may ask for another --train-steps).
app::TrainConfig run_to_stop(const ScratchDirectory& dir, std::mt19937_64& rng) {
  app::TrainConfig c = mlp_config(write_image_dataset(dir.path, 240, 6, 5, 4, rng), rng);
  c.lr_decay_style = "constant";
  c.train_steps = 100000;
  c.save = dir / "run";
  return c;
}

// A process-directed SIGUSR1 while train() runs: the run stops at the next
// step boundary with a checkpoint of that step, returns normally, and puts
// the previous handler back; resuming continues from that step exactly (the
// LR is constant, so --train-steps may differ between the runs). SIGUSR1 is
// ignored around the test, so a signal arriving late can do no harm.
TEST(Preemption, SignalStopsAtAStepBoundaryWithACheckpointAndResumes) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  app::TrainConfig c = run_to_stop(dir, rng);
  c.resume = "auto";
  c.metrics = dir / "metrics.jsonl";
  std::atomic<bool> sent{false};
  bool kept_ignoring = false;
  const app::TrainResult stopped = train_while(
      c,
      [&] {
        if (wait_for_steps(c.metrics, 3, std::chrono::seconds(60))) {
          sent = true;
          ::kill(::getpid(), SIGUSR1);
        }
      },
      &kept_ignoring);
  EXPECT_TRUE(kept_ignoring) << "train() did not put the previous SIGUSR1 handler back";
  ASSERT_TRUE(sent);
  EXPECT_EQ(stopped.stop_signal, SIGUSR1);
  EXPECT_EQ(stopped.exit_code(), 0);
  ASSERT_GE(stopped.final_step, 3);
  EXPECT_LT(stopped.final_step, 100000);
  EXPECT_EQ(fs::path(stopped.checkpoint).filename().string(), step_name(stopped.final_step));
  EXPECT_TRUE(io::CheckpointReader(stopped.checkpoint).verify().empty());

  // Resume for two more steps, and compare with a straight run of as many.
  const int64_t total = stopped.final_step + 2;
  app::TrainConfig resumed_config = c;
  resumed_config.train_steps = total;
  resumed_config.metrics.clear();
  const app::TrainResult resumed = app::train(resumed_config);
  EXPECT_EQ(resumed.start_step, stopped.final_step);
  EXPECT_EQ(resumed.steps, 2);
  EXPECT_EQ(resumed.stop_signal, 0);
  app::TrainConfig straight = resumed_config;
  straight.save = dir / "straight";
  const app::TrainResult reference = app::train(straight);
  EXPECT_TRUE(checkpoints_identical(reference.checkpoint, resumed.checkpoint));

  // Without --save: the run stops all the same, saves nothing, and asks for
  // a non-zero exit status (128 + the signal).
  app::TrainConfig unsaved = c;
  unsaved.save.clear();
  unsaved.resume.clear();
  unsaved.metrics = dir / "unsaved.jsonl";
  const app::TrainResult unsaved_result = train_while(unsaved, [&] {
    if (wait_for_steps(unsaved.metrics, 2, std::chrono::seconds(60))) ::kill(::getpid(), SIGUSR1);
  });
  EXPECT_EQ(unsaved_result.stop_signal, SIGUSR1);
  EXPECT_TRUE(unsaved_result.checkpoint.empty());
  EXPECT_EQ(unsaved_result.exit_code(), 128 + SIGUSR1);
}

// SIGUSR1 while the checkpoint of a --save-interval step is written
// synchronously (--no-async-save; TESSERA_FAULT=slow_checkpoint@2 makes that
// save take 6 s longer, and the signal is sent once its temporary directory
// exists): the run stops at that step, with that checkpoint, and returns
// normally. Before, the stop asked for a background save to be published
// where there was none, and the run failed ("no asynchronous save is pending").
TEST(Preemption, SignalDuringASynchronousIntervalSaveStopsWithThatCheckpoint) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_resume_");
  std::mt19937_64 rng = make_rng();
  app::TrainConfig c = run_to_stop(dir, rng);
  c.save_interval = 2;
  c.async_save = false;
  const FaultEnvironment fault("slow_checkpoint@2");
  std::atomic<bool> sent{false};
  const app::TrainResult stopped = train_while(c, [&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      if (fs::exists(c.save + "/.step_00000002.tmp")) {
        sent = true;
        ::kill(::getpid(), SIGUSR1);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  ASSERT_TRUE(sent) << "the step-2 save was never seen in progress; the test proves nothing";
  EXPECT_EQ(stopped.stop_signal, SIGUSR1);
  EXPECT_EQ(stopped.exit_code(), 0);
  EXPECT_EQ(stopped.final_step, 2) << "the checkpoint written when the signal came serves";
  EXPECT_EQ(fs::path(stopped.checkpoint).filename().string(), step_name(2));
  EXPECT_TRUE(io::CheckpointReader(stopped.checkpoint).verify().empty());
}

}  // namespace
}  // namespace tessera::testing
