// MLflow tracking against a real MLflow server (PyPI mlflow, pinned, in the
// venv scripts/install-mlflow.sh makes), started here on loopback with a
// SQLite store and a proxied artifact store, and read back with MLflow's own
// Python client (not Tessera's code): a 2-rank run's parameters are the
// flags it was given, its loss history is the metrics file's, its artifacts
// are the file itself and the curves `tessera plot` draws from it, its tags
// the layout and the checkpoint. A server stopped in the middle of a run, or
// none at all, costs a warning: training finishes, the checkpoint and the
// metrics file are whole, and what reached the server is a prefix of them.
// A run resumed from a checkpoint goes on in the MLflow run it began.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "io/metrics.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

fs::path mlflow_venv() {
  const char* tools = std::getenv("TESSERA_TOOLS_DIR");
  return fs::path(tools && *tools ? tools : "/opt/tessera-tools") / "mlflow";
}

bool healthy(int port) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  const auto result = client.Get("/health");
  return result && result->status == 200;
}

std::vector<std::string> quiet_environment() {
  return job_environment({}, {"MLFLOW_DISABLE_TELEMETRY=true", "DO_NOT_TRACK=true"});
}

// `mlflow server` on 127.0.0.1:port over the store in `dir` (kept between starts).
class TrackingServer {
 public:
  TrackingServer(const fs::path& dir, int port)
      : job_({(mlflow_venv() / "bin" / "mlflow").string(), "server", "--host", "127.0.0.1", "--port",
              std::to_string(port), "--workers", "1", "--backend-store-uri", "sqlite:///" + (dir / "mlflow.db").string(),
              "--artifacts-destination", (dir / "artifacts").string()},
             dir / ("mlflow-" + std::to_string(starts(dir)) + ".log"), quiet_environment()) {
    const auto deadline = Clock::now() + seconds(120);
    while (Clock::now() < deadline && job_.running() && !healthy(port)) std::this_thread::sleep_for(std::chrono::milliseconds(250));
    up_ = healthy(port);
  }
  bool up() const { return up_; }
  std::string output() const { return job_.output(); }
  void stop() {
    ::kill(-job_.pid(), SIGKILL);  // the server and its workers, at once (as a crashed node)
    job_.wait(seconds(30));
  }

 private:
  static int starts(const fs::path& dir) {
    int n = 0;
    while (fs::exists(dir / ("mlflow-" + std::to_string(n) + ".log"))) ++n;
    return n;
  }
  Job job_;
  bool up_ = false;
};

// What the server holds of the experiment's only run, read by MLflow's own client.
Json read_back(int port, const std::string& experiment, const fs::path& dir) {
  std::ofstream(dir / "read_back.py") << R"(import json, sys
from mlflow.tracking import MlflowClient
client = MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name(sys.argv[2])
runs = client.search_runs([experiment.experiment_id])
run = runs[0]
out = {"runs": len(runs), "status": run.info.status, "run_name": run.info.run_name,
       "params": run.data.params, "tags": run.data.tags,
       "loss": [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, "loss")],
       "artifacts": sorted(a.path for a in client.list_artifacts(run.info.run_id))}
for name in out["artifacts"]:
    with open(client.download_artifacts(run.info.run_id, name, sys.argv[3])) as f:
        out[name] = f.read()
print(json.dumps(out))
)";
  fs::create_directories(dir / "downloads");
  const Outcome read = run_command({(mlflow_venv() / "bin" / "python").string(), (dir / "read_back.py").string(),
                                    "http://127.0.0.1:" + std::to_string(port), experiment, (dir / "downloads").string()},
                                   dir / "read_back.log", seconds(120), quiet_environment());
  EXPECT_EQ(read.status, 0) << read.output;
  const size_t json_line = read.output.rfind("\n{\"runs\"");
  return Json::parse(read.output.substr(json_line == std::string::npos ? 0 : json_line + 1), nullptr, false);
}

