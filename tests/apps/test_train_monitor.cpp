// The training monitor's Prometheus series, in process: GpuMonitor reading
// the NVML stand-in (tests/support/nvml_stand_in.cpp) into the tessera_gpu_*
// families, in base units, a failing NVML call dropping only its series and
// no NVML dropping them all; and a TrainingMonitor on one rank serving, over
// real HTTP, its communicators' counted seconds per axis, the last
// checkpoint's write time (absent before one), the `node` label, and
// tessera_info's `job_id` (and no `job` label). Several ranks, for real:
// tests/multiprocess/test_observability.cpp.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "apps/train_monitor.h"
#include "parallel/local_communicator.h"
#include "tests/support/nvml_stand_in.h"

namespace tessera::app {
namespace {

using testing::NvmlStandIn;

// The value of the sample `series` (name and labels as written) in `text`.
std::optional<double> value_of(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return std::nullopt;
}

// Rank 0 trains on the GPU at CUDA's PCI bus id 0000:86:00.0 (CUDA's device
// 0 under CUDA_VISIBLE_DEVICES=1: NVML's 1), rank 1 on none; each rank's
// figures follow two others, as in the exchange.
std::string gpu_text(const GpuMonitor& rank0) {
  std::vector<std::vector<double>> ranks = {{7.0, 8.0}, {7.0, 8.0}};
  const std::vector<double> first = rank0.figures(), second = GpuMonitor().figures();
  ranks[0].insert(ranks[0].end(), first.begin(), first.end());
  ranks[1].insert(ranks[1].end(), second.begin(), second.end());
  return io::prometheus_text(GpuMonitor::families(ranks, 2, {"node-a", "node-b"}));
}

TEST(GpuMonitor, ReadingsBecomeTheGpuSeriesInBaseUnits) {
  NvmlStandIn nvml;
  nvml.two_gpus();
  const GpuMonitor gpu("0000:86:00.0", 0, NvmlStandIn::library());
  ASSERT_TRUE(gpu.available());
  const std::string text = gpu_text(gpu);
  const std::string labels = "{rank=\"0\",node=\"node-a\",gpu=\"1\"}";
  EXPECT_EQ(value_of(text, "tessera_gpu_utilization_ratio" + labels), 0.87) << text;
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_used_bytes" + labels), 81604378624.0);
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_total_bytes" + labels), 85520809984.0);
  EXPECT_EQ(value_of(text, "tessera_gpu_power_watts" + labels), 699.123);
  EXPECT_EQ(value_of(text, "tessera_gpu_temperature_celsius" + labels), 71.0);
  EXPECT_EQ(value_of(text, "tessera_gpu_sm_clock_hertz" + labels), 1.98e9);
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_clock_hertz" + labels), 2.619e9);
  EXPECT_EQ(text.find("rank=\"1\""), std::string::npos) << "rank 1 has no GPU:\n" << text;
  EXPECT_NE(text.find("# TYPE tessera_gpu_power_watts gauge"), std::string::npos);
}

TEST(GpuMonitor, AFailingCallDropsOnlyItsSeries) {
  NvmlStandIn nvml;
  nvml.two_gpus();
  nvml.set("POWER_MW", "71250,fail").set("TEMPERATURE", "33,fail");
  const std::string text = gpu_text(GpuMonitor("0000:86:00.0", 0, NvmlStandIn::library()));
  EXPECT_EQ(text.find("tessera_gpu_power_watts"), std::string::npos) << text;
  EXPECT_EQ(text.find("tessera_gpu_temperature_celsius"), std::string::npos) << text;
  EXPECT_EQ(value_of(text, "tessera_gpu_sm_clock_hertz{rank=\"0\",node=\"node-a\",gpu=\"1\"}"), 1.98e9) << text;
  EXPECT_EQ(value_of(text, "tessera_gpu_utilization_ratio{rank=\"0\",node=\"node-a\",gpu=\"1\"}"), 0.87);
}

TEST(GpuMonitor, NoNvmlOrNoSuchGpuMeansNoGpuSeriesAndNoError) {
  NvmlStandIn nvml;
  nvml.two_gpus();
  const GpuMonitor missing("0000:86:00.0", 0, "/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(missing.available());
  EXPECT_EQ(gpu_text(missing).find("tessera_gpu_"), std::string::npos);
  const GpuMonitor elsewhere("0000:99:00.0", 0, NvmlStandIn::library());
  EXPECT_FALSE(elsewhere.available());
  EXPECT_EQ(gpu_text(elsewhere).find("tessera_gpu_"), std::string::npos);
}

// SLURM_JOB_ID set for the life of a test, the previous value put back after.
class JobId {
 public:
  explicit JobId(const char* value) {
    if (const char* old = std::getenv("SLURM_JOB_ID")) previous_ = old;
    setenv("SLURM_JOB_ID", value, 1);
  }
  ~JobId() {
    if (previous_)
      setenv("SLURM_JOB_ID", previous_->c_str(), 1);
    else
      unsetenv("SLURM_JOB_ID");
  }
  JobId(const JobId&) = delete;
  JobId& operator=(const JobId&) = delete;

 private:
  std::optional<std::string> previous_;
};

std::string scrape(int port) {
  httplib::Client client("127.0.0.1", port);
  const auto result = client.Get("/metrics");
  return result && result->status == 200 ? result->body : "";
}

TEST(TrainingMonitor, ServesCommunicationSecondsCheckpointWriteNodeAndJobId) {
  const JobId job("4242");
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  Context ctx;
  auto world = parallel::make_local_communicator();
  parallel::ProcessGrid grid(*world, {});
  TrainConfig config;
  config.log_interval = 1;
  config.metrics_port = [] {
    const io::MetricsEndpoint probe("127.0.0.1", 0);  // a free port, free again when it closes
    return probe.port();
  }();
  TrainingMonitor monitor(config, grid, ctx, Device::cpu(), [](const std::string&) {});
  ASSERT_EQ(monitor.metrics_port(), config.metrics_port);
  Tensor t = ctx.full(Shape{64}, DType::f32, 1.0);
  grid.dp().all_reduce(t, parallel::ReduceOp::sum)->wait();
  io::StepRecord record;
  record.step = 1;
  monitor.record_step(record, StepFigures{});
  monitor.exchange(1, false);
  const std::string rank = std::string("rank=\"0\",node=\"") + host + "\"";
  std::string text = scrape(monitor.metrics_port());
  EXPECT_EQ(value_of(text, "tessera_comm_seconds_total{" + rank + ",axis=\"dp\"}"), grid.dp().counters().seconds)
      << text;
  EXPECT_GT(grid.dp().counters().seconds, 0.0);
  EXPECT_EQ(value_of(text, "tessera_comm_seconds_total{" + rank + ",axis=\"tp\"}"), grid.tp().counters().seconds);
  EXPECT_EQ(value_of(text, "tessera_step{" + rank + "}"), 1.0);
  EXPECT_EQ(text.find("tessera_checkpoint_write_seconds"), std::string::npos) << "no checkpoint yet:\n" << text;
  EXPECT_EQ(text.find("tessera_gpu_"), std::string::npos) << "a CPU rank has no GPU series:\n" << text;
  EXPECT_NE(text.find("job_id=\"4242\""), std::string::npos) << text;
  EXPECT_EQ(text.find("job=\""), std::string::npos) << "Prometheus attaches `job` itself:\n" << text;

  StepFigures saved;
  saved.checkpoint_write_seconds = 1.25;
  record.step = 2;
  monitor.record_step(record, saved);
  monitor.exchange(2, false);
  record.step = 3;
  monitor.record_step(record, StepFigures{});  // the last checkpoint's time stays
  monitor.exchange(3, false);
  text = scrape(monitor.metrics_port());
  EXPECT_EQ(value_of(text, "tessera_checkpoint_write_seconds{" + rank + "}"), 1.25) << text;
}

}  // namespace
}  // namespace tessera::app
