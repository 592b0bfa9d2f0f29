// Checkpoints with real processes: the `tessera` program under mpiexec,
// stopped and started again as a scheduler would. Bit-exact resume on two
// data-parallel ranks (plain and ZeRO-1, the GPT with dropout and gradient
// accumulation); resharding (saved under dp=2 ZeRO-1, resumed on one rank,
// and the reverse) continuing the loss curve of a run that never changed
// layout; SIGTERM to one rank of a two-rank job (a checkpoint, every rank
// exits 0, resuming continues from that step bit for bit); and a second
// signal while that checkpoint is being written. With model parallelism:
// bit-exact resume under dp = 2 × tp = 2 (ZeRO-1 over the shards) and
// tp = 2 × pp = 2, resharding from tp = 2 × pp = 2 and dp = 2 × tp = 2 to one
// rank and back, and dp × tp × pp on eight ranks against one; dropout on the
// attention probabilities under tensor parallelism against one rank.
//
// Every process is spawned in its own process group and waited for with a
// deadline, after which the whole group is killed, so nothing can hang the
// suite. The binary paths come from CMake (TESSERA_BINARY, TESSERA_MPIEXEC).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "io/checkpoint.h"
#include "io/metrics.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// The GPT with dropout: 2 ranks x 2 micro-batches of 4 per step.
std::vector<std::string> gpt_args(const std::string& data, uint64_t seed) {
  return joined(words("--model gpt --vocab-size 256 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 "
                      "--hidden-dropout 0.1 --micro-batch-size 4 --global-batch-size 16 --lr 2e-3 --warmup-steps 2 "
                      "--weight-decay 0.1 --threads 1 --bucket-size-mb 0.01"),
                {"--data", data, "--seed", std::to_string(seed)});
}

// The MLP on random images: 32 samples per step, as 2 ranks x 16 or 1 rank x 2 x 16.
std::vector<std::string> mlp_args(const std::string& data, uint64_t seed, const std::string& hidden = "24,16") {
  return joined(words("--model mlp --micro-batch-size 16 --global-batch-size 32 --lr 3e-3 --warmup-steps 2 "
                      "--weight-decay 0.01 --threads 1 --bucket-size-mb 0.01"),
                {"--hidden", hidden, "--data", data, "--seed", std::to_string(seed)});
}

// `args` without `flag` and its value.
std::vector<std::string> without(const std::vector<std::string>& args, const std::string& flag) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag) {
      ++i;
      continue;
    }
    out.push_back(args[i]);
  }
  return out;
}

// `args` without --bucket-size-mb when they ask for --zero 2 or 3 (which
// reduce per unit and refuse a bucket size given for nothing).
std::vector<std::string> fit_zero(const std::vector<std::string>& args) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--zero" && (args[i + 1] == "2" || args[i + 1] == "3")) return without(args, "--bucket-size-mb");
  return args;
}

// --zero stage and how checkpoints are written: sharded and asynchronous
// (the default), sharded and synchronous, gathered to rank 0.
class ResumeOnTwoRanks : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

// 8 straight steps against 4 steps (--exit-interval 4), new processes with
// --resume auto, and 4 more: the final checkpoints are identical.
TEST_P(ResumeOnTwoRanks, StraightAndResumedRunsAreBitIdentical) {
  TESSERA_SEED_TRACE();
  const std::string zero = std::to_string(std::get<0>(GetParam()));
  const std::vector<std::string> writing = words(std::get<1>(GetParam()));
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args =
      fit_zero(joined(joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()), {"--zero", zero}), writing));
  run_training(2, joined(args, {"--train-steps", "8", "--save", dir / "straight"}), dir / "straight.log");
  const auto split = joined(args, {"--train-steps", "8", "--save", dir / "split", "--resume", "auto"});
  const std::string first = run_training(2, joined(split, {"--exit-interval", "4"}), dir / "first.log");
  EXPECT_TRUE(contains(first, "--exit-interval 4 reached at step 4")) << first;
  const std::string second = run_training(2, split, dir / "second.log");
  EXPECT_TRUE(contains(second, "resumed from " + (dir / "split/") + step_name(4))) << second;
  EXPECT_FALSE(contains(second, "resharding")) << second;
  EXPECT_TRUE(checkpoints_identical(dir / ("straight/" + step_name(8)), dir / ("split/" + step_name(8))));
  const io::CheckpointReader reader(dir / ("split/" + step_name(8)));
  EXPECT_EQ(reader.metadata().at("layout.dp"), "2");
  EXPECT_EQ(reader.metadata().at("layout.zero"), zero);
  EXPECT_EQ(reader.ranks_saved(), 2);
}

INSTANTIATE_TEST_SUITE_P(Zero, ResumeOnTwoRanks,
                         ::testing::Combine(::testing::Values(0, 1, 2, 3),
                                            ::testing::Values("--async-save", "--no-async-save",
                                                              "--ckpt-format gathered")),
                         [](const ::testing::TestParamInfo<std::tuple<int, std::string>>& param) {
                           const std::string& writing = std::get<1>(param.param);
                           return "zero" + std::to_string(std::get<0>(param.param)) +
                                  (writing == "--async-save"      ? "_async"
                                   : writing == "--no-async-save" ? "_sync"
                                                                  : "_gathered");
                         });

// The losses of steps from..to of a metrics file.
std::vector<double> losses(const std::string& metrics, int64_t from, int64_t to) {
  std::vector<double> out;
  for (const io::StepRecord& record : io::read_metrics(metrics).steps)
    if (record.step >= from && record.step <= to) out.push_back(record.loss);
  return out;
}

// A checkpoint saved under one layout and resumed under another.
struct LayoutChange {
  const char* name;
  int first_ranks, second_ranks;
  std::vector<std::string> first_layout, second_layout;
  std::string saved_under;  // what the resumed run must say: "resharding: the checkpoint was saved under <this>"
};

// Trains `args` for `steps` steps under the first layout (the reference),
// again under it stopping at `stop`, then resumes under the second: each
// rank reads its own slices, and the next losses are those of the run that
// kept its layout, to f32 rounding (the gradient sums run in another order).
void expect_resumed_losses_continue(const ScratchDirectory& dir, const std::vector<std::string>& args, int steps,
                                    int stop, const LayoutChange& c) {
  SCOPED_TRACE(c.name);
  std::string name = c.name;  // one directory per case
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  const auto run = joined(args, {"--train-steps", std::to_string(steps)});
  run_training(c.first_ranks, joined(joined(run, c.first_layout), {"--metrics", dir / (name + "_reference.jsonl")}),
               dir / (name + "_reference.log"));
  const auto saving = joined(run, {"--save", dir / name, "--resume", "auto"});
  run_training(c.first_ranks, joined(joined(saving, c.first_layout), {"--exit-interval", std::to_string(stop)}),
               dir / (name + "_first.log"));
  const std::string output =
      run_training(c.second_ranks, joined(joined(saving, c.second_layout), {"--metrics", dir / (name + ".jsonl")}),
                   dir / (name + "_second.log"));
  EXPECT_TRUE(contains(output, "resharding: the checkpoint was saved under " + c.saved_under)) << output;
  const std::vector<double> expected = losses(dir / (name + "_reference.jsonl"), stop + 1, steps);
  const std::vector<double> actual = losses(dir / (name + ".jsonl"), stop + 1, steps);
  ASSERT_EQ(expected.size(), size_t(steps - stop));
  EXPECT_TRUE(all_close(actual, expected, Tolerance{1e-5, 1e-4}));
}

TEST(Resharding, SavedUnderTwoRanksZeroResumedOnOneAndTheReverse) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = mlp_args(write_image_dataset(dir.path, 512, 6, 5, 4, rng), rng());
  expect_resumed_losses_continue(dir, args, 10, 5, {"dp=2 zero=1 -> 1 rank", 2, 1, {"--zero", "1"}, {}, "dp=2"});
  expect_resumed_losses_continue(dir, args, 10, 5, {"1 rank -> dp=2 zero=1", 1, 2, {}, {"--zero", "1"}, "dp=1"});
}

// Four ranks of model parallelism (the GPT with dropout and accumulation):
// dp = 2 × tp = 2 with ZeRO-1 over the tensor-parallel shards, and tp = 2 ×
// pp = 2 (the tied embedding on the first and last stage). 8 straight steps
// against 4, new processes with --resume auto, and 4 more: identical final
// checkpoints, which hold the logical tensors whole.
class ResumeModelParallel : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(ResumeModelParallel, StraightAndResumedRunsAreBitIdentical) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = fit_zero(joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()), GetParam()));
  run_training(4, joined(args, {"--train-steps", "8", "--save", dir / "straight"}), dir / "straight.log");
  const auto split = joined(args, {"--train-steps", "8", "--save", dir / "split", "--resume", "auto"});
  run_training(4, joined(split, {"--exit-interval", "4"}), dir / "first.log");
  const std::string second = run_training(4, split, dir / "second.log");
  EXPECT_TRUE(contains(second, "resumed from " + (dir / "split/") + step_name(4))) << second;
  EXPECT_FALSE(contains(second, "resharding")) << second;
  EXPECT_TRUE(checkpoints_identical(dir / ("straight/" + step_name(8)), dir / ("split/" + step_name(8))));
  const io::CheckpointReader reader(dir / ("split/" + step_name(8)));
  EXPECT_EQ(reader.metadata().at("layout.tp"), "2");
  EXPECT_TRUE(reader.has_tensor("wte.weight.exp_avg"));
  bool found = false;
  for (const io::StoredTensor& t : reader.tensors())
    if (t.name == "blocks.0.attn.qkv.weight") {
      found = true;
      EXPECT_EQ(t.shape, Shape({96, 32}));
    }
  EXPECT_TRUE(found);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ResumeModelParallel,
                         // (tp 2 x pp 2 on 4 ranks has one data-parallel rank: --zero is refused there)
                         ::testing::Values(std::vector<std::string>{"--tp", "2", "--zero", "1"},
                                           std::vector<std::string>{"--tp", "2", "--pp", "2"},
                                           std::vector<std::string>{"--tp", "2", "--zero", "3"}));

