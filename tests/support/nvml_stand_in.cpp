// A stand-in for NVML's libnvidia-ml.so.1, built as a shared library for the
// tests of parallel/nvml.h and the training monitor's GPU series: it exports
// the C functions Tessera looks up with dlsym and answers them from
// environment variables the test sets (read at each call), so that the
// loader, the unit conversions and the handling of failing calls run on a
// machine without a GPU driver. Nothing but tests loads it.
//
//   TESSERA_NVML_STAND_IN_INIT=fail            nvmlInit_v2 fails
//   TESSERA_NVML_STAND_IN_GPUS=ID,ID,...       the GPUs' PCI bus ids, in index order
//   TESSERA_NVML_STAND_IN_UUIDS=U,U,...        their UUIDs ("GPU-..."), in index order
//   TESSERA_NVML_STAND_IN_<READING>=V,V,...    each GPU's reading, in NVML's units;
//                                              "fail" (or nothing) for a GPU: that call fails
//   TESSERA_NVML_STAND_IN_MIG_MODE=M,M,...     each GPU's current MIG mode (1: enabled); a GPU
//                                              without one does not support MIG
//   TESSERA_NVML_STAND_IN_MIG_DEVICES=S,S,...  MIG slices, each GPU:INDEX:GI:CI:UUID:USED:TOTAL
//                                              (parent's NVML index, index among its MIG
//                                              devices, GPU and compute instance ids, "MIG-..."
//                                              UUID, the slice's memory used and total)
// with READING one of UTILIZATION (percent), MEMORY_USED, MEMORY_TOTAL
// (bytes), POWER_MW, TEMPERATURE (Celsius), SM_CLOCK_MHZ, MEMORY_CLOCK_MHZ.
// As NVML does, a GPU in MIG mode measures no utilisation, and a MIG handle
// answers its UUID, instance ids and memory only.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int kSuccess = 0, kUninitialized = 1, kInvalidArgument = 2, kNotSupported = 3, kNotFound = 6,
              kInsufficientSize = 7;
constexpr unsigned kMaxMigDevices = 7;         // an A100's or H100's
constexpr uintptr_t kMigHandleBase = 0x10000;  // MIG handles: kMigHandleBase * (position in MIG_DEVICES + 1)

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

// GPU handles are index + 1, so that no handle is null; a MIG handle gives
// no GPU index (every GPU reading of it fails).
void* handle_of(unsigned index) {
  return reinterpret_cast<void*>(uintptr_t(index) + 1);
}
unsigned index_of(void* device) {
  const auto handle = reinterpret_cast<uintptr_t>(device);
  return handle >= kMigHandleBase ? ~0u : unsigned(handle - 1);
}

struct MigSlice {
  unsigned parent = 0, index = 0, gpu_instance = 0, compute_instance = 0;
  std::string uuid;
  unsigned long long used = 0, total = 0;
};

std::vector<MigSlice> mig_slices() {
  std::vector<MigSlice> slices;
  for (const std::string& entry : listed("TESSERA_NVML_STAND_IN_MIG_DEVICES")) {
    std::vector<std::string> parts;
    std::stringstream in(entry);
    for (std::string part; std::getline(in, part, ':');) parts.push_back(part);
    if (parts.size() != 7) continue;
    slices.push_back({unsigned(std::stoul(parts[0])), unsigned(std::stoul(parts[1])), unsigned(std::stoul(parts[2])),
                      unsigned(std::stoul(parts[3])), parts[4], std::stoull(parts[5]), std::stoull(parts[6])});
  }
  return slices;
}

// The slice whose handle `device` is; nothing for a GPU's handle.
std::optional<MigSlice> slice_of(void* device) {
  const auto handle = reinterpret_cast<uintptr_t>(device);
  const std::vector<MigSlice> slices = mig_slices();
  if (handle < kMigHandleBase || handle / kMigHandleBase > slices.size()) return std::nullopt;
  return slices[handle / kMigHandleBase - 1];
}

bool in_mig_mode(unsigned index) {
  const std::optional<unsigned long long> mode = reading("MIG_MODE", index);
  return mode && *mode == 1;
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
int nvmlDeviceGetPciInfo_v3(void* device, StandInPciInfo* info) {
  const std::vector<std::string> ids = listed("TESSERA_NVML_STAND_IN_GPUS");
  if (index_of(device) >= ids.size()) return kInvalidArgument;
  *info = StandInPciInfo{};
  std::strncpy(info->bus_id, ids[index_of(device)].c_str(), sizeof info->bus_id - 1);
  return kSuccess;
}
int nvmlDeviceGetUUID(void* device, char* uuid, unsigned length) {
  const std::vector<std::string> uuids = listed("TESSERA_NVML_STAND_IN_UUIDS");
  const std::optional<MigSlice> slice = slice_of(device);
  if (!slice && index_of(device) >= uuids.size()) return kNotSupported;
  const std::string text = slice ? slice->uuid : uuids[index_of(device)];
  if (text.size() + 1 > length) return kInsufficientSize;
  std::memcpy(uuid, text.c_str(), text.size() + 1);
  return kSuccess;
}
int nvmlDeviceGetMigMode(void* device, unsigned* current, unsigned* pending) {
  const std::optional<unsigned long long> mode = reading("MIG_MODE", index_of(device));
  if (!mode) return kNotSupported;
  *current = *pending = unsigned(*mode);
  return kSuccess;
}
int nvmlDeviceGetMaxMigDeviceCount(void* device, unsigned* count) {
  if (!reading("MIG_MODE", index_of(device))) return kNotSupported;
  *count = kMaxMigDevices;
  return kSuccess;
}
int nvmlDeviceGetMigDeviceHandleByIndex(void* device, unsigned index, void** mig_device) {
  if (!in_mig_mode(index_of(device))) return kInvalidArgument;
  const std::vector<MigSlice> slices = mig_slices();
  for (size_t s = 0; s < slices.size(); ++s)
    if (slices[s].parent == index_of(device) && slices[s].index == index) {
      *mig_device = reinterpret_cast<void*>(kMigHandleBase * (s + 1));
      return kSuccess;
    }
  return kNotFound;
}
int nvmlDeviceGetGpuInstanceId(void* device, unsigned* id) {
  const std::optional<MigSlice> slice = slice_of(device);
  if (!slice) return kInvalidArgument;
  *id = slice->gpu_instance;
  return kSuccess;
}
int nvmlDeviceGetComputeInstanceId(void* device, unsigned* id) {
  const std::optional<MigSlice> slice = slice_of(device);
  if (!slice) return kInvalidArgument;
  *id = slice->compute_instance;
  return kSuccess;
}
int nvmlDeviceGetUtilizationRates(void* device, StandInUtilization* utilization) {
  if (in_mig_mode(index_of(device))) return kNotSupported;
  return answer(reading("UTILIZATION", index_of(device)), &utilization->gpu);
}
int nvmlDeviceGetMemoryInfo(void* device, StandInMemory* memory) {
  if (const std::optional<MigSlice> slice = slice_of(device)) {
    *memory = StandInMemory{slice->total, slice->total - slice->used, slice->used};
    return kSuccess;
  }
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