// How many loss values the experiment's first run holds now, through the REST API (-1: none yet).
int losses_recorded(int port, const std::string& experiment) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(2);
  const auto found = client.Get("/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + experiment);
  if (!found || found->status != 200) return -1;
  const Json search = {{"experiment_ids", {Json::parse(found->body)["experiment"]["experiment_id"]}}};
  const auto runs = client.Post("/api/2.0/mlflow/runs/search", search.dump(), "application/json");
  if (!runs || runs->status != 200) return -1;
  const Json listed = Json::parse(runs->body);
  if (!listed.contains("runs")) return -1;
  const std::string run_id = listed["runs"][0]["info"]["run_id"];
  const auto history = client.Get("/api/2.0/mlflow/metrics/get-history?metric_key=loss&run_id=" + run_id);
  if (!history || history->status != 200) return -1;
  const Json metrics = Json::parse(history->body);
  return metrics.contains("metrics") ? int(metrics["metrics"].size()) : 0;
}

std::string file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The metrics file's (step, loss) pairs.
std::vector<std::pair<int64_t, double>> file_losses(const fs::path& metrics) {
  std::vector<std::pair<int64_t, double>> out;
  for (const io::StepRecord& step : io::read_metrics(metrics).steps) out.emplace_back(step.step, step.loss);
  return out;
}

std::vector<std::pair<int64_t, double>> server_losses(const Json& run) {
  std::vector<std::pair<int64_t, double>> out;
  for (const Json& point : run["loss"]) out.emplace_back(point[0].get<int64_t>(), point[1].get<double>());
  std::sort(out.begin(), out.end());
  return out;
}

#define SKIP_WITHOUT_MLFLOW()                                                                        \
  if (!fs::exists(mlflow_venv() / "bin" / "mlflow"))                                                 \
  GTEST_SKIP() << "no MLflow server in " << mlflow_venv() << ": run scripts/install-deps.sh (it runs " \
                  "scripts/install-mlflow.sh)"

TEST(Tracking, MlflowRecordsEveryFlagTheLossHistoryTheCurvesAndTheCheckpoint) {
  SKIP_WITHOUT_MLFLOW();
  ScratchDirectory dir("tessera_mlflow_");
  const int port = free_port();
  TrackingServer server(dir.path, port);
  ASSERT_TRUE(server.up()) << server.output();

  // Flags given in the text form the settings print them in, so each is its parameter's value.
  const std::vector<std::pair<std::string, std::string>> flags = {
      {"--model", "gpt"},          {"--vocab-size", "64"},     {"--seq-length", "16"},
      {"--num-layers", "1"},       {"--num-heads", "2"},       {"--hidden-size", "32"},
      {"--micro-batch-size", "4"}, {"--train-steps", "24"},    {"--lr", "0.003"},
      {"--tensor-parallel", "2"},  {"--threads", "1"},         {"--log-interval", "6"},
      {"--seed", "77"},            {"--mlflow-experiment", "tracking-test"}, {"--mlflow-run-name", "tp2-run"}};
  std::vector<std::string> args = {"--synthetic", "--metrics", (dir / "metrics.jsonl"), "--save",
                                   (dir / "ckpt"), "--mlflow-uri", "http://127.0.0.1:" + std::to_string(port)};
  for (const auto& [flag, value] : flags) args.insert(args.end(), {flag, value});
  const Outcome train = run_command(tessera_command(2, args), dir / "train.log", seconds(150), quiet_environment());
  ASSERT_EQ(train.status, 0) << train.output;
  EXPECT_TRUE(contains(train.output, "mlflow: run ")) << train.output;
  EXPECT_FALSE(contains(train.output, "warning: MLflow")) << train.output;

  const Json run = read_back(port, "tracking-test", dir.path);
  ASSERT_FALSE(run.is_discarded());
  EXPECT_EQ(run["runs"], 1);
  EXPECT_EQ(run["status"], "FINISHED");
  EXPECT_EQ(run["run_name"], "tp2-run");
  for (const auto& [flag, value] : flags) {
    const std::string key = flag.substr(2);
    ASSERT_TRUE(run["params"].contains(key)) << "no parameter " << key << " in " << run["params"].dump();
    EXPECT_EQ(run["params"][key], value) << key;
  }
  EXPECT_GT(run["params"].size(), 60u) << "every setting is a parameter, the defaults too";
  EXPECT_EQ(run["params"]["zero"], "0");
  EXPECT_EQ(run["tags"]["tessera.layout"], "dp=1 tp=2 pp=1");
  EXPECT_EQ(run["tags"]["tessera.world_size"], "2");
  const std::string checkpoint = run["tags"].value("tessera.checkpoint", "");
  EXPECT_TRUE(fs::exists(checkpoint) && fs::path(checkpoint).filename() == step_name(24)) << checkpoint;

  // The loss history is the metrics file's, every step, the same doubles.
  const auto expected = file_losses(dir / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 24u);
  EXPECT_EQ(server_losses(run), expected);
  // The artifacts: the metrics file itself, and the curves `tessera plot` draws from it.
  EXPECT_EQ(run["artifacts"], Json::array({"curves.svg", "metrics.jsonl"}));
  EXPECT_EQ(run.value("metrics.jsonl", ""), file_text(dir / "metrics.jsonl"));
  const Outcome plot = run_command({TESSERA_BINARY, "plot", (dir / "metrics.jsonl"), "--title", "tp2-run",
                                    "-o", (dir / "curves.svg")},
                                   dir / "plot.log", seconds(60));
  ASSERT_EQ(plot.status, 0) << plot.output;
  EXPECT_EQ(run.value("curves.svg", ""), file_text(dir / "curves.svg"));
}

