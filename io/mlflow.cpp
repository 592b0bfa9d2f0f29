// MlflowClient and MlflowRun (io/mlflow.h): the REST calls as JSON over
// cpp-httplib, and the background thread that records one run.
#include "io/mlflow.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/http_url.h"

namespace tessera::io {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxMetricsPerBatch = 1000, kMaxParamsPerBatch = 100, kMaxTagsPerBatch = 100;
constexpr size_t kMaxParamValue = 6000;  // MLflow 2.x and 3.x refuse longer parameter values

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// Doubles as protobuf's JSON mapping reads them: non-finite values as strings.
Json metric_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

Json key_values(const MlflowPairs& pairs) {
  Json out = Json::array();
  for (const auto& [key, value] : pairs) out.push_back({{"key", key}, {"value", value}});
  return out;
}

MlflowRunInfo run_info(const Json& run) {
  const Json& info = run.at("info");
  MlflowRunInfo out{info.value("run_id", ""), info.value("experiment_id", ""), info.value("artifact_uri", ""),
                    info.value("status", ""), info.value("run_name", ""), {}};
  if (run.contains("data") && run["data"].contains("params"))
    for (const Json& param : run["data"]["params"])
      out.params.emplace_back(param.value("key", ""), param.value("value", ""));
  return out;
}

// "mlflow-artifacts:/1/abc/artifacts" or "mlflow-artifacts://host:5000/1/abc/artifacts" → "1/abc/artifacts".
std::string proxied_artifact_path(const std::string& uri) {
  std::string rest = uri.substr(std::string("mlflow-artifacts:").size());
  if (rest.rfind("//", 0) == 0) {
    const size_t path = rest.find('/', 2);
    rest = path == std::string::npos ? "" : rest.substr(path);
  }
  while (!rest.empty() && rest.front() == '/') rest.erase(0, 1);
  return rest;
}

void write_local_artifact(const std::string& root_uri, const std::string& relative_path, const std::string& bytes) {
  std::string root = root_uri.substr(std::string("file:").size());
  if (root.rfind("//", 0) == 0) root.erase(0, 2);  // file:///abs → /abs
  const std::filesystem::path target = std::filesystem::path(root) / relative_path;
  std::filesystem::create_directories(target.parent_path());
  std::ofstream out(target, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) throw MlflowError("cannot write the artifact " + target.string(), 400);
}

}  // namespace

int64_t unix_time_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

MlflowServer MlflowServer::from_environment(std::string uri) {
  MlflowServer server;
  server.uri = std::move(uri);
  server.token = env_or_empty("MLFLOW_TRACKING_TOKEN");
  server.username = env_or_empty("MLFLOW_TRACKING_USERNAME");
  server.password = env_or_empty("MLFLOW_TRACKING_PASSWORD");
  return server;
}

MlflowClient::MlflowClient(MlflowServer server) : server_(std::move(server)) {
  HttpUrl url = parse_http_url(server_.uri, "--mlflow-uri", "http://mlflow:5000", true);
  base_ = std::move(url.base);
  prefix_ = std::move(url.prefix);
}

std::string MlflowClient::call(const std::string& method, const std::string& endpoint, const std::string& body) {
  httplib::Client client(base_);
  const auto timeout = std::chrono::milliseconds(int64_t(server_.timeout_seconds * 1e3));
  client.set_connection_timeout(timeout);
  client.set_read_timeout(timeout);
  client.set_write_timeout(timeout);
  if (!server_.token.empty()) client.set_bearer_token_auth(server_.token);
  if (!server_.username.empty()) client.set_basic_auth(server_.username, server_.password);
  const std::string path = prefix_ + endpoint;
  httplib::Result result = method == "GET"  ? client.Get(path)
                           : method == "PUT" ? client.Put(path, body, "application/octet-stream")
                                             : client.Post(path, body, "application/json");
  const std::string where = method + " " + base_ + path;
  if (!result) throw MlflowError(where + ": " + httplib::to_string(result.error()), 0);
  if (result->status >= 200 && result->status < 300) return result->body;
  std::string message = result->body.substr(0, 500);
  const Json answer = Json::parse(result->body, nullptr, false);
  if (answer.is_object() && answer.contains("message"))
    message = answer.value("error_code", "") + ": " + answer["message"].get<std::string>();
  throw MlflowError(where + ": HTTP " + std::to_string(result->status) + " " + message, result->status);
}

