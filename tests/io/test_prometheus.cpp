// The Prometheus pieces on their own: the exposition text read back by a
// parser written here and, where Debian's prometheus package is installed,
// accepted by `promtool check metrics` (Prometheus' own linter); the
// /metrics endpoint fetched over real HTTP after each publish, its port in
// use refused naming the flag; the Pushgateway client against a real HTTP
// server written here (the path, the body, a replaced group per push) and
// against nothing (one warning, no exception).
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "io/prometheus.h"
#include "tests/support/error_text.h"

namespace tessera::testing {
namespace {

std::vector<io::PrometheusFamily> sample_families() {
  return {{"tessera_loss", "Training loss", "gauge", {{{{"rank", "0"}}, 2.5}, {{{"rank", "1"}}, 0.125}}},
          {"tessera_comm_bytes_total", "Bytes", "counter", {{{{"rank", "0"}, {"axis", "dp"}}, 1e9}}},
          {"tessera_info", "The run", "gauge", {{{{"layout", "dp=2 \"x\"\\\n"}}, 1.0}}},
          {"tessera_eval_loss", "Eval loss", "gauge", {{{}, NAN}}},
          {"tessera_big", "Infinities", "gauge", {{{{"sign", "+"}}, INFINITY}, {{{"sign", "-"}}, -INFINITY}}}};
}

// name{labels} value lines → (name + sorted labels) → value text; # lines checked for HELP and TYPE.
std::map<std::string, std::string> parse_exposition(const std::string& text) {
  std::map<std::string, std::string> samples;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# ", 0) == 0) continue;
    const size_t space = line.rfind(' ');
    samples[line.substr(0, space)] = line.substr(space + 1);
  }
  return samples;
}

TEST(Prometheus, TextFormatReadsBack) {
  const std::string text = io::prometheus_text(sample_families());
  EXPECT_NE(text.find("# HELP tessera_loss Training loss\n# TYPE tessera_loss gauge\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE tessera_comm_bytes_total counter\n"), std::string::npos) << text;
  const auto samples = parse_exposition(text);
  EXPECT_EQ(samples.at("tessera_loss{rank=\"0\"}"), "2.5");
  EXPECT_EQ(samples.at("tessera_loss{rank=\"1\"}"), "0.125");
  EXPECT_EQ(std::stod(samples.at("tessera_comm_bytes_total{rank=\"0\",axis=\"dp\"}")), 1e9);
  EXPECT_EQ(samples.at("tessera_info{layout=\"dp=2 \\\"x\\\"\\\\\\n\"}"), "1");  // \" \\ \n escaped
  EXPECT_EQ(samples.at("tessera_eval_loss"), "NaN");
  EXPECT_EQ(samples.at("tessera_big{sign=\"+\"}"), "+Inf");
  EXPECT_EQ(samples.at("tessera_big{sign=\"-\"}"), "-Inf");
  EXPECT_CONTAINS(error_of([] { io::prometheus_text({{"9lives", "x", "gauge", {}}}); }), "not a metric name");
  EXPECT_CONTAINS(error_of([] {
                    io::prometheus_text({{"ok", "x", "gauge", {{{{"bad-label", "v"}}, 1.0}}}});
                  }),
                  "not a label name");
}

TEST(Prometheus, PromtoolAcceptsTheText) {
  if (!std::filesystem::exists("/usr/bin/promtool"))
    GTEST_SKIP() << "promtool is missing: scripts/install-deps.sh installs Debian's prometheus";
  const std::string path = ::testing::TempDir() + "tessera_prometheus_text.txt";
  {
    std::FILE* file = std::fopen(path.c_str(), "w");
    ASSERT_NE(file, nullptr);
    const std::string text = io::prometheus_text(sample_families());
    std::fwrite(text.data(), 1, text.size(), file);
    std::fclose(file);
  }
  // promtool lints: counters must end in _total, metric names snake_case, HELP present.
  const std::string command = "/usr/bin/promtool check metrics < " + path + " > " + path + ".out 2>&1";
  const int status = std::system(command.c_str());
  std::string output;
  if (std::FILE* file = std::fopen((path + ".out").c_str(), "r")) {
    char buffer[4096];
    output.assign(buffer, std::fread(buffer, 1, sizeof buffer, file));
    std::fclose(file);
  }
  EXPECT_EQ(status, 0) << output;
}

std::string get_metrics(int port) {
  httplib::Client client("127.0.0.1", port);
  const auto result = client.Get("/metrics");
  if (!result) return "error " + httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  return result->body;
}

TEST(Prometheus, EndpointServesWhatWasPublishedLast) {
  io::MetricsEndpoint endpoint("127.0.0.1", 0);
  ASSERT_GT(endpoint.port(), 0);
  EXPECT_EQ(get_metrics(endpoint.port()), "");
  endpoint.publish("tessera_step{rank=\"0\"} 1\n");
  EXPECT_EQ(get_metrics(endpoint.port()), "tessera_step{rank=\"0\"} 1\n");
  endpoint.publish("tessera_step{rank=\"0\"} 2\n");
  EXPECT_EQ(get_metrics(endpoint.port()), "tessera_step{rank=\"0\"} 2\n");
  EXPECT_CONTAINS(error_of([&] { io::MetricsEndpoint again("127.0.0.1", endpoint.port()); }),
                  "--metrics-port " + std::to_string(endpoint.port()) + ": cannot listen");
}

// A stand-in Pushgateway: records each PUT's path and body.
struct Gateway {
  httplib::Server server;
  std::thread thread;
  int port = 0;
  std::mutex mutex;
  std::vector<std::pair<std::string, std::string>> puts;

