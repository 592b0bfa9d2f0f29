// The MLflow client's protocol, against a stand-in tracking server written
// here that records every request and can fail on purpose: metrics in
// batches of at most 1000, each value sent once and in order (non-finite
// ones as protobuf's JSON strings), parameters in batches of at most 100,
// a server error retried (one warning, one "again"), a refused parameter
// batch sent again one by one so that only the bad parameter is lost, artifacts PUT through the artifact proxy path, the final
// status; and a server that never answers bounding finish(). The real
// server is in tests/multiprocess/test_tracking.cpp.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "io/mlflow.h"
#include "tests/support/error_text.h"

namespace tessera::testing {
namespace {

using Json = nlohmann::json;

struct StandInTracking {
  httplib::Server server;
  std::thread thread;
  int port = 0;
  std::mutex mutex;
  int server_errors_left = 0;      // log-batch calls with metrics answered 503 first
  bool refuse_param = false;       // a log-batch carrying the parameter "refused" answered 400
  std::vector<Json> batches;       // the log-batch bodies taken
  std::vector<std::string> puts;   // artifact paths
  std::vector<std::string> bodies; // artifact bytes
  std::vector<std::string> statuses;
  int failed_calls = 0;
  // Artifact uploads held until release_puts() (hold_puts set): the client's
  // thread then sits in a call with its lock released.
  bool hold_puts = false, put_entered = false;
  std::condition_variable puts_changed;
  void release_puts() {
    const std::lock_guard<std::mutex> lock(mutex);
    hold_puts = false;
    puts_changed.notify_all();
  }
  void wait_for_a_put() {
    std::unique_lock<std::mutex> lock(mutex);
    puts_changed.wait(lock, [&] { return put_entered; });
  }