TEST(Tracking, AServerStoppedMidRunCostsAWarningNotTheTraining) {
  SKIP_WITHOUT_MLFLOW();
  ScratchDirectory dir("tessera_mlflow_stop_");
  const int port = free_port();
  auto server = std::make_unique<TrackingServer>(dir.path, port);
  ASSERT_TRUE(server->up()) << server->output();

  std::vector<std::string> environment = quiet_environment();
  // 2 s pauses as steps 10, 11 and 12 begin: the server is stopped meanwhile.
  environment.push_back("TESSERA_FAULT=slow@10:0,slow@11:0,slow@12:0");
  Job train(tessera_command(1, words("--model mlp --synthetic --hidden 32 --micro-batch-size 8 --train-steps 40 "
                                     "--threads 1 --log-interval 1 --mlflow-experiment stopped --mlflow-timeout 3 "
                                     "--mlflow-uri http://127.0.0.1:" +
                                     std::to_string(port) + " --metrics " + (dir / "metrics.jsonl") +
                                     " --save " + (dir / "ckpt"))),
            dir / "train.log", environment);
  // Stopped once the server holds the loss of steps 1-9 (read through its REST API).
  ASSERT_TRUE(wait_for_steps(train, dir / "metrics.jsonl", 9, seconds(120))) << train.output();
  const auto deadline = Clock::now() + seconds(30);
  while (Clock::now() < deadline && losses_recorded(port, "stopped") < 9)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_GE(losses_recorded(port, "stopped"), 9) << train.output();
  server->stop();
  const auto start = Clock::now();
  ASSERT_EQ(train.wait(seconds(120)), 0) << train.output();
  const double after_stop = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string output = train.output();
  EXPECT_TRUE(contains(output, "tessera: warning: MLflow: POST http://127.0.0.1:")) << output;
  EXPECT_TRUE(contains(output, "training goes on")) << output;
  EXPECT_TRUE(contains(output, "within --mlflow-timeout 3 s")) << output;
  EXPECT_LT(after_stop, 60.0) << "the end of training waits --mlflow-timeout, not for the server";
  // Nothing lost where it matters: every step in the metrics file, the last checkpoint written.
  const auto steps = file_losses(dir / "metrics.jsonl");
  EXPECT_EQ(steps.size(), 40u);
  EXPECT_TRUE(fs::exists(dir.path / "ckpt" / step_name(40))) << output;

  // What reached the server before it stopped is the run's beginning, exactly; the run still shows RUNNING.
  server.reset();
  TrackingServer again(dir.path, port);
  ASSERT_TRUE(again.up()) << again.output();
  const Json run = read_back(port, "stopped", dir.path);
  ASSERT_FALSE(run.is_discarded());
  EXPECT_EQ(run["status"], "RUNNING");
  const auto recorded = server_losses(run);
  ASSERT_GE(recorded.size(), 9u);
  ASSERT_LT(recorded.size(), 40u);
  EXPECT_TRUE(std::equal(recorded.begin(), recorded.end(), steps.begin()));
}

// "mlflow: run <id> recorded ..." → <id>.
std::string recorded_run(const std::string& output) {
  const size_t at = output.find("mlflow: run ");
  if (at == std::string::npos) return "";
  const size_t start = at + std::string("mlflow: run ").size();
  return output.substr(start, output.find(' ', start) - start);
}