std::string MlflowClient::experiment_id(const std::string& name) {
  const std::string query = "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + httplib::detail::encode_query_param(name);
  try {
    return Json::parse(call("GET", query, "")).at("experiment").at("experiment_id").get<std::string>();
  } catch (const MlflowError& missing) {
    if (missing.http_status() != 404) throw;
  }
  try {
    return Json::parse(call("POST", "/api/2.0/mlflow/experiments/create", Json{{"name", name}}.dump()))
        .at("experiment_id")
        .get<std::string>();
  } catch (const MlflowError& taken) {  // created meanwhile by another client
    if (taken.http_status() != 400) throw;
    return Json::parse(call("GET", query, "")).at("experiment").at("experiment_id").get<std::string>();
  }
}

MlflowRunInfo MlflowClient::create_run(const std::string& experiment_id, const std::string& run_name,
                                       const MlflowPairs& tags, int64_t start_ms) {
  Json body = {{"experiment_id", experiment_id}, {"start_time", start_ms}, {"tags", key_values(tags)}};
  if (!run_name.empty()) body["run_name"] = run_name;
  return run_info(Json::parse(call("POST", "/api/2.0/mlflow/runs/create", body.dump())).at("run"));
}

MlflowRunInfo MlflowClient::get_run(const std::string& run_id) {
  return run_info(
      Json::parse(call("GET", "/api/2.0/mlflow/runs/get?run_id=" + httplib::detail::encode_query_param(run_id), ""))
          .at("run"));
}

void MlflowClient::set_status(const std::string& run_id, const std::string& status, int64_t end_ms) {
  Json body = {{"run_id", run_id}, {"status", status}};
  if (end_ms > 0) body["end_time"] = end_ms;
  call("POST", "/api/2.0/mlflow/runs/update", body.dump());
}

void MlflowClient::log_batch(const std::string& run_id, const std::vector<MlflowMetric>& metrics,
                             const MlflowPairs& params, const MlflowPairs& tags) {
  Json body = {{"run_id", run_id}, {"params", key_values(params)}, {"tags", key_values(tags)}};
  Json& list = body["metrics"] = Json::array();
  for (const MlflowMetric& metric : metrics)
    list.push_back({{"key", metric.key},
                    {"value", metric_value(metric.value)},
                    {"timestamp", metric.timestamp_ms},
                    {"step", metric.step}});
  call("POST", "/api/2.0/mlflow/runs/log-batch", body.dump());
}

void MlflowClient::upload_artifact(const MlflowRunInfo& run, const std::string& relative_path,
                                   const std::string& bytes) {
  const std::string& root = run.artifact_uri;
  if (root.rfind("mlflow-artifacts:", 0) == 0) {
    call("PUT", "/api/2.0/mlflow-artifacts/artifacts/" + proxied_artifact_path(root) + "/" + relative_path, bytes);
  } else if (root.rfind("file:", 0) == 0 || (!root.empty() && root.front() == '/')) {
    write_local_artifact(root.front() == '/' ? "file:" + root : root, relative_path, bytes);
  } else {
    throw MlflowError("the run's artifact root " + root +
                          " is not served by the tracking server; start it with `mlflow server "
                          "--serve-artifacts` (the default since MLflow 2.0) to receive artifacts",
                      400);
  }
}

std::string MlflowClient::run_page(const MlflowRunInfo& run) const {
  return base_ + prefix_ + "/#/experiments/" + run.experiment_id + "/runs/" + run.run_id;
}

// ---------------------------------------------------------------------------
// MlflowRun
// ---------------------------------------------------------------------------

MlflowRun::MlflowRun(MlflowRunOptions options, std::function<void(const std::string&)> warn)
    : options_(std::move(options)), warn_(std::move(warn)),
      client_(std::make_unique<MlflowClient>(options_.server)) {
  for (auto& [key, value] : options_.params)
    if (value.size() > kMaxParamValue) value = value.substr(0, kMaxParamValue - 3) + "...";
  thread_ = std::thread([this] { run(); });
}

MlflowRun::~MlflowRun() {
  if (thread_.joinable()) finish("FAILED");
}

void MlflowRun::log_metrics(std::vector<MlflowMetric> metrics) {
  const std::lock_guard<std::mutex> lock(mutex_);
  for (MlflowMetric& metric : metrics) {
    if (metrics_.size() >= options_.max_queued_metrics) {
      ++outcome_.metrics_lost;  // the server has been away for long: the newest are dropped, counted
      continue;
    }
    metrics_.push_back(std::move(metric));
  }
}

