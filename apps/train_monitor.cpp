// TrainingMonitor (apps/train_monitor.h): the window of figures, the
// exchange, the straggler rule and the Prometheus families; GpuMonitor's
// readings and families.
#include "apps/train_monitor.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "core/cuda_runtime.h"
#include "core/error.h"

namespace tessera::app {
namespace {

// The figures each rank contributes to an exchange, in this order.
enum Figure {
  kStep,
  kLoss,
  kLr,
  kThroughput,
  kStepSeconds,
  kDataWaitSeconds,
  kSyncSeconds,
  kComputeSeconds,
  kGradNorm,
  kSkippedTotal,
  kDpBytes,
  kTpBytes,
  kPpBytes,
  kCheckpointStallTotal,
  kAllocated,
  kReserved,
  kPeak,
  kDpSeconds,
  kTpSeconds,
  kPpSeconds,
  kCheckpointWriteSeconds,
  kGpuFirst,  // GpuMonitor::kFigures of them
  kFigures = kGpuFirst + GpuMonitor::kFigures
};

// The GPU figures, after kGpuFirst: the NVML index, the MIG slice's
// instance ids (NaN for a whole GPU), then GpuSample's fields.
enum GpuFigure {
  kGpuIndex,
  kGpuInstance,
  kGpuComputeInstance,
  kGpuUtilization,
  kGpuMemoryUsed,
  kGpuMemoryTotal,
  kGpuPower,
  kGpuTemperature,
  kGpuSmClock,
  kGpuMemoryClock
};

// Room for any host name (Linux's are at most 64 bytes).
constexpr int64_t kHostNameBytes = 256;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Every per-rank series' labels: the rank and its host.
io::PrometheusLabels rank_labels(size_t rank, const std::vector<std::string>& nodes) {
  return {{"rank", std::to_string(rank)}, {"node", nodes[rank]}};
}

io::PrometheusFamily per_rank(const std::string& name, const std::string& help, const std::string& type,
                              const std::vector<std::vector<double>>& ranks, Figure figure,
                              const std::vector<std::string>& nodes) {
  io::PrometheusFamily family{name, help, type, {}};
  for (size_t r = 0; r < ranks.size(); ++r) family.samples.push_back({rank_labels(r, nodes), ranks[r][figure]});
  return family;
}

std::string host_name() {
  char host[kHostNameBytes] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

// Every rank's host name, by rank: one all-gather of fixed-size byte arrays.
std::vector<std::string> gather_host_names(parallel::Communicator& world, Context& context) {
  const std::string mine = host_name();
  std::vector<uint8_t> bytes(size_t(kHostNameBytes), 0);
  std::copy(mine.begin(), mine.end(), bytes.begin());
  const Tensor local = context.from_vector(Shape{kHostNameBytes}, bytes, Device::cpu());
  Tensor all = context.empty(Shape{kHostNameBytes * world.size()}, DType::u8, Device::cpu());
  world.all_gather(local, all)->wait();
  const std::vector<uint8_t> gathered = all.to_vector<uint8_t>();
  std::vector<std::string> names;
  for (int r = 0; r < world.size(); ++r) {
    const char* name = reinterpret_cast<const char*>(gathered.data() + r * kHostNameBytes);
    names.emplace_back(name, strnlen(name, size_t(kHostNameBytes)));
  }
  return names;
}

// The launcher's id of this job (Slurm's, else Open MPI's or PMIx's), or "".
std::string launcher_job_id() {
  for (const char* name : {"SLURM_JOB_ID", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"})
    if (const char* value = std::getenv(name); value && *value) return value;
  return "";
}

// The Pushgateway group of this job: rank 0's host, and Slurm's job id when there is one.
std::string push_instance() {
  const char* job = std::getenv("SLURM_JOB_ID");
  return host_name() + (job && *job ? std::string("-") + job : "");
}

double or_nan(const std::optional<double>& value) {
  return value.value_or(NAN);
}

}  // namespace

TrainingMonitor::TrainingMonitor(const TrainConfig& c, parallel::Layout& layout, Context& context, Device device,
                                 std::function<void(const std::string&)> say, const std::string& endpoint_host)
    : config_(c), layout_(layout), context_(context), device_(device), say_(std::move(say)) {
  std::vector<std::string> nodes = gather_host_names(layout.world(), context);
  if (device.is_cuda()) {
    const std::optional<std::array<unsigned char, 16>> uuid = cuda_runtime::uuid(device.index);
    gpu_ = GpuMonitor(uuid ? parallel::uuid_text(*uuid) : "");
  }
  if (layout.world().rank() != 0) return;
  if (!gpu_.note().empty()) say_("GPU metrics: " + device.to_string() + " " + gpu_.note());
  nodes_ = std::move(nodes);
  job_id_ = launcher_job_id();
  if (c.metrics_port > 0) endpoint_ = std::make_unique<io::MetricsEndpoint>("0.0.0.0", c.metrics_port);
  if (!c.metrics_push.empty())
    pusher_ = std::make_unique<io::GatewayPusher>(
        c.metrics_push, "tessera", push_instance(),
        [](const std::string& line) { std::fprintf(stderr, "tessera: warning: %s\n", line.c_str()); });
  if (metrics_port() > 0)
    say_("metrics: Prometheus can scrape http://" + endpoint_host + ":" + std::to_string(metrics_port()) +
         "/metrics (every rank's series, refreshed every " + std::to_string(c.log_interval) + " steps)");
}

TrainingMonitor::~TrainingMonitor() = default;

int TrainingMonitor::metrics_port() const {
  return endpoint_ ? endpoint_->port() : 0;
}

void TrainingMonitor::on_step_end(io::StepEnd& end) {
  StepFigures figures;
  figures.step_seconds = end.seconds;
  figures.data_wait_seconds = end.data_wait_seconds;
  figures.sync_seconds = end.sync_seconds;
  for (const auto& [name, value] : end.record.extra) {
    if (name == "checkpoint_stall_ms") figures.checkpoint_stall_seconds += value * 1e-3;
    if (name == "checkpoint_write_s") figures.checkpoint_write_seconds = value;
  }
  record_step(end.record, figures);
  for (const auto& figure : exchange(end.step, end.last)) end.record.extra.push_back(figure);
}

void TrainingMonitor::record_step(const io::StepRecord& record, const StepFigures& figures) {
  last_record_ = record;
  window_steps_ += 1;
  window_step_s_ += figures.step_seconds;
  window_data_s_ += figures.data_wait_seconds;
  window_sync_s_ += figures.sync_seconds;
  if (record.skipped) skipped_total_ += 1;
  checkpoint_stall_total_ += figures.checkpoint_stall_seconds;
  if (figures.checkpoint_write_seconds) checkpoint_write_s_ = *figures.checkpoint_write_seconds;
}

std::vector<double> TrainingMonitor::local_figures() const {
  std::vector<double> f(kFigures, 0.0);
  const double steps = std::max(window_steps_, 1.0);
  f[kStep] = double(last_record_.step);
  f[kLoss] = last_record_.loss;
  f[kLr] = last_record_.lr;
  f[kThroughput] = last_record_.tokens_per_s.value_or(last_record_.samples_per_s.value_or(0.0));
  f[kStepSeconds] = window_step_s_ / steps;
  f[kDataWaitSeconds] = window_data_s_ / steps;
  f[kSyncSeconds] = window_sync_s_ / steps;
  f[kComputeSeconds] = std::max(0.0, (window_step_s_ - window_data_s_ - window_sync_s_) / steps);
  f[kGradNorm] = last_record_.grad_norm.value_or(NAN);
  f[kSkippedTotal] = skipped_total_;
  f[kDpBytes] = double(layout_.group("dp").counters().total_bytes());
  f[kTpBytes] = double(layout_.group("tp").counters().total_bytes());
  f[kPpBytes] = double(layout_.group("pp").counters().total_bytes());
  f[kCheckpointStallTotal] = checkpoint_stall_total_;
  const AllocatorStats stats = context_.allocator(device_).stats();
  f[kAllocated] = double(stats.allocated_bytes);
  f[kReserved] = double(stats.reserved_bytes);
  f[kPeak] = double(stats.peak_allocated_bytes);
  f[kDpSeconds] = layout_.group("dp").counters().seconds;
  f[kTpSeconds] = layout_.group("tp").counters().seconds;
  f[kPpSeconds] = layout_.group("pp").counters().seconds;
  f[kCheckpointWriteSeconds] = checkpoint_write_s_;
  const std::vector<double> gpu = gpu_.figures();
  std::copy(gpu.begin(), gpu.end(), f.begin() + kGpuFirst);
  return f;
}

std::optional<Straggler> TrainingMonitor::find_straggler(const std::vector<std::vector<double>>& ranks) const {
  if (ranks.size() < 2 || config_.straggler_threshold <= 0.0) return std::nullopt;
  std::vector<double> compute;
  for (const auto& figures : ranks) compute.push_back(figures[kComputeSeconds]);
  const double middle = median(compute);
  const size_t slowest = size_t(std::max_element(compute.begin(), compute.end()) - compute.begin());
  if (!(compute[slowest] > (1.0 + config_.straggler_threshold) * middle)) return std::nullopt;
  return Straggler{int(slowest), compute[slowest], middle};
}

std::vector<std::pair<std::string, double>> TrainingMonitor::exchange(int64_t step, bool last) {
  if (!(last || step % config_.log_interval == 0)) return {};
  parallel::Communicator& world = layout_.world();
  // Doubles travel as their bits in int64 (there is no f64 tensor; nothing is rounded).
  std::vector<int64_t> mine;
  for (const double value : local_figures()) mine.push_back(std::bit_cast<int64_t>(value));
  Tensor local = context_.from_vector(Shape{kFigures}, mine, Device::cpu());
  Tensor all = context_.empty(Shape{int64_t(kFigures) * world.size()}, DType::i64, Device::cpu());
  world.all_gather(local, all)->wait();
  window_steps_ = window_step_s_ = window_data_s_ = window_sync_s_ = 0.0;
  if (world.rank() != 0) return {};

  std::vector<double> values;
  for (const int64_t bits : all.to_vector<int64_t>()) values.push_back(std::bit_cast<double>(bits));
  std::vector<std::vector<double>> ranks(size_t(world.size()));
  for (size_t r = 0; r < ranks.size(); ++r)
    ranks[r].assign(values.begin() + long(r * kFigures), values.begin() + long((r + 1) * kFigures));
  const std::optional<Straggler> straggler = find_straggler(ranks);
  std::vector<std::pair<std::string, double>> extra;
  if (straggler) {
    stragglers_.push_back(*straggler);
    char line[256];
    std::snprintf(line, sizeof line,
                  "straggler: rank %d computed %.3f s per step in the last %lld steps, %.2fx the median %.3f s; "
                  "the other ranks waited for it in their communication",
                  straggler->rank, straggler->compute_seconds,
                  static_cast<long long>(std::min<int64_t>(step, config_.log_interval)), straggler->slowdown(),
                  straggler->median_seconds);
    say_(line);
    extra = {{"straggler_rank", double(straggler->rank)}, {"straggler_slowdown", straggler->slowdown()}};
  }
  if (endpoint_ || pusher_) {
    const std::string text = prometheus(ranks, straggler);
    if (endpoint_) endpoint_->publish(text);
    if (pusher_) pusher_->publish(text);
  }
  return extra;
}

namespace {

// A mixture of experts' figures of the last step (apps/expert_load.h: the
// record's moe_* entries): the losses and dropped share as gauges, the
// tokens per expert (fewest, most) and the imbalance per layer.
std::vector<io::PrometheusFamily> expert_families(const io::StepRecord& record) {
  io::PrometheusFamily tokens{"tessera_moe_expert_tokens", "Tokens an expert of the layer received in the last step",
                              "gauge", {}};
  io::PrometheusFamily imbalance{"tessera_moe_imbalance", "Most tokens of an expert over the mean, per layer", "gauge",
                                 {}};
  std::vector<io::PrometheusFamily> families;
  for (const auto& [key, value] : record.extra) {
    if (key == "moe_aux_loss" || key == "moe_z_loss" || key == "moe_dropped_fraction")
      families.push_back({"tessera_" + key, key == "moe_dropped_fraction" ? "Share of expert choices dropped over "
                                                                              "capacity in the last step"
                                                                          : "Mixture-of-experts loss of the last step "
                                                                            "(mean per micro-batch, summed over layers)",
                          "gauge", {{{}, value}}});
    if (key.rfind("moe_l", 0) != 0) continue;
    const size_t end = key.find('_', 5);
    const std::string layer = key.substr(5, end - 5), what = key.substr(end + 1);
    if (what == "imbalance") imbalance.samples.push_back({{{"layer", layer}}, value});
    if (what == "tokens_min" || what == "tokens_max")
      tokens.samples.push_back({{{"layer", layer}, {"stat", what == "tokens_min" ? "min" : "max"}}, value});
  }
  if (!tokens.samples.empty()) families.push_back(std::move(tokens));
  if (!imbalance.samples.empty()) families.push_back(std::move(imbalance));
  return families;
}

}  // namespace

std::string TrainingMonitor::prometheus(const std::vector<std::vector<double>>& ranks,
                                        const std::optional<Straggler>& straggler) const {
  std::vector<io::PrometheusFamily> families = {
      per_rank("tessera_step", "Optimizer steps done", "gauge", ranks, kStep, nodes_),
      per_rank("tessera_loss", "Training loss of the last step", "gauge", ranks, kLoss, nodes_),
      per_rank("tessera_learning_rate", "Learning rate of the last step", "gauge", ranks, kLr, nodes_),
      per_rank(nn::model_traits(config_.model).reads_tokens ? "tessera_tokens_per_second" : "tessera_samples_per_second",
               "Throughput of the whole job over the last step", "gauge", ranks, kThroughput, nodes_),
      per_rank("tessera_step_seconds", "Mean step time since the last exchange", "gauge", ranks, kStepSeconds, nodes_),
      per_rank("tessera_data_wait_seconds", "Mean time per step waiting for batches", "gauge", ranks, kDataWaitSeconds,
               nodes_),
      per_rank("tessera_rank_compute_seconds", "Mean time per step not waiting for data or gradient synchronisation",
               "gauge", ranks, kComputeSeconds, nodes_),
      per_rank("tessera_rank_communication_seconds", "Mean exposed gradient synchronisation per step", "gauge", ranks,
               kSyncSeconds, nodes_),
      per_rank("tessera_grad_norm", "Gradient norm of the last step (before clipping)", "gauge", ranks, kGradNorm,
               nodes_),
      per_rank("tessera_skipped_steps_total", "Steps skipped for non-finite gradients", "counter", ranks, kSkippedTotal,
               nodes_),
      per_rank("tessera_checkpoint_stall_seconds_total", "Time the step loop waited for checkpoint saves", "counter",
               ranks, kCheckpointStallTotal, nodes_),
  };
  io::PrometheusFamily written{
      "tessera_checkpoint_write_seconds", "Time the last checkpoint took to write", "gauge", {}};
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!std::isnan(ranks[r][kCheckpointWriteSeconds]))
      written.samples.push_back({rank_labels(r, nodes_), ranks[r][kCheckpointWriteSeconds]});
  if (!written.samples.empty()) families.push_back(written);
  for (const auto& [name, help, figures] :
       {std::tuple{"tessera_comm_bytes_total", "Bytes this rank's communicators moved, per parallel axis",
                   std::array{kDpBytes, kTpBytes, kPpBytes}},
        {"tessera_comm_seconds_total",
         "Time this rank spent in its communicators' operations and waits, per parallel axis",
         std::array{kDpSeconds, kTpSeconds, kPpSeconds}}}) {
    io::PrometheusFamily family{name, help, "counter", {}};
    for (size_t r = 0; r < ranks.size(); ++r)
      for (size_t axis = 0; axis < 3; ++axis) {
        io::PrometheusLabels labels = rank_labels(r, nodes_);
        labels.emplace_back("axis", std::array{"dp", "tp", "pp"}[axis]);
        family.samples.push_back({labels, ranks[r][figures[axis]]});
      }
    families.push_back(family);
  }
  const std::string device = device_.to_string();
  for (const auto& [name, help, figure] :
       {std::tuple{"tessera_memory_allocated_bytes", "Bytes allocated on the training device", kAllocated},
        {"tessera_memory_reserved_bytes", "Bytes the caching allocator holds", kReserved},
        {"tessera_memory_peak_bytes", "Peak bytes allocated in the last step", kPeak}}) {
    io::PrometheusFamily family{name, help, "gauge", {}};
    for (size_t r = 0; r < ranks.size(); ++r) family.samples.push_back({rank_labels(r, nodes_), ranks[r][figure]});
    for (io::PrometheusSample& sample : family.samples) sample.labels.emplace_back("device", device);
    families.push_back(family);
  }
  for (io::PrometheusFamily& family : GpuMonitor::families(ranks, kGpuFirst, nodes_))
    families.push_back(std::move(family));
  for (io::PrometheusFamily& family : expert_families(last_record_)) families.push_back(std::move(family));
  families.push_back({"tessera_eval_loss", "Loss of the last evaluation", "gauge", {{{}, eval_loss_}}});
  families.push_back({"tessera_straggler_rank",
                      "The rank named a straggler at the last exchange (-1: none)",
                      "gauge",
                      {{{}, straggler ? double(straggler->rank) : -1.0}}});
  families.push_back({"tessera_straggler_slowdown_ratio",
                      "Its compute time over the median (0: none)",
                      "gauge",
                      {{{}, straggler ? straggler->slowdown() : 0.0}}});
  families.push_back({"tessera_info",
                      "The run",
                      "gauge",
                      {{{{"model", std::string(nn::model_name(config_.model))},
                         {"layout", "dp=" + std::to_string(layout_.size("dp")) + " tp=" + std::to_string(layout_.size("tp")) +
                                        " pp=" + std::to_string(layout_.size("pp"))},
                         {"version", TESSERA_VERSION},
                         {"job_id", job_id_}},
                        1.0}}});
  return io::prometheus_text(families);
}

}  // namespace tessera::app

namespace tessera::app {

namespace {

// What the log says about a device found (or not) in NVML; "" for a whole GPU.
std::string location_note(const std::optional<parallel::GpuLocation>& gpu, const std::string& uuid) {
  if (!gpu)
    return uuid.empty() ? "has no UUID from CUDA to find it in NVML by: no tessera_gpu_* series"
                        : "(UUID " + uuid + ") is neither a GPU nor a MIG slice NVML lists: no tessera_gpu_* series";
  const std::string unreported = parallel::unreported_fields(parallel::fields_of(*gpu));
  const std::string gpu_index = std::to_string(gpu->index);
  if (gpu->slice)
    return "is MIG slice gpu_instance=" + std::to_string(gpu->slice->gpu_instance) +
           " compute_instance=" + std::to_string(gpu->slice->compute_instance) + " of NVML GPU " + gpu_index +
           ": its memory is the slice's, temperature and clocks the board's; NVML measures no " + unreported +
           " per slice, so those series are absent";
  if (gpu->mig_mode)
    return "is NVML GPU " + gpu_index + ", which is in MIG mode, but CUDA named the whole GPU, not a slice: only " +
           "the board's temperature and clocks are reported (no " + unreported + ")";
  return "";
}

}  // namespace

GpuMonitor::GpuMonitor(const std::string& uuid, const std::string& library)
    : nvml_(std::make_unique<parallel::Nvml>(library)), gpu_(nvml_->find_gpu(uuid)) {
  if (nvml_->available()) note_ = location_note(gpu_, uuid);
}

std::vector<double> GpuMonitor::figures() const {
  std::vector<double> f(kFigures, NAN);
  if (!gpu_) return f;
  const parallel::GpuSample sample = nvml_->sample(*gpu_);
  f[kGpuIndex] = double(gpu_->index);
  if (gpu_->slice) {
    f[kGpuInstance] = double(gpu_->slice->gpu_instance);
    f[kGpuComputeInstance] = double(gpu_->slice->compute_instance);
  }
  f[kGpuUtilization] = or_nan(sample.utilization_ratio);
  f[kGpuMemoryUsed] = or_nan(sample.memory_used_bytes);
  f[kGpuMemoryTotal] = or_nan(sample.memory_total_bytes);
  f[kGpuPower] = or_nan(sample.power_watts);
  f[kGpuTemperature] = or_nan(sample.temperature_celsius);
  f[kGpuSmClock] = or_nan(sample.sm_clock_hertz);
  f[kGpuMemoryClock] = or_nan(sample.memory_clock_hertz);
  return f;
}

std::vector<io::PrometheusFamily> GpuMonitor::families(const std::vector<std::vector<double>>& ranks, size_t offset,
                                                       const std::vector<std::string>& nodes) {
  std::vector<io::PrometheusFamily> families;
  for (const auto& [name, help, figure] :
       {std::tuple{"tessera_gpu_utilization_ratio", "Share of the last sample period a kernel ran on the GPU, 0 to 1",
                   kGpuUtilization},
        {"tessera_gpu_memory_used_bytes", "GPU memory in use (every process; of a MIG slice, the slice's)",
         kGpuMemoryUsed},
        {"tessera_gpu_memory_total_bytes", "GPU memory installed (of a MIG slice, the slice's share)", kGpuMemoryTotal},
        {"tessera_gpu_power_watts", "GPU board power draw (absent for a MIG slice)", kGpuPower},
        {"tessera_gpu_temperature_celsius", "GPU die temperature", kGpuTemperature},
        {"tessera_gpu_sm_clock_hertz", "GPU streaming multiprocessor clock", kGpuSmClock},
        {"tessera_gpu_memory_clock_hertz", "GPU memory clock", kGpuMemoryClock}}) {
    io::PrometheusFamily family{name, help, "gauge", {}};
    for (size_t r = 0; r < ranks.size(); ++r) {
      const double index = ranks[r][offset + kGpuIndex], value = ranks[r][offset + size_t(figure)];
      if (std::isnan(index) || std::isnan(value)) continue;
      io::PrometheusLabels labels = rank_labels(r, nodes);
      labels.emplace_back("gpu", std::to_string(int64_t(index)));
      for (const auto& [label, figure_of_label] :
           {std::pair{"gpu_instance", kGpuInstance}, {"compute_instance", kGpuComputeInstance}})
        if (const double id = ranks[r][offset + size_t(figure_of_label)]; !std::isnan(id))
          labels.emplace_back(label, std::to_string(int64_t(id)));
      family.samples.push_back({labels, value});
    }
    if (!family.samples.empty()) families.push_back(std::move(family));
  }
  return families;
}

}  // namespace tessera::app