  StandInTracking() {
    auto reply = [](httplib::Response& response, const Json& body) {
      response.set_content(body.dump(), "application/json");
    };
    server.Get("/api/2.0/mlflow/experiments/get-by-name", [&](const httplib::Request& request, httplib::Response& r) {
      EXPECT_EQ(request.get_param_value("experiment_name"), "a b/c");
      r.status = 404;
      reply(r, {{"error_code", "RESOURCE_DOES_NOT_EXIST"}, {"message", "no such experiment"}});
    });
    server.Post("/api/2.0/mlflow/experiments/create", [&](const httplib::Request& request, httplib::Response& r) {
      EXPECT_EQ(Json::parse(request.body)["name"], "a b/c");
      reply(r, {{"experiment_id", "7"}});
    });
    server.Post("/api/2.0/mlflow/runs/create", [&](const httplib::Request& request, httplib::Response& r) {
      const Json body = Json::parse(request.body);
      EXPECT_EQ(body["experiment_id"], "7");
      EXPECT_EQ(body["run_name"], "run-x");
      EXPECT_EQ(body["tags"][0]["key"], "tessera.layout");
      reply(r, {{"run", {{"info", {{"run_id", "r1"}, {"experiment_id", "7"},
                                   {"artifact_uri", "mlflow-artifacts:/7/r1/artifacts"}}}}}});
    });
    server.Post("/api/2.0/mlflow/runs/log-batch", [&](const httplib::Request& request, httplib::Response& r) {
      const Json body = Json::parse(request.body);
      const std::lock_guard<std::mutex> lock(mutex);
      if (!body["metrics"].empty() && server_errors_left > 0) {
        --server_errors_left;
        ++failed_calls;
        r.status = 503;
        return;
      }
      for (const Json& param : body["params"])
        if (refuse_param && param["key"] == "refused") {
          r.status = 400;
          reply(r, {{"error_code", "INVALID_PARAMETER_VALUE"}, {"message", "Changing param values is not allowed"}});
          return;
        }
      batches.push_back(body);
      reply(r, Json::object());
    });
    server.Put(R"(/api/2.0/mlflow-artifacts/artifacts/(.*))", [&](const httplib::Request& request, httplib::Response& r) {
      std::unique_lock<std::mutex> lock(mutex);
      put_entered = true;
      puts_changed.notify_all();
      puts_changed.wait(lock, [&] { return !hold_puts; });
      puts.push_back(request.matches[1]);
      bodies.push_back(request.body);
      reply(r, Json::object());
    });
    server.Post("/api/2.0/mlflow/runs/update", [&](const httplib::Request& request, httplib::Response& r) {
      const Json body = Json::parse(request.body);
      EXPECT_EQ(body["run_id"], "r1");
      const std::lock_guard<std::mutex> lock(mutex);
      statuses.push_back(body["status"]);
      reply(r, Json::object());
    });
    port = server.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { server.listen_after_bind(); });
    while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~StandInTracking() {
    server.stop();
    thread.join();
  }
};

io::MlflowRunOptions options_for(int port) {
  io::MlflowRunOptions options;
  options.server.uri = "http://127.0.0.1:" + std::to_string(port);
  options.experiment = "a b/c";  // sent URL-encoded
  options.run_name = "run-x";
  options.tags = {{"tessera.layout", "dp=2 tp=1 pp=1"}};
  for (int i = 0; i < 250; ++i) options.params.emplace_back(std::string(1, 'p').append(std::to_string(i)), std::to_string(i * 3));
  options.params.emplace_back("refused", "1");
  options.batch_interval_seconds = 0.02;
  return options;
}

TEST(Mlflow, BatchesRetriesRefusalsArtifactsAndTheEnd) {
  StandInTracking server;
  server.server_errors_left = 2;
  server.refuse_param = true;
  std::vector<std::string> warnings;
  std::mutex warned;
  io::MlflowRun run(options_for(server.port), [&](const std::string& line) {
    const std::lock_guard<std::mutex> lock(warned);
    warnings.push_back(line);
  });
  // 2500 values of one key, and two non-finite ones, logged in pieces while the thread sends.
  for (int step = 1; step <= 2500; step += 100) {
    std::vector<io::MlflowMetric> metrics;
    for (int s = step; s < step + 100; ++s) metrics.push_back({"loss", 1.0 / s, 1000 + s, s});
    run.log_metrics(metrics);
  }
  run.log_metrics({{"grad_norm", NAN, 5, 2501}, {"grad_norm", -INFINITY, 6, 2502}});
  run.set_tag("tessera.checkpoint", "/ckpt/step_00002500");
  run.add_artifact("curves.svg", "<svg>curves</svg>");
  const io::MlflowOutcome outcome = run.finish();

  EXPECT_EQ(outcome.run_id, "r1");
  EXPECT_EQ(outcome.run_page, "http://127.0.0.1:" + std::to_string(server.port) + "/#/experiments/7/runs/r1");
  EXPECT_EQ(outcome.metrics_sent, 2502);
  EXPECT_EQ(outcome.metrics_lost, 0);
  EXPECT_TRUE(outcome.ended);
  EXPECT_EQ(server.failed_calls, 2);
  EXPECT_EQ(server.statuses, std::vector<std::string>{"FINISHED"});
  EXPECT_EQ(server.puts, std::vector<std::string>{"7/r1/artifacts/curves.svg"});
  EXPECT_EQ(server.bodies, std::vector<std::string>{"<svg>curves</svg>"});

  std::vector<Json> loss, params, tags;
  for (const Json& batch : server.batches) {
    EXPECT_LE(batch["metrics"].size(), 1000u);
    EXPECT_LE(batch["params"].size(), 100u);
    for (const Json& m : batch["metrics"]) (m["key"] == "loss" ? loss : tags).push_back(m);
    for (const Json& p : batch["params"]) params.push_back(p);
  }
  ASSERT_EQ(loss.size(), 2500u);
  for (size_t i = 0; i < loss.size(); ++i) {
    ASSERT_EQ(loss[i]["step"], int64_t(i + 1));
    ASSERT_EQ(loss[i]["value"].get<double>(), 1.0 / double(i + 1));
    ASSERT_EQ(loss[i]["timestamp"], int64_t(1001 + i));
  }
  ASSERT_EQ(tags.size(), 2u);  // the grad_norm values, as protobuf's JSON reads non-finite doubles
  EXPECT_EQ(tags[0]["value"], "NaN");
  EXPECT_EQ(tags[1]["value"], "-Infinity");
  // The batch holding "refused" is refused whole; its other 50 parameters are then sent one by one.
  EXPECT_EQ(params.size(), 250u);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i]["key"], "p" + std::to_string(i));
    EXPECT_EQ(params[i]["value"], std::to_string(i * 3));
  }
  bool tagged = false;
  for (const Json& batch : server.batches)
    for (const Json& tag : batch["tags"]) tagged |= tag["key"] == "tessera.checkpoint";
  EXPECT_TRUE(tagged);

  std::string said;
  for (const std::string& line : warnings) said += line + "\n";
  EXPECT_EQ(warnings.size(), 3u) << said;  // the 503, the recovery, the refused parameter batch
  EXPECT_CONTAINS(said, "HTTP 503");
  EXPECT_CONTAINS(said, "records the run again");
  EXPECT_CONTAINS(said, "parameter refused not recorded: POST http://127.0.0.1:" + std::to_string(server.port) +
                            "/api/2.0/mlflow/runs/log-batch: HTTP 400 INVALID_PARAMETER_VALUE: Changing param values");
}

