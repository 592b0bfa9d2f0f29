// A stand-in for NVML's libnvidia-ml.so.1, built as a shared library for the
// tests of parallel/nvml.h and the training monitor's GPU series: it exports
// the C functions Tessera looks up with dlsym and answers them from
// environment variables the test sets (read at each call), so that the
// loader, the unit conversions and the handling of failing calls run on a
// machine without a GPU driver. Nothing but tests loads it.
//
//   TESSERA_NVML_STAND_IN_INIT=fail            nvmlInit_v2 fails
//   TESSERA_NVML_STAND_IN_GPUS=ID,ID,...       the GPUs' PCI bus ids, in index order
//   TESSERA_NVML_STAND_IN_<READING>=V,V,...    each GPU's reading, in NVML's units;
//                                              "fail" (or nothing) for a GPU: that call fails
// with READING one of UTILIZATION (percent), MEMORY_USED, MEMORY_TOTAL
// (bytes), POWER_MW, TEMPERATURE (Celsius), SM_CLOCK_MHZ, MEMORY_CLOCK_MHZ.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int kSuccess = 0, kUninitialized = 1, kInvalidArgument = 2, kNotSupported = 3, kNotFound = 6;

std::vector<std::string> listed(const char* variable) {
  const char* text = std::getenv(variable);
  std::vector<std::string> items;
  std::stringstream in(text ? text : "");
  for (std::string item; std::getline(in, item, ',');) items.push_back(item);
  return items;
}

// GPU `index`'s value of `reading`; nothing for "fail" or when not set.
std::optional<unsigned long long> reading(const std::string& name, unsigned index) {
  const std::vector<std::string> values = listed(("TESSERA_NVML_STAND_IN_" + name).c_str());
  if (index >= values.size() || values[index] == "fail" || values[index].empty()) return std::nullopt;
  return std::stoull(values[index]);
}

unsigned gpu_count() {
  return unsigned(listed("TESSERA_NVML_STAND_IN_GPUS").size());
}

// Handles are index + 1, so that no handle is null.
void* handle_of(unsigned index) {
  return reinterpret_cast<void*>(uintptr_t(index) + 1);
}
unsigned index_of(void* device) {
  return unsigned(reinterpret_cast<uintptr_t>(device) - 1);
}

// "00000000:3B:00.0" and "0000:3b:00.0" name the same GPU.
std::string bus_and_function(std::string id) {
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  const auto colon = id.find(':');
  return colon == std::string::npos ? id : id.substr(colon);
}

int answer(const std::optional<unsigned long long>& value, unsigned* out) {
  if (!value) return kNotSupported;
  *out = unsigned(*value);
  return kSuccess;
}

}  // namespace

extern "C" {

struct StandInPciInfo {  // nvmlPciInfo_t
  char bus_id_legacy[16];
  unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
struct StandInUtilization {  // nvmlUtilization_t
  unsigned gpu, memory;
};
struct StandInMemory {  // nvmlMemory_t
  unsigned long long total, free, used;
};

int nvmlInit_v2() {
  const char* init = std::getenv("TESSERA_NVML_STAND_IN_INIT");
  return init && std::strcmp(init, "fail") == 0 ? kUninitialized : kSuccess;
}
int nvmlShutdown() {
  return kSuccess;
}
int nvmlDeviceGetCount_v2(unsigned* count) {
  *count = gpu_count();
  return kSuccess;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void** device) {
  if (index >= gpu_count()) return kInvalidArgument;
  *device = handle_of(index);
  return kSuccess;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* pci_bus_id, void** device) {
  const std::vector<std::string> ids = listed("TESSERA_NVML_STAND_IN_GPUS");
  for (unsigned i = 0; i < ids.size(); ++i)
    if (bus_and_function(ids[i]) == bus_and_function(pci_bus_id)) {
      *device = handle_of(i);
      return kSuccess;
    }
  return kNotFound;
}
int nvmlDeviceGetIndex(void* device, unsigned* index) {
  *index = index_of(device);
  return kSuccess;
}
int nvmlDeviceGetPciInfo_v3(void* device, StandInPciInfo* info) {
  const std::vector<std::string> ids = listed("TESSERA_NVML_STAND_IN_GPUS");
  *info = StandInPciInfo{};
  std::strncpy(info->bus_id, ids.at(index_of(device)).c_str(), sizeof info->bus_id - 1);
  return kSuccess;
}
int nvmlDeviceGetUtilizationRates(void* device, StandInUtilization* utilization) {
  return answer(reading("UTILIZATION", index_of(device)), &utilization->gpu);
}
int nvmlDeviceGetMemoryInfo(void* device, StandInMemory* memory) {
  const auto used = reading("MEMORY_USED", index_of(device)), total = reading("MEMORY_TOTAL", index_of(device));
  if (!used || !total) return kNotSupported;
  *memory = StandInMemory{*total, *total - *used, *used};
  return kSuccess;
}
int nvmlDeviceGetPowerUsage(void* device, unsigned* milliwatts) {
  return answer(reading("POWER_MW", index_of(device)), milliwatts);
}
int nvmlDeviceGetTemperature(void* device, int sensor, unsigned* celsius) {
  return sensor == 0 ? answer(reading("TEMPERATURE", index_of(device)), celsius) : kInvalidArgument;
}
int nvmlDeviceGetClockInfo(void* device, int clock, unsigned* megahertz) {
  if (clock == 1) return answer(reading("SM_CLOCK_MHZ", index_of(device)), megahertz);
  if (clock == 2) return answer(reading("MEMORY_CLOCK_MHZ", index_of(device)), megahertz);
  return kInvalidArgument;
}

}  // extern "C"