// Saved under tp = 2 × pp = 2 and under dp = 2 × tp = 2 (four ranks),
// resumed on one rank, and the reverse (into sequence parallelism): the next
// losses are those of a run that kept its layout.
TEST(Resharding, SavedUnderTpTwoPpTwoOrDpTwoTpTwoResumedOnOneRankAndTheReverse) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = gpt_args(write_text_dataset(dir.path, 4000, rng), rng());
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"tp=2 pp=2 -> 1 rank", 4, 1, {"--tp", "2", "--pp", "2"}, {}, "dp=1 tp=2 pp=2"});
  expect_resumed_losses_continue(dir, args, 8, 4, {"dp=2 tp=2 -> 1 rank", 4, 1, {"--tp", "2"}, {}, "dp=2 tp=2"});
  expect_resumed_losses_continue(
      dir, args, 8, 4,
      {"1 rank -> dp=2 tp=2 sequence-parallel", 1, 4, {}, {"--tp", "2", "--sequence-parallel"}, "dp=1 tp=1"});
}

// ZeRO-2 and ZeRO-3 through `tessera train` on four ranks (the GPT with
// dropout and 2 micro-batches a step per replica): the losses of plain data
// parallelism under the same layout, over dp = 2 x tp = 2 (shards of shards),
// dp = 2 x pp = 2 (each stage's units; the tied embedding reduced after its
// two copies are summed), with recomputation and in bf16.
TEST(Zero, ShardedStagesEqualPlainDataParallelUnderModelParallelism) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = without(joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()),
                                   {"--train-steps", "6", "--clip-grad", "0.5"}),
                            "--bucket-size-mb");
  const std::vector<std::vector<std::string>> layouts = {{"--tp", "2"},
                                                         {"--pp", "2"},
                                                         {"--pp", "2", "--recompute"},
                                                         {"--tp", "2", "--precision", "bf16"}};
  int run = 0;
  for (const std::vector<std::string>& layout : layouts) {
    std::string flags;
    for (const std::string& word : layout) flags += " " + word;
    SCOPED_TRACE("layout" + flags);
    const std::string plain = dir / ("plain" + std::to_string(run) + ".jsonl");
    run_training(4, joined(joined(args, layout), {"--metrics", plain}),
                 dir / ("plain" + std::to_string(run) + ".log"));
    const std::vector<double> expected = losses(plain, 1, 6);
    ASSERT_EQ(expected.size(), 6u);
    for (const char* zero : {"2", "3"}) {
      const std::string name = "zero" + std::string(zero) + "_" + std::to_string(run);
      const std::string output = run_training(
          4, joined(joined(args, layout), {"--zero", zero, "--metrics", dir / (name + ".jsonl")}), dir / (name + ".log"));
      EXPECT_TRUE(contains(output, "zero=" + std::string(zero) + " units=")) << output;
      // Per-micro-batch reductions sum in another order than plain DP's (bf16: of bf16 gradients).
      const Tolerance tolerance = contains(output, "bf16") ? Tolerance{1e-3, 1e-3} : Tolerance{1e-5, 1e-5};
      EXPECT_TRUE(all_close(losses(dir / (name + ".jsonl"), 1, 6), expected, tolerance))
          << "--zero " << zero << flags;
    }
    ++run;
  }
}

// A checkpoint's way through three layouts: written by ZeRO-3 on four
// data-parallel ranks, resumed on one rank without ZeRO, which writes one
// resumed by ZeRO-2 on two ranks: each rank reads its own slices every time,
// and the losses are those of a run that never changed layout.
TEST(Zero, ZeroThreeOnFourRanksToOneRankToZeroTwoOnTwoContinuesTheLossCurve) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args =
      without(joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()), {"--train-steps", "12"}), "--bucket-size-mb");
  run_training(4, joined(args, {"--zero", "3", "--metrics", dir / "reference.jsonl"}), dir / "reference.log");
  const auto saving = joined(args, {"--save", dir / "run", "--resume", "auto"});
  run_training(4, joined(saving, {"--zero", "3", "--exit-interval", "4"}), dir / "first.log");
  const io::CheckpointReader first(dir / ("run/" + step_name(4)));
  EXPECT_EQ(first.metadata().at("layout.zero"), "3");
  EXPECT_EQ(first.ranks_saved(), 4);
  const std::string second = run_training(
      1, joined(saving, {"--exit-interval", "8", "--metrics", dir / "second.jsonl"}), dir / "second.log");
  EXPECT_TRUE(contains(second, "resharding: the checkpoint was saved under dp=4 tp=1 pp=1 zero=3")) << second;
  const std::string third =
      run_training(2, joined(saving, {"--zero", "2", "--metrics", dir / "third.jsonl"}), dir / "third.log");
  EXPECT_TRUE(contains(third, "resharding: the checkpoint was saved under dp=1 tp=1 pp=1 zero=0")) << third;
  const std::vector<double> expected = losses(dir / "reference.jsonl", 5, 12);
  std::vector<double> actual = losses(dir / "second.jsonl", 5, 8);
  const std::vector<double> last = losses(dir / "third.jsonl", 9, 12);
  actual.insert(actual.end(), last.begin(), last.end());
  ASSERT_EQ(expected.size(), 8u);
  EXPECT_TRUE(all_close(actual, expected, Tolerance{1e-5, 1e-4}));
}

// Rank 0's predicted model-state bytes in `--estimate-memory`'s output:
// "rank 0: P=... = <parameters> + <gradients> + <optimizer> = <total> bytes".
double predicted_bytes(const std::string& output) {
  const size_t line = output.find("rank 0: P=");
  if (line == std::string::npos) {
    ADD_FAILURE() << "no prediction in:\n" << output;
    return 0.0;
  }
  const size_t end = output.find(" bytes", line);
  const size_t start = output.rfind(' ', end - 1) + 1;
  return std::stod(output.substr(start, end - start));
}

// `tessera train --estimate-memory` on four ranks prints each rank's
// predicted model-state bytes without training; the same configuration
// trained measures them (the allocator's counters, in the metrics): under
// every --zero stage (with 2 micro-batches a step), with tp = 2 and with
// cp = 2 (ZeRO shards over the dp × cp replicas), and with experts under
// expert parallelism (the experts shard over dp, the rest over ep too), the
// measurement is at most the prediction (+3%) and at least the prediction
// with nothing ahead or in flight (--zero-prefetch 0).
TEST(Zero, EstimateMemoryPredictsTheMeasuredPeak) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = without(joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()),
                                   {"--train-steps", "3", "--num-layers", "4", "--hidden-size", "64"}),
                            "--bucket-size-mb");
  for (const std::vector<std::string>& layout : std::vector<std::vector<std::string>>{
           {"--zero", "0"}, {"--zero", "1"}, {"--zero", "2"}, {"--zero", "3"}, {"--zero", "3", "--zero-prefetch", "0"},
           {"--zero", "3", "--tp", "2"}, {"--zero", "3", "--cp", "2"},
           {"--num-experts", "4", "--ep", "2", "--zero", "1"}, {"--num-experts", "4", "--ep", "4"},
           {"--num-experts", "4", "--ep", "2", "--zero", "3"}}) {
    std::string name = "estimate";
    for (const std::string& word : layout) {
      name.push_back('_');
      name.append(word, word.find_first_not_of('-'));
    }
    SCOPED_TRACE(name);
    const std::string estimate =
        run_training(4, joined(joined(args, layout), {"--estimate-memory"}), dir / (name + ".log"));
    EXPECT_TRUE(contains(estimate, "predicted memory per rank")) << estimate;
    EXPECT_TRUE(contains(estimate, "  rank 3: ")) << estimate;
    EXPECT_FALSE(contains(estimate, "step=1 ")) << "--estimate-memory trained:\n" << estimate;
    const double predicted = predicted_bytes(estimate);
    // The floor: with nothing gathered ahead or left in flight (what must be
    // there however early the reductions finish).
    bool units = false, prefetch_given = false;
    for (size_t i = 0; i + 1 < layout.size(); ++i) {
      units |= layout[i] == "--zero" && (layout[i + 1] == "2" || layout[i + 1] == "3");
      prefetch_given |= layout[i] == "--zero-prefetch";
    }
    const double floor =
        units && !prefetch_given
            ? predicted_bytes(run_training(4, joined(joined(args, layout), {"--zero-prefetch", "0", "--estimate-memory"}),
                                           dir / (name + "_floor.log")))
            : predicted;
    run_training(4, joined(joined(args, layout), {"--metrics", dir / (name + ".jsonl")}), dir / (name + "_run.log"));
    double measured = 0.0;
    for (const io::StepRecord& record : io::read_metrics(dir / (name + ".jsonl")).steps)
      for (const auto& [key, value] : record.extra)
        if (key == "mem_model_state_bytes") measured = std::max(measured, value);
    // An upper bound (reductions may finish before the limit forces them),
    // and at least the floor.
    EXPECT_LE(measured, 1.03 * predicted) << estimate;
    EXPECT_GE(measured, 0.97 * floor) << estimate;
  }
}

