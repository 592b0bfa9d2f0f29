// Nvml: the NVIDIA driver's management library (NVML), opened with dlopen so
// that nothing links against it and a build needs no GPU driver. One RAII
// object owns the library handle and the nvmlInit/nvmlShutdown pair; every
// user goes through it: topology discovery (the GPUs' PCI addresses, for
// `tessera topo` and the per-rank decisions) and the training monitor (one
// GPU's utilisation, memory, power, temperature and clocks, DCGM-style, for
// the tessera_gpu_* Prometheus series). Without the library, or when it
// fails to start, available() is false and every query answers nothing; no
// call throws.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace tessera::parallel {

// One reading of a GPU in base units (DCGM exporter's quantities). A field
// whose NVML call failed (not supported by the device, no permission) is
// empty, never 0.
struct GpuSample {
  std::optional<double> utilization_ratio;    // share of the last sample period a kernel ran, 0..1 (NVML: percent)
  std::optional<double> memory_used_bytes;    // device memory in use, by any process
  std::optional<double> memory_total_bytes;   // device memory installed
  std::optional<double> power_watts;          // board power draw (NVML: milliwatts)
  std::optional<double> temperature_celsius;  // the GPU die's sensor
  std::optional<double> sm_clock_hertz;       // streaming multiprocessor clock now (NVML: MHz)
  std::optional<double> memory_clock_hertz;   // memory clock now (NVML: MHz)
};

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

  // NVML's index of the GPU at `pci_bus_id` (as CUDA's cudaDeviceGetPCIBusId
  // writes it; NVML's indices ignore CUDA_VISIBLE_DEVICES, CUDA's do not),
  // or, when `pci_bus_id` is empty, `index` itself if NVML has such a GPU;
  // nothing when NVML does not know it.
  std::optional<unsigned> find_gpu(const std::string& pci_bus_id, unsigned index) const;

  // A reading of GPU `index` (NVML's index); all empty when unavailable.
  GpuSample sample(unsigned index) const;

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

  void* handle_ = nullptr;
  bool started_ = false;
  Status (*init_)() = nullptr;
  Status (*shutdown_)() = nullptr;
  Status (*count_)(unsigned*) = nullptr;
  Status (*handle_by_index_)(unsigned, Device*) = nullptr;
  Status (*handle_by_pci_bus_id_)(const char*, Device*) = nullptr;
  Status (*index_)(Device, unsigned*) = nullptr;
  Status (*pci_info_)(Device, PciInfo*) = nullptr;
  Status (*utilization_)(Device, Utilization*) = nullptr;
  Status (*memory_)(Device, Memory*) = nullptr;
  Status (*power_)(Device, unsigned*) = nullptr;
  Status (*temperature_)(Device, int, unsigned*) = nullptr;
  Status (*clock_)(Device, int, unsigned*) = nullptr;
};

}  // namespace tessera::parallel