void MlflowRun::set_tag(std::string key, std::string value) {
  const std::lock_guard<std::mutex> lock(mutex_);
  tags_.emplace_back(std::move(key), std::move(value));
}

void MlflowRun::add_artifact(std::string relative_path, std::string bytes) {
  const std::lock_guard<std::mutex> lock(mutex_);
  artifacts_.push_back({std::move(relative_path), std::move(bytes)});
}

MlflowOutcome MlflowRun::finish(const std::string& status) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!thread_.joinable()) return outcome_;
  final_status_ = status;
  wake_.notify_all();
  const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(options_.finish_timeout_seconds * 1e3));
  // A server that never answered (nothing listening, a wrong host) gets the
  // one try this finish() starts, not the whole timeout.
  const int64_t unanswered_before = unanswered_calls_;
  idle_.wait_until(lock, deadline,
                   [&] { return ended_ || stopping_ || (!answered_ && unanswered_calls_ > unanswered_before); });
  stopping_ = true;  // gave up or done: the thread stops after its current call
  wake_.notify_all();
  lock.unlock();
  thread_.join();
  lock.lock();
  outcome_.metrics_lost += int64_t(metrics_.size());
  outcome_.artifacts_lost += int64_t(artifacts_.size());
  outcome_.ended = ended_;
  outcome_.run_id = info_.run_id;
  if (!info_.run_id.empty()) outcome_.run_page = client_->run_page(info_);
  return outcome_;
}

std::string MlflowRun::run_id() {
  const std::lock_guard<std::mutex> lock(mutex_);
  return info_.run_id;
}

// The thread: sleeps a batch interval (or until finish()), sends what is
// queued, and backs off (1 s doubling to 30 s) while the server fails.
void MlflowRun::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  std::chrono::milliseconds backoff(0);
  const auto interval = std::chrono::milliseconds(int64_t(options_.batch_interval_seconds * 1e3));
  while (!stopping_ && !ended_) {
    const bool backing_off = backoff.count() > 0;
    if (!info_.run_id.empty() || backing_off)  // the run is opened at once: it shows in the UI as training starts
      wake_.wait_for(lock, std::max(interval, backoff),
                     [&] { return stopping_ || (!final_status_.empty() && (!backing_off || !finish_tried_)); });
    if (!final_status_.empty()) finish_tried_ = true;  // finish() cuts one back-off short, then waits like the rest
    if (stopping_) break;
    try {
      send_queued(lock);
      answered_ = true;
      if (failing_) warn_("MLflow at " + options_.server.uri + " records the run again");
      failing_ = false;
      backoff = std::chrono::milliseconds(0);
    } catch (const MlflowError& failure) {  // no answer or a server error: retried
      if (failure.http_status() != 0) answered_ = true;
      if (failure.http_status() == 0) ++unanswered_calls_;
      idle_.notify_all();  // finish() gives up on a server that never answered
      if (!failing_)
        warn_(std::string("MLflow: ") + failure.what() +
              "; training goes on, and what is queued is sent again when the server answers");
      failing_ = true;
      backoff = std::clamp(backoff * 2, std::chrono::milliseconds(1000), std::chrono::milliseconds(30000));
    } catch (const std::exception& nonsense) {  // an answer that is not MLflow's (a proxy's page, bad JSON)
      give_up(MlflowError(std::string("the server's answer is not MLflow's: ") + nonsense.what(), 0));
    }
  }
  idle_.notify_all();
}

// A refusal that retrying cannot change when opening the run (a bad run id,
// no permission, an invalid experiment name): said once; nothing more is sent.
void MlflowRun::give_up(const MlflowError& failure) {
  warn_(std::string("MLflow: ") + failure.what() + "; the run is not recorded (training goes on)");
  stopping_ = true;
}

// Runs one call with the lock released. A refusal of this item (HTTP 4xx: a
// changed parameter of a reopened run, an artifact root the server does not
// serve) drops the item with a warning; no answer or a server error is
// thrown for the thread to retry later.
bool MlflowRun::send(std::unique_lock<std::mutex>& lock, const std::string& what, const std::function<void()>& call) {
  lock.unlock();
  try {
    call();
  } catch (const MlflowError& failure) {
    lock.lock();
    if (failure.retryable()) throw;
    answered_ = true;
    if (what.empty()) return false;  // the caller tries the pieces
    warn_(std::string("MLflow: ") + what + " not recorded: " + failure.what());
    ++outcome_.items_refused;
    return false;
  }
  lock.lock();
  return true;
}

