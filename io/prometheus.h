// Metrics for Prometheus: the text exposition format (version 0.0.4, what
// every Prometheus server scrapes), an HTTP endpoint that serves the latest
// text at GET /metrics (`train --metrics-port`), and pushes of the same text
// to a Pushgateway (`train --metrics-push`, for jobs no Prometheus can reach,
// e.g. Slurm nodes behind a login node). HTTP through cpp-httplib (Debian's
// libcpp-httplib-dev). The trainer decides what goes in (apps/train_monitor.h);
// this file only speaks the formats and the protocols.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tessera::io {

using PrometheusLabels = std::vector<std::pair<std::string, std::string>>;

struct PrometheusSample {
  PrometheusLabels labels;
  double value = 0.0;
};

// One metric: `# HELP` and `# TYPE` lines, then its samples.
struct PrometheusFamily {
  std::string name;  // [a-zA-Z_:][a-zA-Z0-9_:]*
  std::string help;
  std::string type = "gauge";  // gauge | counter | untyped
  std::vector<PrometheusSample> samples;
};

// The exposition text of `families`. Label values are escaped (\\, \", \n);
// NaN and infinities are written as Prometheus reads them (NaN, +Inf, -Inf).
// Throws tessera::Error for an invalid metric or label name.
std::string prometheus_text(const std::vector<PrometheusFamily>& families);

// Serves the last published text at http://HOST:PORT/metrics from a
// background thread (the training thread only swaps a string under a mutex).
class MetricsEndpoint {
 public:
  // Binds now: throws tessera::Error naming the address and `flag` when it
  // cannot (the port in use, no permission). Port 0 takes a free port.
  MetricsEndpoint(const std::string& host, int port, const std::string& flag = "--metrics-port");
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const { return port_; }
  void publish(std::string text);

 private:
  struct Server;
  std::unique_ptr<Server> server_;
  std::thread thread_;
  int port_ = 0;
};

// Pushes the last published text to a Pushgateway (PUT URL/metrics/job/JOB
// /instance/INSTANCE: the group is replaced each time) from a background
// thread, so a slow or absent gateway never slows training; the first
// failure and the first success after failures are reported through
// `warn` (called on that thread).
class GatewayPusher {
 public:
  GatewayPusher(std::string url, std::string job, std::string instance, std::function<void(const std::string&)> warn);
  ~GatewayPusher();  // one last push of what was published, then stops
  GatewayPusher(const GatewayPusher&) = delete;
  GatewayPusher& operator=(const GatewayPusher&) = delete;

  void publish(std::string text);
  int64_t pushes() const;  // successful pushes so far

 private:
  void run();
  bool push(const std::string& text);

  std::string base_, path_;
  std::function<void(const std::string&)> warn_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::string pending_;
  bool has_pending_ = false, stopping_ = false, failing_ = false;
  int64_t pushes_ = 0;
  std::thread thread_;
};

}  // namespace tessera::io
