// MLflow tracking from C++: a run recorded through the tracking server's REST
// API (/api/2.0/mlflow/..., spoken by MLflow 1.x to 3.x) with cpp-httplib and
// nlohmann::json. Behind `train --mlflow-uri URI --mlflow-experiment NAME`.
//
//   MlflowClient: the calls, synchronous, each throwing MlflowError with the
//     endpoint and the server's own message (tests and tools use it directly).
//   MlflowRun: one run recorded from a background thread. The training thread
//     only appends to a queue; the thread creates the run (or reopens
//     MLFLOW_RUN_ID's), sends parameters and tags, sends metrics in batches of
//     up to 1000 (log-batch) at most once a second, uploads artifacts through
//     the server's artifact proxy (mlflow-artifacts:, `mlflow server`'s
//     default) and ends the run. A server that is slow, down or gone never
//     slows or stops training: the first failure and the recovery are one
//     warning each, what is queued is retried, and finish() waits a bounded
//     time and says what could not be recorded.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tessera::io {

using MlflowPairs = std::vector<std::pair<std::string, std::string>>;

// Now in MLflow's timestamps: milliseconds since the Unix epoch.
int64_t unix_time_ms();

struct MlflowMetric {
  std::string key;
  double value = 0.0;  // NaN and infinities are sent as MLflow reads them
  int64_t timestamp_ms = 0;
  int64_t step = 0;
};

// How to reach the server: the URI and, from MLflow's own environment
// variables, a bearer token (MLFLOW_TRACKING_TOKEN) or a user and password
// (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD).
struct MlflowServer {
  std::string uri;  // http(s)://host:port[/prefix]
  std::string token, username, password;
  double timeout_seconds = 10.0;  // per request
  static MlflowServer from_environment(std::string uri);
};

// A call the server refused or did not answer; what() names the endpoint and
// carries the server's message.
class MlflowError : public std::runtime_error {
 public:
  MlflowError(const std::string& message, int http_status) : std::runtime_error(message), http_status_(http_status) {}
  int http_status() const { return http_status_; }  // 0: no answer (refused, timed out)
  bool retryable() const { return http_status_ == 0 || http_status_ == 429 || http_status_ >= 500; }

 private:
  int http_status_;
};

struct MlflowRunInfo {
  std::string run_id, experiment_id, artifact_uri, status, run_name;
  MlflowPairs params;  // what the server holds (get_run only)
};

class MlflowClient {
 public:
  explicit MlflowClient(MlflowServer server);  // throws tessera::Error for a malformed URI

  // The experiment's id; created when there is none of that name.
  std::string experiment_id(const std::string& name);
  MlflowRunInfo create_run(const std::string& experiment_id, const std::string& run_name, const MlflowPairs& tags,
                           int64_t start_ms);
  MlflowRunInfo get_run(const std::string& run_id);
  void set_status(const std::string& run_id, const std::string& status, int64_t end_ms = 0);  // RUNNING, FINISHED, ...
  // At most 1000 metrics, 100 parameters and 100 tags per call (the server's limits).
  void log_batch(const std::string& run_id, const std::vector<MlflowMetric>& metrics, const MlflowPairs& params,
                 const MlflowPairs& tags);
  // `relative_path` under the run's artifact root; the root must be served by
  // the server (mlflow-artifacts:/...) or be a local directory (file:/...).
  void upload_artifact(const MlflowRunInfo& run, const std::string& relative_path, const std::string& bytes);
  // The run's page in the MLflow UI.
  std::string run_page(const MlflowRunInfo& run) const;

 private:
  std::string call(const std::string& method, const std::string& endpoint, const std::string& body);

  MlflowServer server_;
  std::string base_, prefix_;
};

struct MlflowRunOptions {
  MlflowServer server;
  std::string experiment = "Default";
  std::string run_name;  // empty: the server picks one
  std::string run_id;    // an existing run to go on with (MLFLOW_RUN_ID, or a resumed checkpoint's); empty: a new run
  MlflowPairs params, tags;
  double finish_timeout_seconds = 30.0;  // how long finish() waits for the queue to reach the server
  double batch_interval_seconds = 1.0;   // metrics are sent at most this often
  size_t max_queued_metrics = 1'000'000;  // beyond this new metrics are dropped (and counted)
};

struct MlflowOutcome {
  std::string run_id;         // empty: the run was never created
  std::string run_page;       // the UI's page of the run
  int64_t metrics_sent = 0;
  int64_t metrics_lost = 0;   // dropped or still queued when finish() gave up
  int64_t artifacts_lost = 0;
  int64_t items_refused = 0;  // batches or artifacts the server refused (each said in a warning)
  bool ended = false;         // the server took the final status
};

class MlflowRun {
 public:
  // Starts the thread; nothing here waits for the server. `warn` receives one
  // line per change (failing, recovered) and is called on that thread.
  MlflowRun(MlflowRunOptions options, std::function<void(const std::string&)> warn);
  ~MlflowRun();  // without finish(): ends the run as FAILED (a training error), same bounded wait
  MlflowRun(const MlflowRun&) = delete;
  MlflowRun& operator=(const MlflowRun&) = delete;

  void log_metrics(std::vector<MlflowMetric> metrics);
  void set_tag(std::string key, std::string value);
  void add_artifact(std::string relative_path, std::string bytes);
  // Sends what is queued, ends the run with `status` (FINISHED, FAILED,
  // KILLED), waiting at most finish_timeout_seconds; once. A server that has
  // never answered is tried once more and, still silent, given up at once.
  MlflowOutcome finish(const std::string& status = "FINISHED");
  // The run's id once the server gave it (empty before, or when it never did).
  std::string run_id();

 private:
  struct Artifact {
    std::string path, bytes;
  };
  void run();
  void send_queued(std::unique_lock<std::mutex>& lock);
  // Runs `call` with the lock released; false when the server refused it
  // (said as "`what` not recorded", unless `what` is empty).
  bool send(std::unique_lock<std::mutex>& lock, const std::string& what, const std::function<void()>& call);
  MlflowRunInfo open_run();
  void give_up(const MlflowError& failure);

  MlflowRunOptions options_;
  std::function<void(const std::string&)> warn_;
  std::unique_ptr<MlflowClient> client_;

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<MlflowMetric> metrics_;
  MlflowPairs tags_;
  std::deque<Artifact> artifacts_;
  std::string final_status_;  // set by finish(): send everything, then end
  bool stopping_ = false, ended_ = false, failing_ = false, finish_tried_ = false;
  bool answered_ = false;          // the server has answered some call (success or an HTTP error)
  int64_t unanswered_calls_ = 0;   // calls that got no answer (refused, timed out)
  MlflowRunInfo info_;
  size_t params_sent_ = 0;
  MlflowOutcome outcome_;
  std::thread thread_;
};

}  // namespace tessera::io