// Everything queued, in order: the run itself, parameters, tags, metrics,
// artifacts, then the final status. An item leaves its queue only once the
// server took (or refused) it; log_metrics() only appends, so the front is
// what was sent.
void MlflowRun::send_queued(std::unique_lock<std::mutex>& lock) {
  if (info_.run_id.empty()) {
    lock.unlock();
    try {
      MlflowRunInfo info = open_run();
      lock.lock();
      info_ = std::move(info);
    } catch (const MlflowError& failure) {
      lock.lock();
      if (!failure.retryable()) give_up(failure);
      if (!failure.retryable()) return;
      throw;
    }
  }
  for (; params_sent_ < options_.params.size(); params_sent_ += kMaxParamsPerBatch) {
    const auto first = options_.params.begin() + long(params_sent_);
    const MlflowPairs batch(first, first + long(std::min(kMaxParamsPerBatch, options_.params.size() - params_sent_)));
    // The server refuses a whole batch for one bad parameter (a changed value in a reopened run): then one by one.
    if (!send(lock, "", [&] { client_->log_batch(info_.run_id, {}, batch, {}); }))
      for (const auto& param : batch)
        send(lock, "parameter " + param.first, [&] { client_->log_batch(info_.run_id, {}, {param}, {}); });
  }
  while (!tags_.empty()) {
    const size_t n = std::min(kMaxTagsPerBatch, tags_.size());
    const MlflowPairs batch(tags_.begin(), tags_.begin() + long(n));
    send(lock, "tags", [&] { client_->log_batch(info_.run_id, {}, {}, batch); });
    tags_.erase(tags_.begin(), tags_.begin() + long(n));
  }
  while (!metrics_.empty()) {
    const size_t n = std::min(kMaxMetricsPerBatch, metrics_.size());
    const std::vector<MlflowMetric> batch(metrics_.begin(), metrics_.begin() + long(n));
    const bool taken = send(lock, "metrics", [&] { client_->log_batch(info_.run_id, batch, {}, {}); });
    metrics_.erase(metrics_.begin(), metrics_.begin() + long(n));
    (taken ? outcome_.metrics_sent : outcome_.metrics_lost) += int64_t(n);
  }
  while (!artifacts_.empty()) {
    const Artifact artifact = artifacts_.front();
    send(lock, "artifact " + artifact.path, [&] { client_->upload_artifact(info_, artifact.path, artifact.bytes); });
    artifacts_.pop_front();
  }
  if (!final_status_.empty() && !ended_) {
    // What finish()'s caller queued while a call above had the lock released
    // (the checkpoint's tag, an artifact) goes first: the next round sends it.
    if (!tags_.empty() || !metrics_.empty() || !artifacts_.empty()) return;
    send(lock, "the run's end", [&] { client_->set_status(info_.run_id, final_status_, unix_time_ms()); });
    ended_ = true;
    idle_.notify_all();
  }
}

// A new run in the experiment, or an existing run (MLFLOW_RUN_ID, a resumed
// checkpoint's) set running again. MLflow keeps a parameter's first value:
// those that changed since are said once and not sent.
MlflowRunInfo MlflowRun::open_run() {
  if (!options_.run_id.empty()) {
    MlflowRunInfo info = client_->get_run(options_.run_id);
    client_->set_status(info.run_id, "RUNNING");
    client_->log_batch(info.run_id, {}, {}, options_.tags);
    std::string changed;
    std::erase_if(options_.params, [&](const std::pair<std::string, std::string>& param) {
      for (const auto& [key, value] : info.params)
        if (key == param.first && value != param.second) {
          changed += (changed.empty() ? "" : ", ") + key + " '" + value + "' -> '" + param.second + "'";
          return true;
        }
      return false;
    });
    if (!changed.empty())
      warn_("MLflow: run " + info.run_id + " goes on; it keeps the parameters of its first part (MLflow does not " +
            "change a parameter), and these changed since: " + changed);
    return info;
  }
  const std::string experiment = client_->experiment_id(options_.experiment);
  return client_->create_run(experiment, options_.run_name, options_.tags, unix_time_ms());
}

}  // namespace tessera::io
