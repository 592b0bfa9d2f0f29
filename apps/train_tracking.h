// MLflow tracking of a `tessera train` run (--mlflow-uri, rank 0 only): the
// run opened (or, resuming a checkpoint that recorded one, reopened) with
// every setting as a parameter and the layout, versions and
// host as tags; each step's and evaluation's figures as metrics (queued: the
// step never waits for the server, io/mlflow.h); at the end the curves
// (curves.svg), the metrics file (metrics.jsonl) and the last checkpoint's
// path (tag tessera.checkpoint), and the run's status: FINISHED, KILLED
// (stopped by a signal or --exit-interval, to be resumed) or FAILED (an
// error ended training). A component of the training loop
// (io/training_events.h): steps and evaluations as they come, the end with
// the run's result.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "apps/train_config.h"
#include "apps/trainer.h"
#include "io/metrics.h"
#include "io/mlflow.h"
#include "io/training_events.h"

namespace tessera::app {

// What the run is, for the tags.
struct RunFacts {
  std::string layout;       // e.g. "dp=2 tp=1 pp=1 world=2"
  std::string device;       // "cpu", "cuda:0"
  std::string precision;
  int world_size = 1;
  std::string mpi_library;  // empty without MPI
  int64_t resumed_step = -1;
  // The MLflow run the resumed checkpoint's run recorded into, and its server:
  // the same run goes on when --mlflow-uri is that server (MLFLOW_RUN_ID first).
  std::string resumed_run_id, resumed_uri;
};

class RunTracking : public io::TrainingComponent {
 public:
  // Off (every call does nothing) without --mlflow-uri or on ranks other than 0.
  // `result`: what the run's end records (the last checkpoint).
  RunTracking(const TrainConfig& config, bool root, const RunFacts& facts, const TrainResult& result);
  ~RunTracking() override;  // without finish(): the run ends as FAILED

  void on_step_end(io::StepEnd& end) override { log_step(end.record); }
  void on_evaluation(const io::EvalEnd& eval) override { log_eval(eval.record); }
  // KILLED when the run stopped early (to be resumed), FINISHED otherwise.
  void on_run_end(const io::RunEnd& end) override { finish(result_, !end.stop_reason.empty()); }

  // The MLflow run's id once the server gave it ("" before, and when off).
  std::string run_id() const { return run_ ? run_->run_id() : ""; }
  void log_step(const io::StepRecord& record);
  void log_eval(const io::EvalRecord& record);
  // Artifacts and the final status, waiting at most --mlflow-timeout for the
  // server; prints where the run is, or warns what was not recorded.
  void finish(const TrainResult& result, bool stopped_early);

 private:
  void queue_artifacts();

  const TrainConfig& config_;
  const TrainResult& result_;
  std::unique_ptr<io::MlflowRun> run_;
  io::MetricsLog log_;  // this process's records, for the curves when there is no --metrics file
};

}  // namespace tessera::app