// --save-interval-minutes: rank 0's clock decides, and every rank saves at
// the same step boundary (the save is collective: a rank that disagreed would
// leave the others waiting until --comm-timeout). An interval shorter than a
// step saves at every boundary, a long one only at the end; each save's stall,
// write time and bytes reach the next step's metrics.
TEST(CheckpointCadence, MinutesSaveAtTheSameStepOnEveryRank) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(mlp_args(write_image_dataset(dir.path, 512, 6, 5, 4, rng), rng()),
                           {"--train-steps", "6", "--comm-timeout", "30"});
  // A save after every step, synchronous (the stall is the write) and
  // asynchronous (each save's figures: the stall of starting it and of
  // publishing the previous one, with the previous one's write time).
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "--async-save" : "--no-async-save");
    const std::string name = async ? "async" : "sync";
    run_training(2,
                 joined(args, {"--save", dir / name, "--save-interval-minutes", "1e-6", "--metrics",
                               dir / (name + ".jsonl"), async ? "--async-save" : "--no-async-save"}),
                 dir / (name + ".log"));
    const std::vector<std::string> often = io::list_checkpoints(dir / name);
    ASSERT_EQ(often.size(), 6u);
    for (const std::string& path : often) EXPECT_EQ(io::CheckpointReader(path).ranks_saved(), 2) << path;
    int reported = 0;
    for (const io::StepRecord& record : io::read_metrics(dir / (name + ".jsonl")).steps) {
      std::map<std::string, double> extra(record.extra.begin(), record.extra.end());
      if (record.step == 1) {
        EXPECT_EQ(extra.count("checkpoint_stall_ms"), 0u) << "no save before step 1";
        continue;
      }
      ++reported;
      EXPECT_GT(extra["checkpoint_stall_ms"], 0.0) << "step " << record.step;
      if (!async) {
        EXPECT_GT(extra["checkpoint_write_s"] * 1e3, 0.0) << "step " << record.step;
        EXPECT_LE(extra["checkpoint_write_s"] * 1e3, extra["checkpoint_stall_ms"]) << "synchronous save";
      }
      if (!async || record.step >= 3) {  // the background write of step k-2's save, published with step k-1's
        EXPECT_GT(extra["checkpoint_write_s"], 0.0) << "step " << record.step;
        EXPECT_GT(extra["checkpoint_bytes"], 0.0) << "step " << record.step;
      }
    }
    EXPECT_EQ(reported, 5);
  }
  run_training(2, joined(args, {"--save", dir / "rarely", "--save-interval-minutes", "60"}), dir / "rarely.log");
  const std::vector<std::string> rarely = io::list_checkpoints(dir / "rarely");
  ASSERT_EQ(rarely.size(), 1u);
  EXPECT_EQ(fs::path(rarely.front()).filename().string(), step_name(6));
}

// The bytes of /tensors/<name> of the checkpoint file `index` as two tools
// that know nothing of Tessera read them (HDF5 resolving the virtual
// datasets into the rank files): h5py (Debian's python3-h5py) and h5dump's
// binary output, run from / so the rank files are found relative to the
// index, not the working directory.
struct ExternalRead {
  std::vector<uint8_t> h5py, h5dump;
};

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

ExternalRead read_with_hdf5_tools(const ScratchDirectory& dir, const std::string& index, const std::string& name) {
  const std::string out = dir / ("external_" + name);
  const std::string script =
      "import sys, h5py, numpy\n"
      "with h5py.File(sys.argv[1], 'r') as f:\n"
      "    data = numpy.ascontiguousarray(f['tensors'][sys.argv[2]][()])\n"
      "open(sys.argv[3], 'wb').write(data.tobytes())\n";
  const Outcome python =
      run_command({"/usr/bin/python3", "-c", script, index, name, out + ".h5py"}, out + ".h5py.log", seconds(60));
  EXPECT_EQ(python.status, 0) << python.output;
  const Outcome h5dump = run_command({"/bin/sh", "-c",
                                      "cd / && exec h5dump -d " + shell_words({"/tensors/" + name}) + " -b LE -o " +
                                          shell_words({out + ".h5dump"}) + " " + shell_words({index})},
                                     out + ".h5dump.log", seconds(60));
  EXPECT_EQ(h5dump.status, 0) << h5dump.output;
  return {file_bytes(out + ".h5py"), file_bytes(out + ".h5dump")};
}

// Sharded, asynchronous checkpoints at scale: a GPT trained on 4 ranks (dp 2
// × tp 2, ZeRO-1) saves at steps 2 and 4, every rank its own file. The step-4
// checkpoint is read by 1, 2 (ZeRO-3) and 8 ranks (dp 4 × tp 2, ZeRO-2), each
// rank its own slices: each continues the 4-rank run's loss curve. h5py and
// h5dump read its tensors whole, equal bit for bit to what Tessera reads and,
// to f32 rounding, to the tensors of a one-rank run of the same 4 steps.
TEST(CheckpointAtScale, WrittenByFourRanksReadByOneTwoAndEightRanksAndByHdf5Tools) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()), {"--train-steps", "6"});
  const std::vector<std::string> four = {"--tp", "2", "--zero", "1"};
  run_training(4, joined(joined(args, four), {"--metrics", dir / "reference.jsonl"}), dir / "reference.log");
  run_training(4, joined(joined(args, four), {"--save", dir / "four", "--save-interval", "2", "--exit-interval", "4"}),
               dir / "four.log");
  const std::string saved = dir / ("four/" + step_name(4));
  for (int r = 0; r < 4; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank_%05d.h5", r);
    EXPECT_TRUE(fs::exists(fs::path(saved) / name)) << name;
  }
  EXPECT_EQ(io::CheckpointReader(dir / ("four/" + step_name(2))).ranks_saved(), 4);
  const std::vector<double> expected = losses(dir / "reference.jsonl", 5, 6);
  ASSERT_EQ(expected.size(), 2u);

  struct Reader {
    int ranks;
    std::vector<std::string> layout;
  };
  for (const Reader& reader : {Reader{1, {}}, Reader{2, {"--zero", "3"}}, Reader{8, {"--tp", "2", "--zero", "2"}}}) {
    SCOPED_TRACE(std::to_string(reader.ranks) + " rank(s)");
    const std::string name = "read_by_" + std::to_string(reader.ranks);
    const std::string output =
        run_training(reader.ranks,
                     fit_zero(joined(joined(args, reader.layout),
                                     {"--resume", saved, "--save", dir / name, "--metrics", dir / (name + ".jsonl")})),
                     dir / (name + ".log"));
    EXPECT_TRUE(contains(output, "resharding: the checkpoint was saved under dp=2 tp=2 pp=1 zero=1 on 4 rank(s)"))
        << output;
    EXPECT_TRUE(all_close(losses(dir / (name + ".jsonl"), 5, 6), expected, Tolerance{1e-5, 1e-4}));
  }

  run_training(1, joined(args, {"--train-steps", "4", "--save", dir / "one"}), dir / "one.log");
  Context ctx;
  const io::CheckpointReader sharded(saved), one(dir / ("one/" + step_name(4)));
  // A vocabulary-parallel table, head shards, a row-parallel weight (its
  // column halves: a run per row, one strided hyperslab), ZeRO-1 ranges of
  // head shards.
  for (const std::string name :
       {"wte.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.proj.weight", "blocks.0.attn.qkv.weight.exp_avg"}) {
    SCOPED_TRACE(name);
    const auto stored = std::find_if(sharded.tensors().begin(), sharded.tensors().end(),
                                     [&](const io::StoredTensor& t) { return t.name == name; });
    ASSERT_NE(stored, sharded.tensors().end());
    EXPECT_GE(stored->pieces, 2) << "written by more than one rank";
    const Tensor tessera = read_whole(ctx, sharded, *stored);
    const auto* begin = static_cast<const uint8_t*>(tessera.data_ptr());
    const std::vector<uint8_t> bytes(begin, begin + tessera.nbytes());
    const ExternalRead external = read_with_hdf5_tools(dir, saved + "/checkpoint.h5", name);
    EXPECT_EQ(external.h5py, bytes) << "h5py";
    EXPECT_EQ(external.h5dump, bytes) << "h5dump";
    const std::vector<float> read(reinterpret_cast<const float*>(external.h5py.data()),
                                  reinterpret_cast<const float*>(external.h5py.data()) + external.h5py.size() / 4);
    const std::vector<float> reference = read_whole(ctx, one, *stored).to_vector<float>();
    EXPECT_TRUE(all_close(std::vector<double>(read.begin(), read.end()),
                          std::vector<double>(reference.begin(), reference.end()), Tolerance{1e-4, 1e-3}));
  }
}