// A tag queued while the client's thread is in an upload, just before
// finish() (the trainer's order: artifacts, the checkpoint's tag, finish), is
// sent before the run's end: before, the thread ended the run when its upload
// returned, and the tag was lost without a word (Tracking.MlflowRecords... saw
// no tessera.checkpoint once under load).
TEST(Mlflow, ATagQueuedDuringAnUploadIsSentBeforeTheEnd) {
  StandInTracking server;
  server.hold_puts = true;
  io::MlflowRunOptions options = options_for(server.port);
  options.params.pop_back();  // no refused parameter here
  io::MlflowRun run(options, [](const std::string&) {});
  run.add_artifact("curves.svg", "<svg/>");
  server.wait_for_a_put();  // the thread uploads, its lock released
  run.set_tag("tessera.checkpoint", "/ckpt/step_00000024");
  run.add_artifact("metrics.jsonl", "{}");
  io::MlflowOutcome outcome;
  std::thread finishing([&] { outcome = run.finish(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // finish() has set the final status by now
  server.release_puts();
  finishing.join();
  EXPECT_TRUE(outcome.ended);
  EXPECT_EQ(server.puts, (std::vector<std::string>{"7/r1/artifacts/curves.svg", "7/r1/artifacts/metrics.jsonl"}));
  bool tagged = false;
  for (const Json& batch : server.batches)
    for (const Json& tag : batch["tags"]) tagged |= tag["key"] == "tessera.checkpoint";
  EXPECT_TRUE(tagged) << "the checkpoint's tag was not sent before the run's end";
  EXPECT_EQ(server.statuses, std::vector<std::string>{"FINISHED"});
}

TEST(Mlflow, NoServerBoundsFinishAndCountsWhatWasNotSent) {
  int port = 0;
  {
    StandInTracking gone;  // a port that just closed
    port = gone.port;
  }
  io::MlflowRunOptions options = options_for(port);
  options.finish_timeout_seconds = 1.0;
  std::vector<std::string> warnings;
  io::MlflowOutcome outcome;
  {
    io::MlflowRun run(options, [&](const std::string& line) { warnings.push_back(line); });
    run.log_metrics({{"loss", 1.0, 1, 1}, {"loss", 0.5, 2, 2}});
    run.add_artifact("curves.svg", "<svg/>");
    outcome = run.finish();
  }
  EXPECT_TRUE(outcome.run_id.empty());
  EXPECT_EQ(outcome.metrics_lost, 2);
  EXPECT_EQ(outcome.artifacts_lost, 1);
  EXPECT_FALSE(outcome.ended);
  ASSERT_EQ(warnings.size(), 1u);  // once, not at every retry
  EXPECT_CONTAINS(warnings[0], "training goes on");
}

// A server that never answered (nothing listens: a wrong host or port) is
// tried once more when the run ends and then given up at once, not waited
// for the whole finish timeout (here 60 s; it was 60 s before).
TEST(Mlflow, AServerThatNeverAnsweredIsGivenUpAtOnce) {
  int port = 0;
  {
    StandInTracking gone;
    port = gone.port;
  }
  io::MlflowRunOptions options = options_for(port);
  options.finish_timeout_seconds = 60.0;
  io::MlflowRun run(options, [](const std::string&) {});
  run.log_metrics({{"loss", 1.0, 1, 1}});
  const auto start = std::chrono::steady_clock::now();
  const io::MlflowOutcome outcome = run.finish();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 15.0) << "finish() waited for a server that never answered";
  EXPECT_TRUE(outcome.run_id.empty());
  EXPECT_EQ(outcome.metrics_lost, 1);
}

TEST(Mlflow, UrisAreCheckedAndArtifactRootsOutsideTheProxyRefused) {
  EXPECT_CONTAINS(error_of([] {
    io::MlflowServer server;
    server.uri = "mlflow:5000";
    io::MlflowClient client(server); }),
                  "--mlflow-uri mlflow:5000: give the http:// or https:// URL, e.g. http://mlflow:5000");
  io::MlflowServer server;
  server.uri = "https://tracking.example.com/prefix/";
  io::MlflowClient client(server);
  EXPECT_EQ(client.run_page({"r", "3", "", "", "", {}}), "https://tracking.example.com/prefix/#/experiments/3/runs/r");
  try {
    client.upload_artifact({"r", "3", "s3://bucket/3/r/artifacts", "", "", {}}, "curves.svg", "x");
    ADD_FAILURE() << "an s3:// root was taken";
  } catch (const io::MlflowError& error) {
    EXPECT_FALSE(error.retryable());
    EXPECT_CONTAINS(std::string(error.what()), "--serve-artifacts");
  }
}

}  // namespace
}  // namespace tessera::testing
