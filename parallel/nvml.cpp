// Nvml (parallel/nvml.h): the library opened and started, its symbols bound
// one by one (a missing one leaves only its query unanswered), and the
// readings converted to base units.
#include "parallel/nvml.h"

#include <dlfcn.h>

namespace tessera::parallel {
namespace {

constexpr int kTemperatureGpu = 0;  // NVML_TEMPERATURE_GPU
constexpr int kClockSm = 1;         // NVML_CLOCK_SM
constexpr int kClockMemory = 2;     // NVML_CLOCK_MEM

}  // namespace

template <typename Function>
void Nvml::bind(Function& function, const char* symbol) {
  function = reinterpret_cast<Function>(dlsym(handle_, symbol));
}

Nvml::Nvml(const std::string& library) {
  handle_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) return;
  bind(init_, "nvmlInit_v2");
  bind(shutdown_, "nvmlShutdown");
  bind(count_, "nvmlDeviceGetCount_v2");
  bind(handle_by_index_, "nvmlDeviceGetHandleByIndex_v2");
  bind(handle_by_pci_bus_id_, "nvmlDeviceGetHandleByPciBusId_v2");
  bind(index_, "nvmlDeviceGetIndex");
  bind(pci_info_, "nvmlDeviceGetPciInfo_v3");
  bind(utilization_, "nvmlDeviceGetUtilizationRates");
  bind(memory_, "nvmlDeviceGetMemoryInfo");
  bind(power_, "nvmlDeviceGetPowerUsage");
  bind(temperature_, "nvmlDeviceGetTemperature");
  bind(clock_, "nvmlDeviceGetClockInfo");
  started_ = init_ && shutdown_ && count_ && handle_by_index_ && init_() == 0;
}

Nvml::~Nvml() {
  if (started_) shutdown_();
  if (handle_) dlclose(handle_);
}

std::optional<Nvml::Device> Nvml::device(unsigned index) const {
  Device device = nullptr;
  if (!started_ || handle_by_index_(index, &device) != 0) return std::nullopt;
  return device;
}

std::optional<std::vector<std::string>> Nvml::gpu_bus_ids() const {
  unsigned count = 0;
  if (!started_ || !pci_info_ || count_(&count) != 0) return std::nullopt;
  std::vector<std::string> ids;
  for (unsigned i = 0; i < count; ++i) {
    const std::optional<Device> gpu = device(i);
    PciInfo info{};
    if (!gpu || pci_info_(*gpu, &info) != 0) return std::nullopt;
    info.bus_id[sizeof info.bus_id - 1] = '\0';
    ids.emplace_back(info.bus_id);
  }
  return ids;
}

std::optional<unsigned> Nvml::find_gpu(const std::string& pci_bus_id, unsigned index) const {
  if (!started_) return std::nullopt;
  if (pci_bus_id.empty()) return device(index) ? std::optional<unsigned>(index) : std::nullopt;
  Device gpu = nullptr;
  unsigned found = 0;
  if (!handle_by_pci_bus_id_ || !index_ || handle_by_pci_bus_id_(pci_bus_id.c_str(), &gpu) != 0 ||
      index_(gpu, &found) != 0)
    return std::nullopt;
  return found;
}

GpuSample Nvml::sample(unsigned index) const {
  GpuSample sample;
  const std::optional<Device> gpu = device(index);
  if (!gpu) return sample;
  Utilization utilization{};
  if (utilization_ && utilization_(*gpu, &utilization) == 0) sample.utilization_ratio = utilization.gpu / 100.0;
  Memory memory{};
  if (memory_ && memory_(*gpu, &memory) == 0) {
    sample.memory_used_bytes = double(memory.used);
    sample.memory_total_bytes = double(memory.total);
  }
  unsigned value = 0;
  if (power_ && power_(*gpu, &value) == 0) sample.power_watts = value / 1e3;
  if (temperature_ && temperature_(*gpu, kTemperatureGpu, &value) == 0) sample.temperature_celsius = double(value);
  if (clock_ && clock_(*gpu, kClockSm, &value) == 0) sample.sm_clock_hertz = value * 1e6;
  if (clock_ && clock_(*gpu, kClockMemory, &value) == 0) sample.memory_clock_hertz = value * 1e6;
  return sample;
}

}  // namespace tessera::parallel