// Interleaved 1F1B through `tessera train` (2 stages x 2 chunks, 4 blocks,
// 4 micro-batches a step, dropout): the losses of one rank with the same
// global batch; a checkpoint it writes resumes under the plain 2-stage
// pipeline and back, the next losses those of a run that kept its layout.
TEST(InterleavedPipeline, TwoStagesOfTwoChunksEqualOneRankAndReshardBothWays) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto base = joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()), {"--num-layers", "4"});
  const auto args = joined(base, {"--clip-grad", "0.5", "--train-steps", "6"});
  const std::string output = run_training(
      2, joined(args, {"--pp", "2", "--virtual-pipeline-stages", "2", "--metrics", dir / "interleaved.jsonl"}),
      dir / "interleaved.log");
  EXPECT_TRUE(contains(output,
                       "pipeline: 2 stages x 2 chunks, interleaved 1f1b, blocks [0, 1), [1, 2), [2, 3), "
                       "[3, 4), chunk c on stage c mod 2"))
      << output;
  run_training(1, joined(args, {"--metrics", dir / "one.jsonl"}), dir / "one.log");
  const std::vector<double> expected = losses(dir / "one.jsonl", 1, 6),
                            actual = losses(dir / "interleaved.jsonl", 1, 6);
  ASSERT_EQ(expected.size(), 6u);
  EXPECT_TRUE(all_close(actual, expected, Tolerance{1e-5, 1e-5}));
  expect_resumed_losses_continue(dir, base, 8, 4,
                                 {"pp=2 x 2 chunks -> pp=2",
                                  2,
                                  2,
                                  {"--pp", "2", "--virtual-pipeline-stages", "2"},
                                  {"--pp", "2"},
                                  "dp=1 tp=1 pp=2 x 2 chunks zero=0"});
  expect_resumed_losses_continue(dir, base, 8, 4,
                                 {"pp=2 -> pp=2 x 2 chunks",
                                  2,
                                  2,
                                  {"--pp", "2"},
                                  {"--pp", "2", "--virtual-pipeline-stages", "2"},
                                  "dp=1 tp=1 pp=2 zero=0"});
}

// dp = 2 × tp = 2 × pp = 2 on eight ranks (oversubscribed) against one rank
// with the same global batch: the same losses over 10 steps.
TEST(ThreeDimensionalParallelism, EightRanksEqualOneRankOverTenSteps) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args =
      joined(words("--model gpt --vocab-size 256 --seq-length 16 --num-layers 4 --num-heads 2 --hidden-size 32 "
                   "--global-batch-size 16 --lr 2e-3 --warmup-steps 2 --weight-decay 0.1 --clip-grad 0.5 "
                   "--threads 1 --train-steps 10"),
             {"--data", write_text_dataset(dir.path, 4000, rng), "--seed", std::to_string(rng())});
  const std::string output = run_training(
      8, joined(args, {"--micro-batch-size", "2", "--tp", "2", "--pp", "2", "--metrics", dir / "3d.jsonl"}),
      dir / "3d.log");
  EXPECT_TRUE(contains(output, "dp=2 pp=2 tp=2")) << output;
  run_training(1, joined(args, {"--micro-batch-size", "4", "--metrics", dir / "one.jsonl"}), dir / "one.log");
  const std::vector<double> expected = losses(dir / "one.jsonl", 1, 10), actual = losses(dir / "3d.jsonl", 1, 10);
  ASSERT_EQ(expected.size(), 10u);
  EXPECT_TRUE(all_close(actual, expected, Tolerance{1e-5, 1e-5}));
}

// The Llama (grouped-query attention with 2 key/value groups of 2 query
// heads, rotary base 500000, SwiGLU, untied head) under every layout against
// one rank with the same global batch: the same losses over 6 steps.
std::vector<std::string> llama_args(const std::string& data, uint64_t seed, const std::string& heads = "4",
                                    const std::string& groups = "2") {
  return joined(words("--model llama --vocab-size 256 --seq-length 16 --num-layers 4 --hidden-size 32 "
                      "--ffn-hidden-size 48 --group-query-attention --rotary-base 500000 --global-batch-size 16 "
                      "--lr 2e-3 --warmup-steps 2 --weight-decay 0.1 --clip-grad 0.5 --threads 1 --train-steps 6"),
                {"--num-heads", heads, "--num-query-groups", groups, "--data", data, "--seed", std::to_string(seed)});
}

// The evaluation losses of a run's metrics, in order (none without --eval-data).
std::vector<double> eval_losses(const std::string& metrics) {
  std::vector<double> out;
  for (const io::EvalRecord& record : io::read_metrics(metrics).evals) out.push_back(record.eval_loss);
  return out;
}

struct LlamaLayout {
  const char* name;
  int ranks;
  std::vector<std::string> flags;  // the layout, its micro-batch size included
};

// One rank runs micro-batches of `one_rank_micro_batch` (a mixture of
// experts' auxiliary losses are per micro-batch: the layouts then keep its size).
void expect_llama_layouts_equal_one_rank(const std::vector<std::string>& args, const std::vector<LlamaLayout>& layouts,
                                         const ScratchDirectory& dir, const std::string& one_rank_micro_batch = "4") {
  run_training(1, joined(args, {"--micro-batch-size", one_rank_micro_batch, "--metrics", dir / "llama_one.jsonl"}),
               dir / "llama_one.log");
  const std::vector<double> expected = losses(dir / "llama_one.jsonl", 1, 6);
  const std::vector<double> expected_evals = eval_losses(dir / "llama_one.jsonl");  // with --eval-data
  ASSERT_EQ(expected.size(), 6u);
  for (const LlamaLayout& layout : layouts) {
    SCOPED_TRACE(layout.name);
    const std::string metrics = dir / (std::string("llama_") + std::to_string(&layout - layouts.data()) + ".jsonl");
    const std::string output = run_training(layout.ranks, joined(joined(args, layout.flags), {"--metrics", metrics}),
                                            metrics + ".log");
    EXPECT_TRUE(all_close(losses(metrics, 1, 6), expected, Tolerance{1e-5, 1e-5})) << output;
    EXPECT_TRUE(all_close(eval_losses(metrics), expected_evals, Tolerance{1e-5, 1e-5})) << output;
  }
}

TEST(LlamaLayouts, TensorSequencePipelineInterleavedAndZeroThreeEqualOneRank) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = llama_args(write_text_dataset(dir.path, 4000, rng), rng());
  expect_llama_layouts_equal_one_rank(
      args,
      {{"tp 2", 2, {"--micro-batch-size", "4", "--tp", "2"}},
       {"tp 2 sequence parallel, recompute", 2, {"--micro-batch-size", "4", "--tp", "2", "--sequence-parallel",
                                                  "--recompute"}},
       {"pp 2 1f1b", 2, {"--micro-batch-size", "4", "--pp", "2"}},
       {"pp 2 x 2 chunks interleaved", 2, {"--micro-batch-size", "4", "--pp", "2", "--virtual-pipeline-stages", "2"}},
       {"dp 2 zero 3", 2, {"--micro-batch-size", "2", "--zero", "3"}},
       {"dp 2 x tp 2 x pp 2", 8, {"--micro-batch-size", "2", "--tp", "2", "--pp", "2"}},
       {"dp 2 x tp 2, data-parallel ranks neighbours", 4,
        {"--micro-batch-size", "2", "--tp", "2", "--rank-order", "dp-tp-pp"}}},
      dir);
}

// The pipeline layouts the zero-bubble schedules are checked under, each
// against 1F1B on the same ranks.
struct ScheduleLayout {
  const char* name;
  int ranks;
  std::vector<std::string> flags;
};

// Trains `args` under each layout with 1F1B and with `schedule`. `exact`:
// the two checkpoints are the same bit for bit (ZB-H1 adds each weight
// gradient in the micro-batch order 1F1B does); otherwise the losses and the
// final parameters agree to f32 rounding (a V cuts the model into other
// chunks: the gradient norm sums its parts in another order).
void expect_schedule_equals_one_f_one_b(const ScratchDirectory& dir, const std::vector<std::string>& args,
                                        const std::string& schedule, const std::vector<ScheduleLayout>& layouts,
                                        bool exact) {
  for (const ScheduleLayout& layout : layouts) {
    SCOPED_TRACE(layout.name);
    std::string name = schedule + "_" + layout.name;
    for (char& ch : name)
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    const auto run = fit_zero(joined(args, layout.flags));
    run_training(layout.ranks, joined(run, {"--save", dir / (name + "_1f1b"), "--metrics", dir / (name + "_1f1b.jsonl")}),
                 dir / (name + "_1f1b.log"));
    const std::string output = run_training(
        layout.ranks,
        joined(run, {"--pipeline-schedule", schedule, "--save", dir / name, "--metrics", dir / (name + ".jsonl")}),
        dir / (name + ".log"));
    EXPECT_TRUE(contains(output, ", " + schedule + ", ")) << output;  // the pipeline line names the schedule
    const std::vector<double> expected = losses(dir / (name + "_1f1b.jsonl"), 1, 6),
                              actual = losses(dir / (name + ".jsonl"), 1, 6);
    ASSERT_EQ(expected.size(), 6u);
    const std::string saved = step_name(6);
    if (exact) {
      EXPECT_EQ(actual, expected);
      EXPECT_TRUE(checkpoints_identical(dir / (name + "_1f1b/" + saved), dir / (name + "/" + saved)));
    } else {
      EXPECT_TRUE(all_close(actual, expected, Tolerance{1e-5, 1e-5}));
      EXPECT_TRUE(checkpoints_close(dir / (name + "_1f1b/" + saved), dir / (name + "/" + saved), Tolerance{1e-5, 1e-5}));
    }
  }
}

