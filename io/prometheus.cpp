// The Prometheus text format, the /metrics endpoint and the Pushgateway
// client (io/prometheus.h), on cpp-httplib: one server thread, one worker.
#include "io/prometheus.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <cmath>

#include "core/error.h"
#include "io/http_url.h"
#include "io/metrics.h"

namespace tessera::io {
namespace {

bool valid_name(const std::string& name, bool colons) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colons && c == ':');
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string escaped_label_value(const std::string& value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string sample_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  return json_number(value);  // the shortest text that reads back as the same double
}

}  // namespace

std::string prometheus_text(const std::vector<PrometheusFamily>& families) {
  std::string out;
  for (const PrometheusFamily& family : families) {
    TESSERA_CHECK(valid_name(family.name, true), "prometheus: '", family.name, "' is not a metric name");
    for (const auto& [keyword, text] : {std::pair{"# HELP ", &family.help}, {"# TYPE ", &family.type}}) {
      out += keyword;
      out += family.name;
      out += ' ';
      out += *text;
      out += '\n';
    }
    for (const PrometheusSample& sample : family.samples) {
      out += family.name;
      if (!sample.labels.empty()) {
        out += '{';
        for (size_t i = 0; i < sample.labels.size(); ++i) {
          const auto& [name, value] = sample.labels[i];
          TESSERA_CHECK(valid_name(name, false), "prometheus: '", name, "' is not a label name");
          if (i) out += ',';
          out += name;
          out += "=\"";
          out += escaped_label_value(value);
          out += '"';
        }
        out += '}';
      }
      out += ' ';
      out += sample_value(sample.value);
      out += '\n';
    }
  }
  return out;
}

struct MetricsEndpoint::Server {
  httplib::Server http;
  std::mutex mutex;
  std::string text;
};

MetricsEndpoint::MetricsEndpoint(const std::string& host, int port, const std::string& flag)
    : server_(std::make_unique<Server>()) {
  Server* server = server_.get();
  server->http.new_task_queue = [] { return new httplib::ThreadPool(1); };  // a scrape at a time is plenty
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second job on the node would share the
  // port silently (and half the scrapes would reach it) instead of being told it is taken.
  server->http.set_socket_options([](int socket) {
    const int yes = 1;
    setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server->http.Get("/metrics", [server](const httplib::Request&, httplib::Response& response) {
    std::string text;
    {
      const std::lock_guard<std::mutex> lock(server->mutex);
      text = server->text;
    }
    response.set_content(text, "text/plain; version=0.0.4; charset=utf-8");
  });
  port_ = port == 0 ? server->http.bind_to_any_port(host) : (server->http.bind_to_port(host, port) ? port : -1);
  TESSERA_CHECK(port_ > 0, flag, " ", port, ": cannot listen on ", host, ":", port,
                " (in use by another process, or a port below 1024 without the right); pick another port");
  thread_ = std::thread([server] { server->http.listen_after_bind(); });
  // stop() only stops a server that runs: wait for it, so that destroying the endpoint at once cannot hang.
  while (!server->http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

MetricsEndpoint::~MetricsEndpoint() {
  server_->http.stop();
  if (thread_.joinable()) thread_.join();
}

void MetricsEndpoint::publish(std::string text) {
  const std::lock_guard<std::mutex> lock(server_->mutex);
  server_->text = std::move(text);
}

GatewayPusher::GatewayPusher(std::string url, std::string job, std::string instance,
                             std::function<void(const std::string&)> warn)
    : warn_(std::move(warn)) {
  HttpUrl parsed = parse_http_url(url, "--metrics-push", "http://pushgateway:9091");
  base_ = std::move(parsed.base);
  path_ = parsed.prefix + "/metrics/job/" + job + "/instance/" + instance;
  thread_ = std::thread([this] { run(); });
}

GatewayPusher::~GatewayPusher() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void GatewayPusher::publish(std::string text) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    pending_ = std::move(text);
    has_pending_ = true;
  }
  wake_.notify_all();
}

int64_t GatewayPusher::pushes() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return pushes_;
}

bool GatewayPusher::push(const std::string& text) {
  httplib::Client client(base_);
  client.set_connection_timeout(2);
  client.set_read_timeout(5);
  client.set_write_timeout(5);
  const httplib::Result result = client.Put(path_, text, "text/plain; version=0.0.4");
  const bool ok = result && result->status >= 200 && result->status < 300;
  if (ok != failing_) return ok;  // no change: nothing to say
  failing_ = !ok;
  if (!ok)
    warn_("--metrics-push: cannot push to " + base_ + path_ + " (" +
          (result ? "HTTP " + std::to_string(result->status) : httplib::to_string(result.error())) +
          "); training goes on, and pushes are retried at every log interval");
  else
    warn_("--metrics-push: " + base_ + path_ + " takes the metrics again");
  return ok;
}

void GatewayPusher::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return has_pending_ || stopping_; });
    if (!has_pending_) return;  // stopping with nothing left to push
    std::string text = std::move(pending_);
    has_pending_ = false;
    lock.unlock();
    const bool ok = push(text);
    lock.lock();
    if (ok) ++pushes_;
    if (stopping_ && !has_pending_) return;
  }
}

}  // namespace tessera::io
