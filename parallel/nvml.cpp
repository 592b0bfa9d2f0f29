// Nvml (parallel/nvml.h): the library opened and started, its symbols bound
// one by one (a missing one leaves only its query unanswered), a CUDA device
// found among the GPUs and their MIG slices by UUID, and the readings of the
// fields its location has converted to base units.
#include "parallel/nvml.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace tessera::parallel {
namespace {

constexpr int kTemperatureGpu = 0;   // NVML_TEMPERATURE_GPU
constexpr int kClockSm = 1;          // NVML_CLOCK_SM
constexpr int kClockMemory = 2;      // NVML_CLOCK_MEM
constexpr unsigned kMigEnabled = 1;  // NVML_DEVICE_MIG_ENABLE
constexpr unsigned kUuidBytes = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE

// A UUID as compared: lower case, without NVML's "GPU-" or "MIG-" prefix.
std::string uuid_key(std::string uuid) {
  std::transform(uuid.begin(), uuid.end(), uuid.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  for (const char* prefix : {"gpu-", "mig-"})
    if (uuid.starts_with(prefix)) return uuid.substr(4);
  return uuid;
}

}  // namespace

GpuFields fields_of(const GpuLocation& location) {
  if (!location.mig_mode) return {};
  return GpuFields{.utilization = false, .memory = location.slice.has_value(), .power = false};
}

std::string unreported_fields(const GpuFields& fields) {
  std::string names;
  for (const auto& [reported, name] : {std::pair{fields.utilization, "utilization"},
                                       {fields.memory, "memory"},
                                       {fields.power, "power"},
                                       {fields.temperature, "temperature"},
                                       {fields.clocks, "clocks"}})
    if (!reported) names += (names.empty() ? "" : ", ") + std::string(name);
  return names;
}

std::string uuid_text(const std::array<unsigned char, 16>& bytes) {
  std::string text;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", unsigned(bytes[i]));
    text += hex;
  }
  return text;
}

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
  bind(pci_info_, "nvmlDeviceGetPciInfo_v3");
  bind(uuid_, "nvmlDeviceGetUUID");
  bind(mig_mode_, "nvmlDeviceGetMigMode");
  bind(max_mig_devices_, "nvmlDeviceGetMaxMigDeviceCount");
  bind(mig_handle_by_index_, "nvmlDeviceGetMigDeviceHandleByIndex");
  bind(gpu_instance_id_, "nvmlDeviceGetGpuInstanceId");
  bind(compute_instance_id_, "nvmlDeviceGetComputeInstanceId");
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

std::optional<Nvml::Device> Nvml::mig_device(Device gpu, unsigned mig_index) const {
  Device slice = nullptr;
  if (!mig_handle_by_index_ || mig_handle_by_index_(gpu, mig_index, &slice) != 0) return std::nullopt;
  return slice;
}

std::string Nvml::uuid_of(Device device) const {
  char uuid[kUuidBytes] = {};
  if (!uuid_ || uuid_(device, uuid, kUuidBytes) != 0) return {};
  uuid[kUuidBytes - 1] = '\0';
  return uuid;
}

bool Nvml::in_mig_mode(Device gpu) const {
  unsigned current = 0, pending = 0;
  return mig_mode_ && mig_mode_(gpu, &current, &pending) == 0 && current == kMigEnabled;
}

// The slice of GPU `index` (in MIG mode) whose UUID's key is `key`.
std::optional<GpuLocation> Nvml::find_slice(Device gpu, unsigned index, const std::string& key) const {
  unsigned count = 0;
  if (!max_mig_devices_ || !gpu_instance_id_ || !compute_instance_id_ || max_mig_devices_(gpu, &count) != 0)
    return std::nullopt;
  for (unsigned m = 0; m < count; ++m) {  // indices without a slice answer NOT_FOUND
    const std::optional<Device> slice = mig_device(gpu, m);
    if (!slice || uuid_key(uuid_of(*slice)) != key) continue;
    GpuLocation::MigSlice found{m, 0, 0};
    if (gpu_instance_id_(*slice, &found.gpu_instance) != 0 ||
        compute_instance_id_(*slice, &found.compute_instance) != 0)
      return std::nullopt;
    return GpuLocation{index, true, found};
  }
  return std::nullopt;
}

std::optional<GpuLocation> Nvml::find_gpu(const std::string& uuid) const {
  unsigned count = 0;
  const std::string key = uuid_key(uuid);
  if (!started_ || key.empty() || count_(&count) != 0) return std::nullopt;
  for (unsigned i = 0; i < count; ++i) {
    const std::optional<Device> gpu = device(i);
    if (!gpu) continue;
    const bool mig = in_mig_mode(*gpu);
    if (uuid_key(uuid_of(*gpu)) == key) return GpuLocation{i, mig, std::nullopt};
    if (!mig) continue;
    if (std::optional<GpuLocation> slice = find_slice(*gpu, i, key)) return slice;
  }
  return std::nullopt;
}

GpuSample Nvml::sample(const GpuLocation& location) const {
  GpuSample sample;
  const std::optional<Device> gpu = device(location.index);
  if (!gpu) return sample;
  const GpuFields fields = fields_of(location);
  // A slice's own memory is on its MIG handle; every other reading is the GPU's.
  const std::optional<Device> memory_of = location.slice ? mig_device(*gpu, location.slice->device_index) : gpu;
  Utilization utilization{};
  if (fields.utilization && utilization_ && utilization_(*gpu, &utilization) == 0)
    sample.utilization_ratio = utilization.gpu / 100.0;
  Memory memory{};
  if (fields.memory && memory_of && memory_ && memory_(*memory_of, &memory) == 0) {
    sample.memory_used_bytes = double(memory.used);
    sample.memory_total_bytes = double(memory.total);
  }
  unsigned value = 0;
  if (fields.power && power_ && power_(*gpu, &value) == 0) sample.power_watts = value / 1e3;
  if (fields.temperature && temperature_ && temperature_(*gpu, kTemperatureGpu, &value) == 0)
    sample.temperature_celsius = double(value);
  if (fields.clocks && clock_ && clock_(*gpu, kClockSm, &value) == 0) sample.sm_clock_hertz = value * 1e6;
  if (fields.clocks && clock_ && clock_(*gpu, kClockMemory, &value) == 0) sample.memory_clock_hertz = value * 1e6;
  return sample;
}

}  // namespace tessera::parallel