  Gateway() {
    server.Put(R"(/.*)", [this](const httplib::Request& request, httplib::Response& response) {
      const std::lock_guard<std::mutex> lock(mutex);
      puts.emplace_back(request.path, request.body);
      response.status = 200;
    });
    port = server.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { server.listen_after_bind(); });
    while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // stop() needs it running
  }
  ~Gateway() {
    server.stop();
    thread.join();
  }
};

TEST(Prometheus, PusherPutsTheGroupAndWarnsOnceWhenTheGatewayIsGone) {
  Gateway gateway;
  std::vector<std::string> warnings;
  {
    io::GatewayPusher pusher("http://127.0.0.1:" + std::to_string(gateway.port) + "/prefix/", "tessera", "rank0",
                             [&](const std::string& line) { warnings.push_back(line); });
    pusher.publish("a 1\n");
    for (int i = 0; i < 200 && pusher.pushes() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    pusher.publish("a 2\n");
  }  // the destructor pushes what is pending
  ASSERT_GE(gateway.puts.size(), 2u);
  EXPECT_EQ(gateway.puts.front().first, "/prefix/metrics/job/tessera/instance/rank0");
  EXPECT_EQ(gateway.puts.front().second, "a 1\n");
  EXPECT_EQ(gateway.puts.back().second, "a 2\n");
  EXPECT_TRUE(warnings.empty()) << warnings.front();

  // Nothing listens: one warning for any number of failed pushes, no exception.
  int free_port = 0;
  {
    Gateway closed;  // a port that was just served and is closed again
    free_port = closed.port;
  }
  {
    io::GatewayPusher pusher("http://127.0.0.1:" + std::to_string(free_port), "tessera", "rank0",
                             [&](const std::string& line) { warnings.push_back(line); });
    for (int i = 0; i < 3; ++i) {
      pusher.publish("a 3\n");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_CONTAINS(warnings[0], "cannot push to http://127.0.0.1:" + std::to_string(free_port));
  EXPECT_CONTAINS(warnings[0], "training goes on");
}

}  // namespace
}  // namespace tessera::testing