// ZB-H1 (backward split in input and weight gradients, the W steps filling
// the bubble) through `tessera train` with the GPT (tied embedding, dropout)
// on 2 and 4 stages, with dp 2, ZeRO-2 and 3, recomputation, tp 2 with sequence
// parallelism, and experts over ep 2: the same checkpoint as 1F1B, bit for bit.
TEST(ZeroBubblePipeline, ZbH1EqualsOneFOneBBitForBit) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()),
                           {"--num-layers", "4", "--clip-grad", "0.5", "--train-steps", "6"});
  expect_schedule_equals_one_f_one_b(
      dir, args, "zb-h1",
      {{"pp 2", 2, {"--pp", "2"}},
       {"pp 4", 4, {"--pp", "4"}},
       {"dp 2 x pp 2", 4, {"--pp", "2"}},
       {"dp 2 x pp 2 zero 2", 4, {"--pp", "2", "--zero", "2"}},
       {"dp 2 x pp 2 zero 3", 4, {"--pp", "2", "--zero", "3"}},
       {"pp 2 recompute", 2, {"--pp", "2", "--recompute"}},
       {"tp 2 sequence parallel x pp 2", 4, {"--tp", "2", "--sequence-parallel", "--pp", "2"}},
       {"ep 2 x pp 2, 4 experts", 4,
        {"--pp", "2", "--ep", "2", "--num-experts", "4", "--moe-ffn-hidden-size", "40", "--moe-aux-loss-coeff",
         "0.01"}}},
      true);
}

// ZBV (two chunks per stage in a V, the loss on stage 0) with the Llama
// (untied output layer) on 2 and 4 stages, with dp 2, ZeRO-3 and
// recomputation, and with the GPT, whose tied table and its copy for the
// output layer both sit on stage 0 then, against 1F1B; and a 1F1B
// checkpoint resumed under ZBV.
TEST(ZeroBubblePipeline, ZbvEqualsOneFOneBAndResumesItsCheckpoint) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(without(llama_args(write_text_dataset(dir.path, 4000, rng), rng()), "--num-layers"),
                           {"--num-layers", "8", "--micro-batch-size", "2"});
  expect_schedule_equals_one_f_one_b(
      dir, args, "zbv",
      {{"pp 2", 2, {"--pp", "2"}},
       {"pp 4", 4, {"--pp", "4"}},
       {"dp 2 x pp 2", 4, {"--pp", "2"}},
       {"dp 2 x pp 2 zero 3", 4, {"--pp", "2", "--zero", "3"}},
       {"pp 2 recompute", 2, {"--pp", "2", "--recompute"}}},
      false);
  const auto gpt = joined(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()),
                          {"--num-layers", "4", "--clip-grad", "0.5", "--train-steps", "6"});
  expect_schedule_equals_one_f_one_b(dir, gpt, "zbv",
                                     {{"gpt tied pp 2", 2, {"--pp", "2"}},
                                      {"gpt tied dp 2 x pp 2 zero 3", 4, {"--pp", "2", "--zero", "3"}}},
                                     false);
  const std::string output = run_training(
      2, joined(args, {"--pp", "2", "--pipeline-schedule", "zbv", "--pipeline-split", "0,2,4,6,8"}), dir / "v.log");
  EXPECT_TRUE(contains(output, "pipeline: 2 stages x 2 chunks in a V, zbv, blocks [0, 2), [2, 4), [4, 6), [6, 8), "
                               "chunks c and 3 - c on stage c"))
      << output;
  expect_resumed_losses_continue(dir, without(args, "--train-steps"), 8, 4,
                                 {"pp=2 1f1b -> pp=2 zbv",
                                  2,
                                  2,
                                  {"--pp", "2"},
                                  {"--pp", "2", "--pipeline-schedule", "zbv"},
                                  "dp=1 tp=1 pp=2 zero=0"});
}

// A run's mixture-of-experts figures (apps/expert_load.h): each moe_* entry's values over the steps.
std::map<std::string, std::vector<double>> moe_figures(const std::string& metrics) {
  std::map<std::string, std::vector<double>> figures;
  for (const io::StepRecord& record : io::read_metrics(metrics).steps)
    for (const auto& [key, value] : record.extra)
      if (key.rfind("moe_", 0) == 0) figures[key].push_back(value);
  return figures;
}

// Mixtures of experts (4 experts, top-2, in layers 0, 2 and 3 of 4; the
// load-balancing and z losses on) in the Llama and the GPT under every layout
// against one rank: the same losses. Expert parallelism (the experts split
// over 2 and 4 ranks, tokens exchanged all-to-all) alone and with dp and
// ZeRO-1, tp with sequence parallelism, the pipeline, ZeRO-3 and context
// parallelism. Every run keeps micro-batches of 2
// samples, the token sets the auxiliary losses are taken over (under
// sequence parallelism each rank's statistics are summed over the group).
TEST(MoeLayouts, TensorSequencePipelineAndDataParallelEqualOneRank) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const std::vector<std::string> experts = {"--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq",
                                            "[1,0,1,1]", "--moe-ffn-hidden-size", "40", "--moe-aux-loss-coeff",
                                            "0.01", "--moe-z-loss-coeff", "0.001"};
  {
    SCOPED_TRACE("llama");
    ScratchDirectory dir("tessera_processes_");
    const auto args = joined(llama_args(write_text_dataset(dir.path, 4000, rng), rng()), experts);
    expect_llama_layouts_equal_one_rank(
        args,
        {{"tp 2", 2, {"--micro-batch-size", "2", "--tp", "2"}},
         {"tp 2 sequence parallel, recompute", 2,
          {"--micro-batch-size", "2", "--tp", "2", "--sequence-parallel", "--recompute"}},
         {"pp 2 1f1b", 2, {"--micro-batch-size", "2", "--pp", "2"}},
         {"pp 2 x 2 chunks interleaved", 2, {"--micro-batch-size", "2", "--pp", "2", "--virtual-pipeline-stages", "2"}},
         {"dp 2", 2, {"--micro-batch-size", "2"}},
         {"dp 2 x tp 2 sequence parallel", 4, {"--micro-batch-size", "2", "--tp", "2", "--sequence-parallel"}},
         {"ep 2", 2, {"--micro-batch-size", "2", "--expert-model-parallel-size", "2"}},
         {"ep 4", 4, {"--micro-batch-size", "2", "--ep", "4"}},
         {"ep 2 x dp 2 zero 1", 4, {"--micro-batch-size", "2", "--ep", "2", "--zero", "1"}},
         {"ep 2 x tp 2 sequence parallel", 4, {"--micro-batch-size", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"}},
         {"ep 2 x pp 2", 4, {"--micro-batch-size", "2", "--ep", "2", "--pp", "2"}},
         {"ep 2 zero 3", 2, {"--micro-batch-size", "2", "--ep", "2", "--zero", "3"}},
         {"ep 2 x cp 2", 4, {"--micro-batch-size", "2", "--ep", "2", "--cp", "2"}}},
        dir, "2");
    // The routing figures (tokens per expert, imbalance, the losses) are one rank's too.
    const auto expected = moe_figures(dir / "llama_one.jsonl");
    ASSERT_EQ(expected.count("moe_l0_tokens_max"), 1u);
    EXPECT_EQ(expected.count("moe_l1_tokens_max"), 0u) << "block 1 is dense";
    ASSERT_EQ(expected.at("moe_dropped_fraction"), std::vector<double>(6, 0.0)) << "dropless";
    for (int layout = 0; layout < 13; ++layout) {
      SCOPED_TRACE("layout " + std::to_string(layout));
      const auto actual = moe_figures(dir / ("llama_" + std::to_string(layout) + ".jsonl"));
      ASSERT_EQ(actual.size(), expected.size());
      for (const auto& [key, values] : expected)
        EXPECT_TRUE(all_close(actual.at(key), values, Tolerance{1e-4, 1e-6})) << key;
    }
  }
  {
    SCOPED_TRACE("gpt");
    ScratchDirectory dir("tessera_processes_");
    auto gpt = gpt_args(write_text_dataset(dir.path, 4000, rng), rng());
    for (const char* flag : {"--micro-batch-size", "--bucket-size-mb", "--hidden-dropout"}) gpt = without(gpt, flag);
    const auto args = joined(joined(gpt, experts), {"--num-layers", "4", "--train-steps", "6"});
    expect_llama_layouts_equal_one_rank(args,
                                        {{"tp 2 sequence parallel", 2,
                                          {"--micro-batch-size", "2", "--tp", "2", "--sequence-parallel"}},
                                         {"pp 2", 2, {"--micro-batch-size", "2", "--pp", "2"}}},
                                        dir, "2");
  }
}

// The Llama with 4 experts in every block (top-2, the auxiliary losses on),
// micro-batches of 2 (the losses' token sets).
std::vector<std::string> moe_llama_args(const std::string& data, uint64_t seed) {
  return joined(llama_args(data, seed), {"--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "40",
                                         "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
                                         "--micro-batch-size", "2"});
}

// A checkpoint of two expert-parallel ranks (each wrote its own experts)
// resumed on one rank (every expert read by it) and on four (ep 4: each
// reads one), and one rank's resumed at ep 2 with ZeRO-1: the losses go on
// as those of the run that kept its layout.
TEST(MoeLayouts, ACheckpointResumesUnderOtherExpertParallelSizes) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = without(moe_llama_args(write_text_dataset(dir.path, 4000, rng), rng()), "--train-steps");
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"moe ep=2 -> 1 rank", 2, 1, {"--ep", "2"}, {}, "dp=2 tp=1 pp=1 ep=2 zero=0"});
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"moe ep=2 -> ep=4", 2, 4, {"--ep", "2"}, {"--ep", "4"}, "dp=2 tp=1 pp=1 ep=2 zero=0"});
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"moe 1 rank -> ep=2 zero=1", 1, 2, {}, {"--ep", "2", "--zero", "1"},
                                  "dp=1 tp=1 pp=1 zero=0"});
}

