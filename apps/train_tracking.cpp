// RunTracking (apps/train_tracking.h): a TrainConfig and its records turned
// into an MLflow run.
#include "apps/train_tracking.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/plot.h"

namespace tessera::app {
namespace {

std::string env_or(const char* name, std::string fallback) {
  const char* value = std::getenv(name);
  return value && *value ? value : fallback;
}

io::MlflowPairs run_tags(const TrainConfig& c, const RunFacts& facts) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  io::MlflowPairs tags = {{"mlflow.source.name", "tessera train"},
                          {"mlflow.source.type", "JOB"},
                          {"mlflow.user", env_or("USER", env_or("LOGNAME", "unknown"))},
                          {"tessera.version", TESSERA_VERSION},
                          {"tessera.model", std::string(nn::model_name(c.model))},
                          {"tessera.layout", facts.layout},
                          {"tessera.world_size", std::to_string(facts.world_size)},
                          {"tessera.device", facts.device},
                          {"tessera.precision", facts.precision},
                          {"tessera.host", host}};
  if (!facts.mpi_library.empty()) tags.emplace_back("tessera.mpi", facts.mpi_library);
  if (const char* job = std::getenv("SLURM_JOB_ID")) tags.emplace_back("tessera.slurm_job_id", job);
  if (facts.resumed_step >= 0) tags.emplace_back("tessera.resumed_at_step", std::to_string(facts.resumed_step));
  return tags;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Where the --save directory remembers its MLflow run: written at the end of
// each part (a checkpoint saved before the server answered lacks the id).
std::filesystem::path run_file(const TrainConfig& c) {
  return std::filesystem::path(c.save) / "mlflow-run.json";
}

// The run a resumed training goes on with: the checkpoint's, else the --save
// directory's, when it was recorded on this --mlflow-uri ("" otherwise).
std::string resumed_run(const TrainConfig& c, const RunFacts& facts) {
  if (facts.resumed_step < 0) return "";
  if (!facts.resumed_run_id.empty()) return facts.resumed_uri == c.mlflow_uri ? facts.resumed_run_id : "";
  if (c.save.empty()) return "";
  const nlohmann::json saved = nlohmann::json::parse(read_file(run_file(c).string()), nullptr, false);
  if (!saved.is_object() || saved.value("mlflow_uri", "") != c.mlflow_uri) return "";
  return saved.value("run_id", "");
}

void remember_run(const TrainConfig& c, const std::string& run_id) {
  if (c.save.empty() || run_id.empty()) return;
  const std::filesystem::path file = run_file(c), temporary = file.string() + ".tmp";
  std::ofstream(temporary) << nlohmann::json{{"mlflow_uri", c.mlflow_uri}, {"run_id", run_id}}.dump() << "\n";
  std::error_code error;
  std::filesystem::rename(temporary, file, error);
}

}  // namespace

RunTracking::RunTracking(const TrainConfig& c, bool root, const RunFacts& facts, const TrainResult& result)
    : config_(c), result_(result) {
  if (!root || c.mlflow_uri.empty()) return;
  io::MlflowRunOptions options;
  options.server = io::MlflowServer::from_environment(c.mlflow_uri);
  options.experiment = !c.mlflow_experiment.empty() ? c.mlflow_experiment : env_or("MLFLOW_EXPERIMENT_NAME", "Default");
  options.run_name = c.mlflow_run_name;
  options.run_id = env_or("MLFLOW_RUN_ID", resumed_run(c, facts));
  for (const auto& [key, value] : settings(c)) options.params.emplace_back(key, value);
  options.tags = run_tags(c, facts);
  options.finish_timeout_seconds = c.mlflow_timeout;
  options.server.timeout_seconds = std::min(10.0, c.mlflow_timeout);
  // Said from the tracking thread, on stderr (the progress line belongs to the training thread).
  run_ = std::make_unique<io::MlflowRun>(std::move(options), [](const std::string& line) {
    std::fprintf(stderr, "tessera: warning: %s\n", line.c_str());
  });
}

RunTracking::~RunTracking() = default;

void RunTracking::log_step(const io::StepRecord& r) {
  if (!run_) return;
  log_.steps.push_back(r);
  const int64_t now = io::unix_time_ms();
  std::vector<io::MlflowMetric> metrics = {{"loss", r.loss, now, r.step},
                                           {"lr", r.lr, now, r.step},
                                           {"ms_per_step", r.ms_per_step, now, r.step}};
  auto optional = [&](const char* key, const std::optional<double>& value) {
    if (value) metrics.push_back({key, *value, now, r.step});
  };
  optional("samples_per_s", r.samples_per_s);
  optional("tokens_per_s", r.tokens_per_s);
  optional("grad_norm", r.grad_norm);
  optional("loss_scale", r.loss_scale);
  if (r.skipped) metrics.push_back({"skipped", 1.0, now, r.step});
  for (const auto& [key, value] : r.extra) metrics.push_back({key, value, now, r.step});
  run_->log_metrics(std::move(metrics));
}

void RunTracking::log_eval(const io::EvalRecord& r) {
  if (!run_) return;
  log_.evals.push_back(r);
  const int64_t now = io::unix_time_ms();
  std::vector<io::MlflowMetric> metrics = {{"eval_loss", r.eval_loss, now, r.step}};
  if (r.eval_accuracy) metrics.push_back({"eval_accuracy", *r.eval_accuracy, now, r.step});
  if (r.eval_bits_per_byte) metrics.push_back({"eval_bits_per_byte", *r.eval_bits_per_byte, now, r.step});
  run_->log_metrics(std::move(metrics));
}

// curves.svg and metrics.jsonl: from the --metrics file, which holds the
// whole history (a resumed run appends to it), else from this process's records.
void RunTracking::queue_artifacts() {
  const bool have_file = !config_.metrics.empty() && std::filesystem::exists(config_.metrics);
  const io::MetricsLog log = have_file ? io::read_metrics(config_.metrics) : log_;
  if (!log.steps.empty() || !log.evals.empty()) {
    io::PlotOptions plot;
    plot.title = config_.mlflow_run_name.empty() ? "tessera train" : config_.mlflow_run_name;
    run_->add_artifact("curves.svg", io::render_metrics_svg(log, plot));
  }
  if (have_file) {
    run_->add_artifact("metrics.jsonl", read_file(config_.metrics));
    return;
  }
  std::string lines;
  for (const io::StepRecord& step : log_.steps) lines += io::step_json_line(step) + "\n";
  for (const io::EvalRecord& eval : log_.evals) lines += io::eval_json_line(eval) + "\n";
  run_->add_artifact("metrics.jsonl", lines);
}

void RunTracking::finish(const TrainResult& result, bool stopped_early) {
  if (!run_) return;
  try {
    queue_artifacts();
  } catch (const std::exception& error) {  // the run's record must not fail the training that just ended
    std::fprintf(stderr, "tessera: warning: MLflow: no curves or metrics file recorded: %s\n", error.what());
  }
  if (!result.checkpoint.empty())
    run_->set_tag("tessera.checkpoint", std::filesystem::absolute(result.checkpoint).string());
  const io::MlflowOutcome outcome = run_->finish(stopped_early ? "KILLED" : "FINISHED");
  remember_run(config_, outcome.run_id);
  if (outcome.run_id.empty()) {
    std::fprintf(stderr,
                 "tessera: warning: MLflow at %s: the run was not recorded (%lld metric values not sent); the "
                 "metrics file and the checkpoints have everything\n",
                 config_.mlflow_uri.c_str(), static_cast<long long>(outcome.metrics_lost));
    return;
  }
  if (outcome.metrics_lost || outcome.artifacts_lost || !outcome.ended) {
    std::fprintf(stderr,
                 "tessera: warning: MLflow: run %s is missing %lld metric values and %lld artifacts%s (the server "
                 "did not take them within --mlflow-timeout %g s); %s\n",
                 outcome.run_id.c_str(), static_cast<long long>(outcome.metrics_lost),
                 static_cast<long long>(outcome.artifacts_lost), outcome.ended ? "" : ", and still shows RUNNING",
                 config_.mlflow_timeout, outcome.run_page.c_str());
    return;
  }
  std::printf("mlflow: run %s recorded (%lld metric values): %s\n", outcome.run_id.c_str(),
              static_cast<long long>(outcome.metrics_sent), outcome.run_page.c_str());
}

}  // namespace tessera::app
