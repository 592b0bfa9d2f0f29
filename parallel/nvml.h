// Nvml: the NVIDIA driver's management library (NVML), opened with dlopen so
// that nothing links against it and a build needs no GPU driver. One RAII
// object owns the library handle and the nvmlInit/nvmlShutdown pair; every
// user goes through it: topology discovery (the GPUs' PCI addresses, for
// `tessera topo` and the per-rank decisions) and the training monitor (the
// readings of the GPU or MIG slice a rank trains on, found by CUDA's UUID,
// DCGM-style, for the tessera_gpu_* Prometheus series). Without the library,
// or when it fails to start, available() is false and every query answers
// nothing; no call throws.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace tessera::parallel {

// One reading of a GPU in base units (DCGM exporter's quantities). A field
// whose NVML call failed (not supported by the device, no permission) is
// empty, never 0.
struct GpuSample {
  std::optional<double> utilization_ratio;    // share of the last sample period a kernel ran, 0..1 (NVML: percent)
  std::optional<double> memory_used_bytes;    // device memory in use, by any process (of a MIG slice: the slice's)
  std::optional<double> memory_total_bytes;   // device memory installed (of a MIG slice: the slice's share)
  std::optional<double> power_watts;          // board power draw (NVML: milliwatts)
  std::optional<double> temperature_celsius;  // the GPU die's sensor
  std::optional<double> sm_clock_hertz;       // streaming multiprocessor clock now (NVML: MHz)
  std::optional<double> memory_clock_hertz;   // memory clock now (NVML: MHz)
};

// Where a CUDA device is in NVML: a whole GPU, or one MIG slice of a GPU (a
// compute instance inside a GPU instance; CUDA sees each as a device of its
// own, with a UUID of its own, but a slice shares its parent's PCI bus id).
struct GpuLocation {
  struct MigSlice {
    unsigned device_index = 0;      // among the parent's MIG devices (nvmlDeviceGetMigDeviceHandleByIndex)
    unsigned gpu_instance = 0;      // nvmlDeviceGetGpuInstanceId
    unsigned compute_instance = 0;  // nvmlDeviceGetComputeInstanceId, unique within its GPU instance
  };
  unsigned index = 0;             // NVML's index of the GPU (a slice's parent); ignores CUDA_VISIBLE_DEVICES
  bool mig_mode = false;          // the GPU is in MIG mode
  std::optional<MigSlice> slice;  // the slice; empty: the whole GPU (under MIG mode, CUDA named the board)
};

// Which of GpuSample's fields a location has readings of its own for. Under
// MIG, NVML measures no utilisation (of a slice or of the board), a slice's
// memory is its own (its MIG handle), and power is the board's only (every
// slice's draw together): a slice reports memory, temperature and clocks (the
// latter two the board's, which the slice shares), never utilisation or power.
struct GpuFields {
  bool utilization = true, memory = true, power = true, temperature = true, clocks = true;
};
GpuFields fields_of(const GpuLocation& location);
// The fields `fields` leaves out, by name ("utilization, power"); "" when none.
std::string unreported_fields(const GpuFields& fields);

// CUDA's 16-byte device UUID (cudaDeviceProp::uuid: a whole GPU's, or under
// MIG the slice's) as text without NVML's prefix: "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
std::string uuid_text(const std::array<unsigned char, 16>& bytes);

class Nvml {
 public:
  static constexpr const char* kLibrary = "libnvidia-ml.so.1";

  // Opens and starts `library`: NVML's (the default), or a stand-in in tests.
  explicit Nvml(const std::string& library = kLibrary);
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  bool available() const { return started_; }

  // The PCI bus ids of the GPUs NVML lists, in its index order, as NVML
  // writes them ("00000000:3B:00.0"); nothing when unavailable.
  std::optional<std::vector<std::string>> gpu_bus_ids() const;

  // The GPU or MIG slice whose UUID is `uuid`: CUDA's (uuid_text), or NVML's
  // own form ("GPU-..." for a whole GPU, "MIG-..." for a slice), letter case
  // ignored; nothing when NVML lists no such device.
  std::optional<GpuLocation> find_gpu(const std::string& uuid) const;

  // A reading of `location`: of the fields fields_of(location) names, those
  // the device answers; all empty when unavailable.
  GpuSample sample(const GpuLocation& location) const;

 private:
  using Status = int;    // nvmlReturn_t; 0 is NVML_SUCCESS
  using Device = void*;  // nvmlDevice_t
  struct PciInfo {       // nvmlPciInfo_t as nvmlDeviceGetPciInfo_v3 fills it
    char bus_id_legacy[16];
    unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
    char bus_id[32];
  };
  struct Utilization {  // nvmlUtilization_t
    unsigned gpu, memory;
  };
  struct Memory {  // nvmlMemory_t
    unsigned long long total, free, used;
  };

  template <typename Function>
  void bind(Function& function, const char* symbol);
  std::optional<Device> device(unsigned index) const;
  std::optional<Device> mig_device(Device gpu, unsigned mig_index) const;
  std::string uuid_of(Device device) const;
  bool in_mig_mode(Device gpu) const;
  std::optional<GpuLocation> find_slice(Device gpu, unsigned index, const std::string& key) const;

  void* handle_ = nullptr;
  bool started_ = false;
  Status (*init_)() = nullptr;
  Status (*shutdown_)() = nullptr;
  Status (*count_)(unsigned*) = nullptr;
  Status (*handle_by_index_)(unsigned, Device*) = nullptr;
  Status (*pci_info_)(Device, PciInfo*) = nullptr;
  Status (*uuid_)(Device, char*, unsigned) = nullptr;
  Status (*mig_mode_)(Device, unsigned*, unsigned*) = nullptr;
  Status (*max_mig_devices_)(Device, unsigned*) = nullptr;
  Status (*mig_handle_by_index_)(Device, unsigned, Device*) = nullptr;
  Status (*gpu_instance_id_)(Device, unsigned*) = nullptr;
  Status (*compute_instance_id_)(Device, unsigned*) = nullptr;
  Status (*utilization_)(Device, Utilization*) = nullptr;
  Status (*memory_)(Device, Memory*) = nullptr;
  Status (*power_)(Device, unsigned*) = nullptr;
  Status (*temperature_)(Device, int, unsigned*) = nullptr;
  Status (*clock_)(Device, int, unsigned*) = nullptr;
};

}  // namespace tessera::parallel