// In bf16 (f32 master weights): expert parallelism, with tp and sequence
// parallelism and with recomputation and accumulation, against one bf16 rank.
// Expert GEMMs then run on other row counts and their weight gradients add
// rows in another grouping, so bf16 rounds otherwise: within 1e-3.
TEST(MoeLayouts, ExpertParallelismInBf16EqualsOneRank) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(moe_llama_args(write_text_dataset(dir.path, 4000, rng), rng()), {"--precision", "bf16"});
  run_training(1, joined(args, {"--metrics", dir / "one.jsonl"}), dir / "one.log");
  const std::vector<double> expected = losses(dir / "one.jsonl", 1, 6);
  ASSERT_EQ(expected.size(), 6u);
  for (const auto& [name, ranks, layout] : std::vector<std::tuple<std::string, int, std::vector<std::string>>>{
           {"ep 2", 2, {"--ep", "2"}},
           {"ep 2 x tp 2 sequence parallel, recompute", 4, {"--ep", "2", "--tp", "2", "--sequence-parallel",
                                                            "--recompute"}}}) {
    SCOPED_TRACE(name);
    const std::string metrics = dir / (std::to_string(ranks) + ".jsonl");
    const std::string output = run_training(ranks, joined(joined(args, layout), {"--metrics", metrics}), metrics + ".log");
    EXPECT_TRUE(all_close(losses(metrics, 1, 6), expected, Tolerance{1e-3, 1e-3})) << output;
  }
}

// On the emulated device (its channel carrying the experts' all-to-all) two
// expert-parallel ranks write the checkpoint the CPU ranks write, bit for bit.
TEST(MoeLayouts, TheEmulatedDeviceEqualsTheCpu) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(moe_llama_args(write_text_dataset(dir.path, 4000, rng), rng()),
                           {"--ep", "2", "--save-interval", "6"});
  run_training(2, joined(args, {"--device", "cpu", "--save", dir / "cpu"}), dir / "cpu.log");
  const std::string emulated = run_training(2, joined(args, {"--device", "emu", "--save", dir / "emu"}), dir / "emu.log");
  EXPECT_TRUE(contains(emulated, "on emu:0")) << emulated;
  EXPECT_TRUE(checkpoints_identical(dir / ("cpu/" + step_name(6)), dir / ("emu/" + step_name(6))));
}

// The decoder's switches on their own, under layouts: the GPT with rotary
// embeddings (its biases kept, so the grouped attention's output bias is
// summed over the sequence-parallel group), and the GPT with the rest of the
// Llama's switches (RMSNorm, SwiGLU, 2 key/value groups of 4 heads, no
// biases, an untied head), each equal to one rank.
TEST(DecoderSwitchLayouts, GptWithLlamaSwitchesEqualsOneRank) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  {
    SCOPED_TRACE("gpt --position-embedding-type rope");
    ScratchDirectory dir("tessera_processes_");
    const auto args = joined(without(gpt_args(write_text_dataset(dir.path, 4000, rng), rng()), "--micro-batch-size"),
                             {"--position-embedding-type", "rope", "--train-steps", "6"});
    expect_llama_layouts_equal_one_rank(
        args,
        {{"tp 2 sequence parallel", 2, {"--micro-batch-size", "4", "--tp", "2", "--sequence-parallel"}},
         {"pp 2 1f1b", 2, {"--micro-batch-size", "4", "--pp", "2"}}},
        dir);
  }
  {
    SCOPED_TRACE("gpt with the Llama's other switches");
    ScratchDirectory dir("tessera_processes_");
    auto gpt = gpt_args(write_text_dataset(dir.path, 4000, rng), rng());
    for (const char* flag : {"--micro-batch-size", "--num-heads", "--bucket-size-mb", "--hidden-dropout"})
      gpt = without(gpt, flag);  // (dropout masks follow the micro-batch: dp 2 runs micro-batches of 2)
    const auto args = joined(gpt,
                             {"--num-heads", "4", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
                              "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                              "--untie-embeddings-and-output-weights", "--train-steps", "6"});
    expect_llama_layouts_equal_one_rank(args,
                                        {{"tp 2", 2, {"--micro-batch-size", "4", "--tp", "2"}},
                                         {"dp 2 zero 3", 2, {"--micro-batch-size", "2", "--zero", "3"}}},
                                        dir);
  }
}

// Context parallelism (--context-parallel-size): each sequence of 16 split
// into zigzag shares over 2 and 4 ranks (ring attention), alone and with
// tensor + sequence parallelism, the pipeline, and dp 2 with ZeRO-3, equal to
// one rank for the Llama (rotary embeddings at the shares' global positions)
// and the GPT (learned positions gathered at them, and --hidden-dropout 0.1:
// each rank draws the one-rank mask at its tokens' global positions; the
// evaluation's loss over --eval-data, each rank its share of every sequence,
// is one rank's too).
TEST(ContextParallelLayouts, GptAndLlamaEqualOneRank) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const std::vector<LlamaLayout> layouts = {
      {"cp 2", 2, {"--micro-batch-size", "4", "--context-parallel-size", "2"}},
      {"cp 4", 4, {"--micro-batch-size", "4", "--cp", "4"}},
      {"cp 2 x tp 2 sequence parallel", 4, {"--micro-batch-size", "4", "--cp", "2", "--tp", "2", "--sequence-parallel"}},
      {"cp 2 x pp 2", 4, {"--micro-batch-size", "4", "--cp", "2", "--pp", "2"}},
      {"cp 2 x dp 2 zero 3", 4, {"--micro-batch-size", "2", "--cp", "2", "--zero", "3"}}};
  {
    SCOPED_TRACE("llama");
    ScratchDirectory dir("tessera_processes_");
    expect_llama_layouts_equal_one_rank(llama_args(write_text_dataset(dir.path, 4000, rng), rng()), layouts, dir);
  }
  {
    SCOPED_TRACE("gpt");
    ScratchDirectory dir("tessera_processes_");
    const std::string data = write_text_dataset(dir.path, 4000, rng);
    auto gpt = gpt_args(data, rng());
    for (const char* flag : {"--micro-batch-size", "--bucket-size-mb"}) gpt = without(gpt, flag);
    const auto evaluated = joined(gpt, {"--train-steps", "6", "--eval-data", data, "--eval-interval", "3",
                                        "--eval-iters", "3"});
    expect_llama_layouts_equal_one_rank(evaluated, {layouts[0], layouts[1], layouts[2]}, dir);
  }
}

// A checkpoint of two context-parallel ranks resumed on one rank and on four
// (cp 4): the losses go on as those of the run that kept its layout.
TEST(ContextParallelLayouts, ACheckpointOfTwoContextRanksResumesOnOneAndOnFour) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(without(llama_args(write_text_dataset(dir.path, 4000, rng), rng()), "--train-steps"),
                           {"--micro-batch-size", "4"});
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"llama cp=2 -> 1 rank", 2, 1, {"--cp", "2"}, {}, "dp=1 tp=1 pp=1 cp=2 zero=0"});
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"llama cp=2 -> cp=4", 2, 4, {"--cp", "2"}, {"--cp", "4"}, "dp=1 tp=1 pp=1 cp=2 zero=0"});
}

// Rank 0's peak bytes of activations and workspaces in a run's summary
// ("activations and workspaces 10.72 MiB"), by the allocator's counters.
double activation_bytes(const std::string& output) {
  const std::string key = "activations and workspaces ";
  const size_t at = output.find(key);
  if (at == std::string::npos) return -1.0;
  std::istringstream in(output.substr(at + key.size()));
  double value = 0.0;
  std::string unit;
  in >> value >> unit;
  const std::map<std::string, double> scale = {{"B", 1.0}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  return scale.count(unit) ? value * scale.at(unit) : -1.0;
}

// Sequences of 4096 tokens: the activation and workspace bytes per rank fall
// with the cp ranks (each holds 4096/C tokens; attention never holds a whole
// T x T matrix), at cp 4 to at most 0.3 of one rank's.
TEST(ContextParallelLayouts, ActivationMemoryPerRankFallsWithTheContextRanks) {
  const auto args = words("--model llama --synthetic --vocab-size 256 --seq-length 4096 --num-layers 2 "
                          "--hidden-size 64 --num-heads 4 --ffn-hidden-size 128 --micro-batch-size 1 --train-steps 2 "
                          "--threads 1");
  ScratchDirectory dir("tessera_processes_");
  std::map<int, double> bytes;
  for (int cp : {1, 2, 4}) {
    const std::string output =
        run_training(cp, joined(args, {"--cp", std::to_string(cp)}), dir / ("cp" + std::to_string(cp) + ".log"));
    bytes[cp] = activation_bytes(output);
    ASSERT_GT(bytes[cp], 0.0) << output;
  }
  EXPECT_LT(bytes[2], 0.6 * bytes[1]) << bytes[2] << " bytes at cp 2, " << bytes[1] << " at cp 1";
  EXPECT_LE(bytes[4], 0.3 * bytes[1]) << bytes[4] << " bytes at cp 4, " << bytes[1] << " at cp 1";
}

// On the emulated device (its channel carrying the ring's exchanges) two
// context-parallel ranks write the checkpoint the CPU ranks write, bit for bit.
TEST(ContextParallelLayouts, TheEmulatedDeviceEqualsTheCpu) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(llama_args(write_text_dataset(dir.path, 4000, rng), rng()),
                           {"--micro-batch-size", "4", "--cp", "2", "--save-interval", "6"});
  run_training(2, joined(args, {"--device", "cpu", "--save", dir / "cpu"}), dir / "cpu.log");
  const std::string emulated = run_training(2, joined(args, {"--device", "emu", "--save", dir / "emu"}), dir / "emu.log");
  EXPECT_TRUE(contains(emulated, "on emu:0")) << emulated;
  EXPECT_TRUE(checkpoints_identical(dir / ("cpu/" + step_name(6)), dir / ("emu/" + step_name(6))));
}

