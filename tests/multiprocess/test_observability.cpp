// A running job seen from outside, against the real servers, started here on
// loopback and stopped after: Debian's Prometheus scrapes a 2-rank training
// run's --metrics-port (a configuration written by the test) and its HTTP
// query API returns the loss and communication series of both ranks (each
// rank's series labelled with its host; its communication seconds counted);
// Debian's Pushgateway receives --metrics-push. TESSERA_FAULT=slow on one rank of 4 is named the
// straggler with its rank, in the log and in the metrics file. By default
// stdout has one human line per interval and no Katib lines.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>

#include "io/metrics.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

std::string http_get(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(2);
  const auto result = client.Get(path);
  return result && result->status == 200 ? result->body : "";
}

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

bool wait_until(const std::function<bool()>& ready, seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return false;
}

// The ranks whose `metric` series Prometheus' query API returns.
std::set<std::string> ranks_in_prometheus(int port, const std::string& metric) {
  const std::string body = http_get(port, "/api/v1/query?query=" + metric);
  std::set<std::string> ranks;
  if (body.empty()) return ranks;
  const nlohmann::json reply = nlohmann::json::parse(body, nullptr, false);
  if (reply.is_discarded() || reply.value("status", "") != "success") return ranks;
  for (const auto& series : reply["data"]["result"])
    if (series["metric"].contains("rank")) ranks.insert(series["metric"]["rank"].get<std::string>());
  return ranks;
}

TEST(Observability, PrometheusScrapesEveryRankAndThePushgatewayTakesPushes) {
  if (!fs::exists("/usr/bin/prometheus") || !fs::exists("/usr/bin/prometheus-pushgateway"))
    GTEST_SKIP() << "Debian's prometheus and prometheus-pushgateway are missing: run scripts/install-deps.sh";
  ScratchDirectory dir("tessera_observability_");
  const int metrics_port = free_port(), prometheus_port = free_port(), gateway_port = free_port();
  std::ofstream(dir / "prometheus.yml") << "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                                           "scrape_configs:\n"
                                           "  - job_name: tessera\n"
                                           "    static_configs: [{targets: ['127.0.0.1:"
                                        << metrics_port << "']}]\n";
  Job prometheus(
      {"/usr/bin/prometheus", "--config.file=" + (dir / "prometheus.yml"), "--storage.tsdb.path=" + (dir / "tsdb"),
       "--web.listen-address=127.0.0.1:" + std::to_string(prometheus_port)},
      dir / "prometheus.log");
  Job gateway({"/usr/bin/prometheus-pushgateway", "--web.listen-address=127.0.0.1:" + std::to_string(gateway_port)},
              dir / "pushgateway.log");
  ASSERT_TRUE(wait_until([&] { return !http_get(prometheus_port, "/-/ready").empty(); }, seconds(60)))
      << prometheus.output();
  ASSERT_TRUE(wait_until([&] { return !http_get(gateway_port, "/-/ready").empty(); }, seconds(60))) << gateway.output();

  // Training runs until Prometheus has both ranks' loss, then is stopped (SIGUSR1 to mpirun: every rank stops).
  Job train(tessera_command(2, words("--model gpt --synthetic --vocab-size 64 --seq-length 16 --num-layers 1 "
                                     "--num-heads 2 --hidden-size 32 --micro-batch-size 4 --train-steps 1000000 "
                                     "--num-experts 2 --moe-router-topk 1 --moe-aux-loss-coeff 0.01 "
                                     "--threads 1 --log-interval 2 --save-interval 4 --metrics " +
                                     (dir / "metrics.jsonl") + " --save " + (dir / "save") + " --metrics-port " +
                                     std::to_string(metrics_port) +
                                     " --metrics-push http://127.0.0.1:" + std::to_string(gateway_port))),
            dir / "train.log");
  // Queried while the job runs: once its target is gone, Prometheus marks the series stale.
  const std::set<std::string> both{"0", "1"};
  const bool scraped = wait_until(
      [&] {
        return ranks_in_prometheus(prometheus_port, "tessera_loss") == both &&
               ranks_in_prometheus(prometheus_port, "tessera_comm_bytes_total") == both &&
               ranks_in_prometheus(prometheus_port, "tessera_comm_seconds_total") == both;
      },
      seconds(120));
  // Rank 0's own text, while the job runs, once a checkpoint (every 4 steps) has been written and
  // exchanged: every rank's series carries its host; each data-parallel rank has waited in its
  // gradient all-reduces (counted by its communicator); the job id is tessera_info's job_id, never
  // a `job` label of the target's own.
  const std::string written = "tessera_checkpoint_write_seconds{rank=\"0\",node=\"" + host_name() + "\"} ";
  std::string served;
  wait_until(
      [&] {
        served = http_get(metrics_port, "/metrics");
        return contains(served, written) && contains(served, "tessera_checkpoint_write_seconds{rank=\"1\"");
      },
      seconds(60));
  ::kill(train.pid(), SIGUSR1);
  train.wait(seconds(60));
  EXPECT_TRUE(scraped) << "Prometheus never returned tessera_loss for ranks 0 and 1; targets: "
                       << http_get(prometheus_port, "/api/v1/targets") << "\ntraining:\n"
                       << train.output();
  EXPECT_TRUE(contains(train.output(), "metrics: Prometheus can scrape http://")) << train.output();
  for (const char* rank : {"0", "1"}) {
    const std::string series =
        std::string("tessera_comm_seconds_total{rank=\"") + rank + "\",node=\"" + host_name() + "\",axis=\"dp\"} ";
    const size_t at = served.find(series);
    ASSERT_NE(at, std::string::npos) << series << "\n" << served;
    EXPECT_GT(std::stod(served.substr(at + series.size())), 0.0) << served;
  }
  EXPECT_TRUE(contains(served, "job_id=\"")) << served;
  // Rank 0's served write time is one its metrics file recorded (checkpoint_write_s).
  const size_t at = served.find(written);
  ASSERT_NE(at, std::string::npos) << served;
  const double served_write = std::stod(served.substr(at + written.size()));
  bool recorded = false;
  for (const io::StepRecord& step : io::read_metrics(dir / "metrics.jsonl").steps)
    for (const auto& [name, value] : step.extra)
      if (name == "checkpoint_write_s" && value == served_write) recorded = true;
  EXPECT_TRUE(recorded) << "served checkpoint write time " << served_write << " is in no checkpoint_write_s";
  EXPECT_FALSE(contains(served, "job=\"")) << served;
  // The mixture of experts' figures: the most tokens an expert of block 0 got
  // in a step, as the metrics file recorded it (moe_l0_tokens_max), and the losses.
  const std::string most = "tessera_moe_expert_tokens{layer=\"0\",stat=\"max\"} ";
  const size_t most_at = served.find(most);
  ASSERT_NE(most_at, std::string::npos) << served;
  const double served_most = std::stod(served.substr(most_at + most.size()));
  bool most_recorded = false;
  for (const io::StepRecord& step : io::read_metrics(dir / "metrics.jsonl").steps)
    for (const auto& [name, value] : step.extra)
      if (name == "moe_l0_tokens_max" && value == served_most) most_recorded = true;
  EXPECT_TRUE(most_recorded) << "served " << most << served_most << " is in no moe_l0_tokens_max";
  EXPECT_GE(served_most, 2 * 4 * 16 / 2) << "two ranks' 4 x 16 tokens over 2 experts: the busier has at least half";
  for (const char* family : {"tessera_moe_aux_loss ", "tessera_moe_z_loss ", "tessera_moe_imbalance{layer=\"0\"} ",
                             "tessera_moe_dropped_fraction 0"})
    EXPECT_TRUE(contains(served, family)) << family << "\n" << served;

  const std::string pushed = http_get(gateway_port, "/metrics");
  for (const char* rank : {"0", "1"})
    EXPECT_TRUE(contains(pushed, std::string("tessera_loss{instance=\"") + host_name() + "\",job=\"tessera\",node=\"" +
                                     host_name() + "\",rank=\"" + rank + "\"}"))
        << pushed.substr(0, 3000);
  // One human line per interval: no Katib name=value lines unless asked.
  EXPECT_FALSE(contains(train.output(), "\nstep=2 ")) << train.output();
  EXPECT_TRUE(contains(train.output(), "step 2/")) << train.output();
}

