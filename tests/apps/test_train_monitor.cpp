// The training monitor's Prometheus series, in process: GpuMonitor reading
// the NVML stand-in (tests/support/nvml_stand_in.cpp) into the tessera_gpu_*
// families, in base units, a failing NVML call dropping only its series and
// no NVML dropping them all; ranks on two MIG slices of one GPU exporting
// their own memory under their instance labels, the fields a slice cannot
// report absent and named; and a TrainingMonitor on one rank serving, over
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

// The GPU families of ranks whose monitors are `ranks` (nullptr: a rank
// without a GPU); each rank's figures follow two others, as in the exchange.
std::string gpu_text(const std::vector<const GpuMonitor*>& ranks) {
  std::vector<std::vector<double>> figures;
  const GpuMonitor none;
  for (const GpuMonitor* rank : ranks) {
    figures.push_back({7.0, 8.0});
    const std::vector<double> gpu = (rank ? rank : &none)->figures();
    figures.back().insert(figures.back().end(), gpu.begin(), gpu.end());
  }
  return io::prometheus_text(GpuMonitor::families(figures, 2, {"node-a", "node-b"}));
}

// Rank 0 trains on NVML's GPU 1 (CUDA's device 0 under
// CUDA_VISIBLE_DEVICES=1: only the UUID says which), rank 1 on none.
std::string gpu_text(const GpuMonitor& rank0) {
  return gpu_text({&rank0, nullptr});
}

// CUDA's form of a UUID: NVML's without its "GPU-" or "MIG-".
std::string cuda_uuid(const std::string& nvml_uuid) {
  return nvml_uuid.substr(4);
}

TEST(GpuMonitor, ReadingsBecomeTheGpuSeriesInBaseUnits) {
  NvmlStandIn nvml;
  nvml.two_gpus();
  const GpuMonitor gpu(cuda_uuid(NvmlStandIn::kGpu1), NvmlStandIn::library());
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
  const std::string text = gpu_text(GpuMonitor(cuda_uuid(NvmlStandIn::kGpu1), NvmlStandIn::library()));
  EXPECT_EQ(text.find("tessera_gpu_power_watts"), std::string::npos) << text;
  EXPECT_EQ(text.find("tessera_gpu_temperature_celsius"), std::string::npos) << text;
  EXPECT_EQ(value_of(text, "tessera_gpu_sm_clock_hertz{rank=\"0\",node=\"node-a\",gpu=\"1\"}"), 1.98e9) << text;
  EXPECT_EQ(value_of(text, "tessera_gpu_utilization_ratio{rank=\"0\",node=\"node-a\",gpu=\"1\"}"), 0.87);
}

TEST(GpuMonitor, NoNvmlOrNoSuchGpuMeansNoGpuSeriesAndNoError) {
  NvmlStandIn nvml;
  nvml.two_gpus();
  const GpuMonitor missing(cuda_uuid(NvmlStandIn::kGpu1), "/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(missing.available());
  EXPECT_EQ(gpu_text(missing).find("tessera_gpu_"), std::string::npos);
  EXPECT_EQ(missing.note(), "");
  const GpuMonitor elsewhere("99999999-0000-0000-0000-000000000000", NvmlStandIn::library());
  EXPECT_FALSE(elsewhere.available());
  EXPECT_EQ(gpu_text(elsewhere).find("tessera_gpu_"), std::string::npos);
  EXPECT_NE(elsewhere.note().find("neither a GPU nor a MIG slice NVML lists"), std::string::npos) << elsewhere.note();
  const GpuMonitor no_uuid("", NvmlStandIn::library());  // never a guess from CUDA's index
  EXPECT_FALSE(no_uuid.available());
  EXPECT_NE(no_uuid.note().find("no UUID"), std::string::npos) << no_uuid.note();
}

TEST(GpuMonitor, RanksOnTwoMigSlicesExportTheirOwnMemoryUnderTheirInstances) {
  NvmlStandIn nvml;
  nvml.two_gpus_one_split();
  const GpuMonitor first(cuda_uuid(NvmlStandIn::kSlice0), NvmlStandIn::library());
  const GpuMonitor second(cuda_uuid(NvmlStandIn::kSlice1), NvmlStandIn::library());
  ASSERT_TRUE(first.available());
  ASSERT_TRUE(second.available());
  const std::string text = gpu_text({&first, &second});
  const std::string rank0 = "{rank=\"0\",node=\"node-a\",gpu=\"1\",gpu_instance=\"1\",compute_instance=\"0\"}";
  const std::string rank1 = "{rank=\"1\",node=\"node-b\",gpu=\"1\",gpu_instance=\"2\",compute_instance=\"0\"}";
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_used_bytes" + rank0), 3221225472.0) << text;
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_total_bytes" + rank0), 42949672960.0);
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_used_bytes" + rank1), 7516192768.0);
  EXPECT_EQ(value_of(text, "tessera_gpu_memory_total_bytes" + rank1), 21474836480.0);
  EXPECT_EQ(value_of(text, "tessera_gpu_sm_clock_hertz" + rank1), 1.98e9);
  EXPECT_EQ(value_of(text, "tessera_gpu_temperature_celsius" + rank0), 71.0);
  EXPECT_EQ(text.find("tessera_gpu_utilization_ratio"), std::string::npos) << text;
  EXPECT_EQ(text.find("tessera_gpu_power_watts"), std::string::npos) << text;
  for (const GpuMonitor* slice : {&first, &second})
    EXPECT_NE(slice->note().find("NVML measures no utilization, power per slice"), std::string::npos) << slice->note();
  EXPECT_NE(first.note().find("gpu_instance=1 compute_instance=0 of NVML GPU 1"), std::string::npos) << first.note();
  const GpuMonitor whole(cuda_uuid(NvmlStandIn::kGpu0), NvmlStandIn::library());
  EXPECT_EQ(whole.note(), "");
  EXPECT_EQ(gpu_text(whole).find("gpu_instance"), std::string::npos) << "a whole GPU has no instance labels";
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
  parallel::Layout layout(*world, {});
  TrainConfig config;
  config.log_interval = 1;
  config.metrics_port = [] {
    const io::MetricsEndpoint probe("127.0.0.1", 0);  // a free port, free again when it closes
    return probe.port();
  }();
  TrainingMonitor monitor(config, layout, ctx, Device::cpu(), [](const std::string&) {});
  ASSERT_EQ(monitor.metrics_port(), config.metrics_port);
  Tensor t = ctx.full(Shape{64}, DType::f32, 1.0);
  layout.group("dp").all_reduce(t, parallel::ReduceOp::sum)->wait();
  io::StepRecord record;
  record.step = 1;
  monitor.record_step(record, StepFigures{});
  monitor.exchange(1, false);
  const std::string rank = std::string("rank=\"0\",node=\"") + host + "\"";
  std::string text = scrape(monitor.metrics_port());
  EXPECT_EQ(value_of(text, "tessera_comm_seconds_total{" + rank + ",axis=\"dp\"}"), layout.group("dp").counters().seconds)
      << text;
  EXPECT_GT(layout.group("dp").counters().seconds, 0.0);
  EXPECT_EQ(value_of(text, "tessera_comm_seconds_total{" + rank + ",axis=\"tp\"}"), layout.group("tp").counters().seconds);
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