TEST(LlamaLayouts, FourTensorParallelRanksOfFourGroupsEqualOneRank) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = llama_args(write_text_dataset(dir.path, 4000, rng), rng(), "8", "4");
  expect_llama_layouts_equal_one_rank(args, {{"tp 4", 4, {"--micro-batch-size", "4", "--tp", "4"}}}, dir);
}

// Dropout on the attention probabilities (--attention-dropout 0.1): with the
// heads split over 2 tensor-parallel ranks (also under sequence parallelism
// with recomputation) each rank draws for its heads the one-rank masks, so
// the losses are one rank's, for the GPT (hidden dropout too) and the Llama;
// and the flag is on (the one-rank losses differ from those without it).
TEST(AttentionDropoutLayouts, GptAndLlamaUnderTensorParallelismEqualOneRank) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const std::string data = write_text_dataset(dir.path, 4000, rng);
  const auto plain_gpt = joined(gpt_args(data, rng()), {"--train-steps", "6"});
  const auto gpt = joined(plain_gpt, {"--attention-dropout", "0.1"});
  run_training(1, joined(gpt, {"--metrics", dir / "gpt_one.jsonl"}), dir / "gpt_one.log");
  run_training(1, joined(plain_gpt, {"--metrics", dir / "gpt_plain.jsonl"}), dir / "gpt_plain.log");
  const std::vector<double> expected = losses(dir / "gpt_one.jsonl", 1, 6);
  ASSERT_EQ(expected.size(), 6u);
  EXPECT_FALSE(all_close(losses(dir / "gpt_plain.jsonl", 1, 6), expected, Tolerance{1e-5, 1e-5}))
      << "--attention-dropout 0.1 changed nothing";
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"gpt_tp2", {"--tp", "2"}}, {"gpt_tp2_sp", {"--tp", "2", "--sequence-parallel", "--recompute"}}}) {
    SCOPED_TRACE(name);
    const std::string metrics = dir / (name + ".jsonl");
    const std::string output = run_training(2, joined(joined(gpt, layout), {"--metrics", metrics}), metrics + ".log");
    EXPECT_TRUE(all_close(losses(metrics, 1, 6), expected, Tolerance{1e-5, 1e-5})) << output;
  }
  expect_llama_layouts_equal_one_rank(
      joined(llama_args(data, rng()), {"--attention-dropout", "0.1"}),
      {{"llama tp 2", 2, {"--micro-batch-size", "4", "--tp", "2"}},
       {"llama tp 2 sequence parallel, recompute",
        2,
        {"--micro-batch-size", "4", "--tp", "2", "--sequence-parallel", "--recompute"}}},
      dir);
}

// Saved under tp 2 x pp 2 and resumed on one rank, and the reverse; and a
// straight run against one stopped and resumed under the same layout (tp 2
// with sequence parallelism, bf16): bit-identical.
TEST(LlamaLayouts, CheckpointsReshardAndResumeBitExactly) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto base = without(llama_args(write_text_dataset(dir.path, 4000, rng), rng()), "--train-steps");
  const auto args = joined(base, {"--micro-batch-size", "4"});
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"llama tp=2 x pp=2 -> 1 rank", 4, 1, {"--tp", "2", "--pp", "2"}, {},
                                  "dp=1 tp=2 pp=2 zero=0"});
  expect_resumed_losses_continue(dir, args, 8, 4,
                                 {"llama 1 rank -> dp=2 zero=3", 1, 2, {}, {"--zero", "3", "--micro-batch-size", "2"},
                                  "dp=1 tp=1 pp=1 zero=0"});
  const auto run = joined(args, {"--tp", "2", "--sequence-parallel", "--precision", "bf16", "--train-steps", "6"});
  run_training(2, joined(run, {"--save", dir / "llama_straight"}), dir / "llama_straight.log");
  const auto split = joined(run, {"--save", dir / "llama_split", "--resume", "auto"});
  run_training(2, joined(split, {"--exit-interval", "3"}), dir / "llama_first.log");
  run_training(2, split, dir / "llama_second.log");
  EXPECT_TRUE(checkpoints_identical(dir / ("llama_straight/" + step_name(6)), dir / ("llama_split/" + step_name(6))));
}

// Every process below `root` (its descendants) that is rank `rank` of an
// Open MPI job, by the OMPI_COMM_WORLD_RANK in its environment; -1 if none.
pid_t find_rank(pid_t root, int rank) {
  std::vector<pid_t> frontier = {root};
  const std::string wanted = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  while (!frontier.empty()) {
    std::vector<pid_t> next;
    for (const auto& entry : fs::directory_iterator("/proc")) {
      const std::string name = entry.path().filename().string();
      if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(entry.path() / "stat");
      std::string line;
      if (!std::getline(stat, line)) continue;
      const size_t close = line.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream fields(line.substr(close + 2));
      char state = 0;
      pid_t parent = 0;
      fields >> state >> parent;
      for (pid_t p : frontier)
        if (parent == p) next.push_back(pid_t(std::stol(name)));
    }
    for (pid_t child : next) {
      std::ifstream environment("/proc/" + std::to_string(child) + "/environ", std::ios::binary);
      std::string variable;
      while (std::getline(environment, variable, '\0'))
        if (variable == wanted) return child;
    }
    frontier = next;
  }
  return -1;
}

int64_t latest_step(const std::string& save) {
  const std::optional<std::string> latest = io::find_latest_checkpoint(save);
  if (!latest) return -1;
  return io::CheckpointReader(*latest).step();
}

// SIGTERM to rank 1's process only: the ranks agree at the next step
// boundary, write a checkpoint, and all exit 0 (so mpiexec does); new
// processes resume from that step, and two more steps give what a straight
// run of as many gives, bit for bit (constant LR: --train-steps may differ).
TEST(Preemption, SigtermToOneRankCheckpointsAndEveryRankExitsZero) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(mlp_args(write_image_dataset(dir.path, 512, 6, 5, 4, rng), rng()),
                           {"--lr-decay-style", "constant", "--save", dir / "run", "--resume", "auto"});
  Job job(tessera_command(2, joined(args, {"--train-steps", "1000000", "--metrics", dir / "first.jsonl"})),
          dir / "first.log");
  ASSERT_TRUE(wait_for_steps(job, dir / "first.jsonl", 3, seconds(60))) << job.output();
  const pid_t rank1 = find_rank(job.pid(), 1);
  ASSERT_GT(rank1, 0) << "rank 1's process not found under mpiexec " << job.pid();
  ASSERT_EQ(::kill(rank1, SIGTERM), 0);
  const int status = job.wait(seconds(60));
  const std::string output = job.output();
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(contains(output, "SIGTERM received by rank 1")) << output;
  const int64_t stopped = latest_step(dir / "run");
  ASSERT_GE(stopped, 3) << output;
  EXPECT_TRUE(contains(output, "checkpoint " + (dir / "run/") + step_name(stopped) + " written")) << output;
  EXPECT_TRUE(io::CheckpointReader(dir / ("run/" + step_name(stopped))).verify().empty());

  const std::string total = std::to_string(stopped + 2);
  const std::string resumed =
      run_training(2, joined(args, {"--train-steps", total, "--metrics", dir / "second.jsonl"}), dir / "second.log");
  EXPECT_TRUE(contains(resumed, "resumed from " + (dir / "run/") + step_name(stopped))) << resumed;
  const io::MetricsLog log = io::read_metrics(dir / "second.jsonl");
  ASSERT_EQ(log.steps.size(), 2u);
  EXPECT_EQ(log.steps[0].step, stopped + 1);
  EXPECT_EQ(log.steps[1].step, stopped + 2);
  auto straight = args;
  straight[straight.size() - 3] = dir / "straight";  // --save
  run_training(2, joined(straight, {"--train-steps", total}), dir / "straight.log");
  EXPECT_TRUE(
      checkpoints_identical(dir / ("straight/" + step_name(stopped + 2)), dir / ("run/" + step_name(stopped + 2))));
}