TEST(Tracking, AResumedRunGoesOnInTheSameMlflowRun) {
  SKIP_WITHOUT_MLFLOW();
  ScratchDirectory dir("tessera_mlflow_resume_");
  const int port = free_port();
  TrackingServer server(dir.path, port);
  ASSERT_TRUE(server.up()) << server.output();
  // The same command twice: it stops at step 10 (--exit-interval), then resumes from the checkpoint to 20.
  const auto command = tessera_command(
      1, words("--model mlp --synthetic --hidden 32 --micro-batch-size 8 --train-steps 20 --exit-interval 10 "
               "--threads 1 --log-interval 5 --resume auto --mlflow-experiment resumed --mlflow-uri http://127.0.0.1:" +
               std::to_string(port) + " --save " + (dir / "ckpt") + " --metrics " + (dir / "metrics.jsonl")));
  const Outcome first = run_command(command, dir / "first.log", seconds(120), quiet_environment());
  ASSERT_EQ(first.status, 0) << first.output;
  // The second part pauses 2 s at step 12 (the run reopened by then): its step-20 checkpoint records the run.
  std::vector<std::string> slow = quiet_environment();
  slow.push_back("TESSERA_FAULT=slow@12:0");
  const Outcome second = run_command(command, dir / "second.log", seconds(120), slow);
  ASSERT_EQ(second.status, 0) << second.output;
  ASSERT_FALSE(recorded_run(first.output).empty()) << first.output;
  EXPECT_EQ(recorded_run(second.output), recorded_run(first.output)) << second.output;
  EXPECT_FALSE(contains(second.output, "warning: MLflow")) << second.output;

  // A third part from that checkpoint into another --save directory (no mlflow-run.json there): the
  // checkpoint's own record of the run is what continues it.
  const Outcome third = run_command(
      tessera_command(1, words("--model mlp --synthetic --hidden 32 --micro-batch-size 8 --train-steps 25 "
                               "--threads 1 --log-interval 5 --mlflow-experiment resumed --mlflow-uri http://127.0.0.1:" +
                               std::to_string(port) + " --resume " + (dir / "ckpt/step_00000020") + " --save " +
                               (dir / "other") + " --metrics " + (dir / "metrics.jsonl"))),
      dir / "third.log", seconds(120), quiet_environment());
  ASSERT_EQ(third.status, 0) << third.output;
  EXPECT_EQ(recorded_run(third.output), recorded_run(first.output)) << third.output;

  const Json run = read_back(port, "resumed", dir.path);
  ASSERT_FALSE(run.is_discarded());
  EXPECT_EQ(run["runs"], 1);
  EXPECT_EQ(run["status"], "FINISHED");
  EXPECT_EQ(run["tags"]["tessera.resumed_at_step"], "20");
  const auto expected = file_losses(dir / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 25u);
  EXPECT_EQ(server_losses(run), expected);
  EXPECT_EQ(run.value("metrics.jsonl", ""), file_text(dir / "metrics.jsonl"));
}

TEST(Tracking, NoServerAtAllIsAWarningAndABadUriIsRefused) {
  ScratchDirectory dir("tessera_mlflow_none_");
  const Outcome run = run_command(
      tessera_command(1, words("--model mlp --synthetic --hidden 32 --micro-batch-size 8 --train-steps 5 --threads 1 "
                               "--mlflow-timeout 2 --mlflow-uri http://127.0.0.1:" +
                               std::to_string(free_port()))),
      dir / "none.log", seconds(90));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "the run was not recorded")) << run.output;
  EXPECT_TRUE(contains(run.output, "done: 5 steps")) << run.output;

  const Outcome bad = run_command(
      tessera_command(1, words("--model mlp --synthetic --train-steps 5 --mlflow-uri mlflow:5000")), dir / "bad.log",
      seconds(60));
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.output, "--mlflow-uri mlflow:5000: give the http:// or https:// URL")) << bad.output;
  const Outcome orphan = run_command(
      tessera_command(1, words("--model mlp --synthetic --train-steps 5 --mlflow-experiment x")), dir / "orphan.log",
      seconds(60));
  EXPECT_NE(orphan.status, 0);
  EXPECT_TRUE(contains(orphan.output, "give the tracking server's URL too")) << orphan.output;
}

}  // namespace
}  // namespace tessera::testing