TEST(Observability, ASlowRankIsNamedTheStraggler) {
  ScratchDirectory dir("tessera_straggler_");
  std::vector<std::string> environment = job_environment();
  environment.push_back("TESSERA_FAULT=slow@3:2,slow@4:2");  // rank 2 sleeps 2 s as steps 3 and 4 begin
  const Outcome run = run_command(
      tessera_command(4, words("--model mlp --synthetic --hidden 64 --micro-batch-size 8 --train-steps 6 --threads 1 "
                               "--log-interval 2 --katib-metrics --metrics " +
                               (dir / "metrics.jsonl"))),
      dir / "train.log", seconds(120), environment);
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "straggler: rank 2 computed")) << run.output;
  EXPECT_TRUE(contains(run.output, "step=2 ")) << "--katib-metrics prints Katib's lines:\n" << run.output;
  const io::MetricsLog log = io::read_metrics(dir / "metrics.jsonl");
  bool named = false;
  for (const io::StepRecord& step : log.steps)
    for (const auto& [name, value] : step.extra)
      if (name == "straggler_rank" && step.step == 4) {
        EXPECT_EQ(value, 2.0);
        named = true;
      }
  EXPECT_TRUE(named) << "no straggler_rank in the metrics of step 4";
  for (const io::StepRecord& step : log.steps)
    for (const auto& [name, value] : step.extra)
      if (name == "straggler_slowdown" && step.step == 4) {
        EXPECT_GT(value, 3.0);
      }
}

}  // namespace
}  // namespace tessera::testing