// SIGUSR1 to rank 0, then, while the checkpoint it asked for is being
// written (its temporary directory exists), SIGTERM to both ranks and
// SIGUSR1 again: the handlers only note the signal, so the save completes,
// every rank exits 0, and the checkpoint is whole and loads. The model is
// big enough (2.5 M parameters: a 30 MB checkpoint) for the save to take a
// while.
TEST(Preemption, SecondSignalDuringTheSaveDoesNotCorruptIt) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(mlp_args(write_image_dataset(dir.path, 256, 8, 8, 4, rng), rng(), "1536,1536"),
                           {"--lr-decay-style", "constant", "--save", dir / "run", "--resume", "auto"});
  Job job(tessera_command(2, joined(args, {"--train-steps", "1000000", "--metrics", dir / "first.jsonl"})),
          dir / "first.log");
  ASSERT_TRUE(wait_for_steps(job, dir / "first.jsonl", 2, seconds(60))) << job.output();
  const pid_t rank0 = find_rank(job.pid(), 0), rank1 = find_rank(job.pid(), 1);
  ASSERT_GT(rank0, 0);
  ASSERT_GT(rank1, 0);
  ASSERT_EQ(::kill(rank0, SIGUSR1), 0);
  bool during_save = false;
  const auto deadline = Clock::now() + seconds(60);
  while (!during_save && job.running() && Clock::now() < deadline) {
    std::error_code error;  // the directory appears with the first save
    for (fs::directory_iterator it(dir.path / "run", error), end; !error && it != end; it.increment(error)) {
      const std::string name = it->path().filename().string();
      if (name.starts_with(".step_") && name.ends_with(".tmp")) during_save = true;
    }
    if (!during_save) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (during_save) {
    ::kill(rank0, SIGTERM);
    ::kill(rank1, SIGTERM);
    ::kill(rank1, SIGUSR1);
  }
  const int status = job.wait(seconds(60));
  const std::string output = job.output();
  EXPECT_TRUE(during_save) << "the save was never seen in progress; the test proves nothing. Output:\n" << output;
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(contains(output, "SIGUSR1 received by rank 0")) << output;
  const int64_t stopped = latest_step(dir / "run");
  ASSERT_GE(stopped, 2) << output;
  const std::string checkpoint = dir / ("run/" + step_name(stopped));
  EXPECT_TRUE(io::CheckpointReader(checkpoint).verify().empty());
  const std::string resumed =
      run_training(2, joined(args, {"--train-steps", std::to_string(stopped + 1)}), dir / "second.log");
  EXPECT_TRUE(contains(resumed, "resumed from " + checkpoint)) << resumed;
}

// Before the first step there is nothing to save: SIGTERM to one rank, or
// Ctrl-C (SIGINT to the whole process group, as a terminal sends it), ends
// the job at once with a line saying so, whatever start-up is doing (here:
// stuck for good, TESSERA_FAULT=startup_hang, as the old search for a head
// count was), a non-zero exit and no process left. Before, both signals were
// only noted for a first step that never came.
TEST(Preemption, SignalsDuringStartUpEndTheJobAtOnce) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(mlp_args(write_image_dataset(dir.path, 64, 6, 5, 4, rng), rng()),
                           {"--train-steps", "5", "--save", dir / "run"});
  const FaultEnvironment fault("startup_hang");
  for (const int signal : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(signal == SIGTERM ? "SIGTERM to rank 1" : "Ctrl-C");
    Job job(tessera_command(2, args), dir / "startup.log");
    ASSERT_TRUE(wait_for_output(job, {"startup_hang on rank 0", "startup_hang on rank 1"}, seconds(60)))
        << job.output();
    const auto sent = Clock::now();
    if (signal == SIGTERM) {
      const pid_t rank1 = find_rank(job.pid(), 1);
      ASSERT_GT(rank1, 0);
      ASSERT_EQ(::kill(rank1, SIGTERM), 0);
    } else {
      ASSERT_EQ(::kill(-job.pid(), SIGINT), 0);
    }
    const int status = job.wait(seconds(60));
    const double waited = std::chrono::duration<double>(Clock::now() - sent).count();
    const std::string output = job.output();
    EXPECT_NE(status, 0) << output;
    EXPECT_NE(status, -1) << "still running 60 s after the signal";
    EXPECT_LT(waited, 30.0) << output;
    EXPECT_TRUE(contains(output, "before the first training step: nothing to save yet, ending now")) << output;
    EXPECT_FALSE(job.anything_left()) << "processes left after the job ended";
    EXPECT_FALSE(io::find_latest_checkpoint(dir / "run").has_value());
  }
}

// Once training runs, Ctrl-C asks for a checkpoint at the next step boundary
// like SIGTERM (exit 0, the checkpoint whole); a second Ctrl-C ends the job
// at once (--train-steps is far away and rank 0 sleeps 2 s at every step, so
// only the second signal can end it in time), the newest complete checkpoint
// left as it was.
TEST(Preemption, CtrlCCheckpointsAndASecondCtrlCEndsAtOnce) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const auto args = joined(mlp_args(write_image_dataset(dir.path, 256, 6, 5, 4, rng), rng()),
                           {"--train-steps", "1000000", "--save", dir / "run", "--resume", "auto"});
  {
    Job job(tessera_command(2, joined(args, {"--metrics", dir / "first.jsonl"})), dir / "first.log");
    ASSERT_TRUE(wait_for_steps(job, dir / "first.jsonl", 2, seconds(60))) << job.output();
    const pid_t rank0 = find_rank(job.pid(), 0);
    ASSERT_GT(rank0, 0);
    ASSERT_EQ(::kill(rank0, SIGINT), 0);
    const int status = job.wait(seconds(60));
    const std::string output = job.output();
    EXPECT_EQ(status, 0) << output;
    EXPECT_TRUE(contains(output, "SIGINT received by rank 0")) << output;
    ASSERT_GE(latest_step(dir / "run"), 2) << output;
  }
  const int64_t saved = latest_step(dir / "run");
  const FaultEnvironment slow("slow:0");
  Job job(tessera_command(2, joined(args, {"--metrics", dir / "second.jsonl"})), dir / "second.log");
  ASSERT_TRUE(wait_for_steps(job, dir / "second.jsonl", 1, seconds(60))) << job.output();
  const pid_t rank0 = find_rank(job.pid(), 0);
  ASSERT_GT(rank0, 0);
  const auto sent = Clock::now();
  ASSERT_EQ(::kill(rank0, SIGINT), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(::kill(rank0, SIGINT), 0);
  const int status = job.wait(seconds(60));
  const double waited = std::chrono::duration<double>(Clock::now() - sent).count();
  const std::string output = job.output();
  EXPECT_NE(status, 0) << output;
  EXPECT_LT(waited, 20.0) << output;
  EXPECT_TRUE(contains(output, "a second SIGINT (Ctrl-C): ending now")) << output;
  EXPECT_FALSE(job.anything_left());
  EXPECT_EQ(latest_step(dir / "run"), saved) << output;
  EXPECT_TRUE(io::CheckpointReader(dir / ("run/" + step_name(saved))).verify().empty());
}

// A --save directory removed while a job runs: the job makes it again, takes
// its lock again and says so, so a second job is still refused; and when a
// second job with another model took the directory in the meantime, the
// first stops at its next save instead of writing into the other's
// checkpoints. Rank 0 sleeps 2 s per step (TESSERA_FAULT=slow) and saves are
// synchronous, so the directory is removed between saves.
TEST(SaveDirectory, RemovedDuringTheRunIsLockedAgainOrTheRunStops) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_processes_");
  std::mt19937_64 rng = make_rng();
  const std::string data = write_image_dataset(dir.path, 256, 6, 5, 4, rng);
  const uint64_t seed = rng();
  const std::string save = dir / "run";
  const auto published = [&](int64_t step) { return "checkpoint: " + save + "/" + step_name(step); };
  const auto args = joined(mlp_args(data, seed), {"--save", save, "--no-async-save"});
  const auto other_model = joined(mlp_args(data, seed, "8"), {"--save", save, "--no-async-save"});
  const FaultEnvironment slow("slow:0");
  {
    Job job(tessera_command(1, joined(args, {"--save-interval", "1", "--train-steps", "6"})), dir / "retake.log");
    ASSERT_TRUE(wait_for_output(job, {published(1)}, seconds(60))) << job.output();
    fs::remove_all(save);
    ASSERT_TRUE(wait_for_output(job, {"was removed or replaced during the run; taking it again"}, seconds(60)))
        << job.output();
    const Outcome other =
        run_command(tessera_command(1, joined(other_model, {"--train-steps", "1"})), dir / "other.log", seconds(60));
    EXPECT_NE(other.status, 0) << other.output;
    EXPECT_TRUE(contains(other.output, "is in use: another job is writing its checkpoints there")) << other.output;
    EXPECT_EQ(job.wait(seconds(90)), 0) << job.output();
    EXPECT_EQ(latest_step(save), 6);
  }
  fs::remove_all(save);
  Job job(tessera_command(1, joined(args, {"--save-interval", "5", "--train-steps", "1000"})), dir / "stopped.log");
  ASSERT_TRUE(wait_for_output(job, {published(5)}, seconds(90))) << job.output();
  fs::remove_all(save);  // the next save is 5 steps (10 s) away: the other job takes the directory first
  Job other(tessera_command(1, joined(other_model, {"--save-interval", "1", "--train-steps", "1000"})),
            dir / "taker.log");
  ASSERT_TRUE(wait_for_output(other, {published(1)}, seconds(60))) << other.output();
  const int status = job.wait(seconds(60));
  const std::string output = job.output();
  EXPECT_NE(status, 0) << output;
  EXPECT_TRUE(contains(output, "is in use: another job is writing its checkpoints there")) << output;
  EXPECT_TRUE(contains(output, "this run stops without saving there")) << output;
  for (const auto& entry : fs::directory_iterator(save)) {
    if (!entry.path().filename().string().starts_with("step_")) continue;
    EXPECT_EQ(io::CheckpointReader(entry.path().string()).metadata().at("config.hidden"), "8")
        << entry.path() << " was written by the first job";
  }
}

}  // namespace
}  // namespace tessera::testing
