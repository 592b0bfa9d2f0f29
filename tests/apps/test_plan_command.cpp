// `tessera plan` in-process: the table and the name=value lines a script
// reads (parsed back, equal to the library's prediction of the layout they
// name), --explain's breakdown, layout flags fixing their axes, a TOML
// cluster file (and its unknown keys refused by line), and the refusals:
// no --cluster, a training-only flag, no layout that fits (exit 1).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "apps/plan_command.h"
#include "apps/trainer.h"
#include "core/error.h"
#include "plan/report.h"
#include "tests/support/cli_capture.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

std::string run_plan(std::vector<std::string> args, int& exit_code) {
  CLI::App app;
  app::register_plan_command(app, exit_code);
  args.insert(args.begin(), "plan");
  return parse_capturing_stdout(app, args);
}

const std::vector<std::string> kGpt = {
    "--model",      "gpt", "--num-layers", "4",  "--hidden-size",       "64", "--num-heads", "4",
    "--vocab-size", "256", "--seq-length", "64", "--global-batch-size", "8"};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::string error_of(const std::vector<std::string>& args) {
  int exit_code = -1;
  try {
    run_plan(args, exit_code);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

TEST(PlanCommand, PrintsTheRankingAndNameValueLinesOfTheBest) {
  int exit_code = -1;
  const std::string out = run_plan(with(kGpt, {"--cluster", "4xcpu:shm", "--precision", "fp32"}), exit_code);
  EXPECT_EQ(exit_code, 0);
  EXPECT_NE(out.find("rank  layout"), std::string::npos) << out;
  const std::map<std::string, std::string> values = plan::parse_name_values(out);
  for (const char* key : {"predicted_step_s", "predicted_tokens_per_s", "predicted_tflops_per_gpu", "predicted_mfu",
                          "predicted_memory_bytes", "predicted_fits", "predicted_flags"})
    EXPECT_EQ(values.count(key), 1u) << key << " in\n" << out;
  EXPECT_GT(std::stod(values.at("predicted_step_s")), 0.0);
  EXPECT_EQ(values.at("predicted_fits"), "1");
  // Tokens per second are the global batch's tokens over the step.
  EXPECT_NEAR(std::stod(values.at("predicted_tokens_per_s")), 8.0 * 64 / std::stod(values.at("predicted_step_s")),
              1e-4 * std::stod(values.at("predicted_tokens_per_s")));
}

TEST(PlanCommand, LayoutFlagsFixTheirAxesAndExplainBreaksTheStepDown) {
  int exit_code = -1;
  const std::string out =
      run_plan(with(kGpt, {"--cluster", "4xcpu:shm", "--tp", "2", "--zero", "1", "--explain"}), exit_code);
  EXPECT_EQ(exit_code, 0);
  const std::map<std::string, std::string> values = plan::parse_name_values(out);
  EXPECT_NE(values.at("predicted_flags").find("--tp 2 "), std::string::npos) << values.at("predicted_flags");
  EXPECT_NE(values.at("predicted_flags").find("--zero 1 "), std::string::npos) << values.at("predicted_flags");
  for (const char* part :
       {"compute", "tensor parallel", "data parallel", "optimizer", "memory of the fullest rank", "activations"})
    EXPECT_NE(out.find(part), std::string::npos) << part << " in\n" << out;
}

TEST(PlanCommand, ReadsAClusterFromATomlFile) {
  const fs::path dir = fs::temp_directory_path() / ("tessera_plan_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path good = dir / "cluster.toml", bad = dir / "bad.toml";
  std::ofstream(good) << "per_node = 8\nnodes = 2\n[accelerator]\nbase = \"H100-SXM\"\nname = \"H100-test\"\n"
                         "memory_gib = 40\n[intra]\nbandwidth = 100e9\nlatency = 3e-6\n[inter]\nbandwidth = 10e9\n"
                         "latency = 8e-6\n";
  std::ofstream(bad) << "per_node = 8\n[accelerator]\nbase = \"H100-SXM\"\npeak_tflops = 3\n";
  int exit_code = -1;
  const std::string out = run_plan(with(kGpt, {"--global-batch-size", "16", "--cluster", good.string()}), exit_code);
  EXPECT_EQ(exit_code, 0);
  EXPECT_NE(out.find("2 nodes x 8 H100-test"), std::string::npos) << out;
  EXPECT_NE(out.find("100 GB/s per GPU"), std::string::npos) << out;
  const std::string why = error_of(with(kGpt, {"--cluster", bad.string()}));
  EXPECT_NE(why.find(bad.string() + ":4: unknown key 'peak_tflops' in [accelerator]"), std::string::npos) << why;
  fs::remove_all(dir);
}

TEST(PlanCommand, RefusesWhatItCannotPlan) {
  ::setenv("TESSERA_CLUSTER_FILE", "/nonexistent/tessera-cluster.toml", 1);
  EXPECT_NE(error_of(kGpt).find("--cluster local: no /nonexistent/tessera-cluster.toml (measure this allocation"),
            std::string::npos);
  ::unsetenv("TESSERA_CLUSTER_FILE");
  EXPECT_NE(error_of(with(kGpt, {"--cluster", "4xcpu", "--plan"})).find("--plan is `tessera train`'s"),
            std::string::npos);
  EXPECT_NE(error_of(with(kGpt, {"--cluster", "4xcpu", "--lr", "0.1"})).find("--lr does not change"),
            std::string::npos);
  std::vector<std::string> no_vocab = kGpt;
  no_vocab.erase(no_vocab.begin() + 8, no_vocab.begin() + 10);
  EXPECT_NE(error_of(with(no_vocab, {"--cluster", "4xcpu"})).find("needs --vocab-size"), std::string::npos);
  EXPECT_NE(error_of(with(kGpt, {"--cluster", "4xQ9"})).find("unknown accelerator 'Q9'"), std::string::npos);
  // A model no layout of one CPU rank holds: exit 1, no name=value lines.
  int exit_code = -1;
  const std::string out =
      run_plan({"--model", "gpt", "--num-layers", "48", "--hidden-size", "8192", "--num-heads", "64", "--vocab-size",
                "50304", "--seq-length", "2048", "--global-batch-size", "8", "--cluster", "cpu"},
               exit_code);
  EXPECT_EQ(exit_code, 1);
  EXPECT_TRUE(plan::parse_name_values(out).empty()) << out;
}

// `tessera train --plan` trains with the plan's fastest layout for its world
// (here one rank: the micro-batch and recompute are what it chooses), and
// refuses a cluster of another size.
TEST(PlanCommand, TrainPlanPicksThePlansLayout) {
  app::TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_heads = 2;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.global_batch_size = 8;
  c.synthetic = true;
  c.train_steps = 2;
  c.plan = true;
  c.cluster = "cpu";
  c.given = {"--vocab-size"};
  plan::PlanModel pm;
  pm.model = app::model_of(c);
  pm.global_batch = 8;
  pm.dtype = app::dtype_of(c);
  pm.optimizer = app::optimizer_of(c);
  const plan::SearchResult found = plan::search_layouts(pm, plan::parse_cluster("cpu"), {});
  ASSERT_FALSE(found.ranked.empty());
  std::string chosen;
  const app::TrainConfig planned = app::with_planned_layout(c, 1, chosen);
  EXPECT_EQ(planned.micro_batch_size, found.ranked.front().layout.micro_batch);
  EXPECT_EQ(planned.recompute, found.ranked.front().layout.recompute);
  EXPECT_NE(chosen.find(found.ranked.front().layout.flags()), std::string::npos) << chosen;
  const app::TrainResult result = app::train(c);
  EXPECT_EQ(result.steps, 2);
  c.cluster = "2xcpu";
  EXPECT_THROW(app::with_planned_layout(c, 1, chosen), Error);
  try {
    app::with_planned_layout(c, 1, chosen);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has 2 accelerators but this job has 1 ranks"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::testing
