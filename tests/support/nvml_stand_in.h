// The tests' side of the NVML stand-in (tests/support/nvml_stand_in.cpp):
// where the library is, and an object that sets its GPUs and readings for
// the life of a test and clears them after. Tests that include this are
// built with TESSERA_NVML_STAND_IN, the library's path (tests/CMakeLists.txt).
#pragma once

#include <cstdlib>
#include <string>
#include <vector>

namespace tessera::testing {

class NvmlStandIn {
 public:
  static std::string library() { return TESSERA_NVML_STAND_IN; }

  NvmlStandIn() = default;
  ~NvmlStandIn() {
    for (const std::string& name : set_) unsetenv(name.c_str());
  }
  NvmlStandIn(const NvmlStandIn&) = delete;
  NvmlStandIn& operator=(const NvmlStandIn&) = delete;

  // TESSERA_NVML_STAND_IN_<key> = value (GPUS, INIT, UTILIZATION, POWER_MW, ...).
  NvmlStandIn& set(const std::string& key, const std::string& value) {
    const std::string name = "TESSERA_NVML_STAND_IN_" + key;
    setenv(name.c_str(), value.c_str(), 1);
    set_.push_back(name);
    return *this;
  }

  static constexpr const char* kGpu0 = "GPU-3b1f2a9e-0c4d-4e8a-9b7c-5d6e7f809a1b";
  static constexpr const char* kGpu1 = "GPU-86a0b1c2-d3e4-4f50-a617-28394a5b6c7d";

  // Two GPUs whose readings differ, so that a reading of the wrong one shows:
  // NVML's 0 at 3B:00.0 (kGpu0), 1 at 86:00.0 (kGpu1), readings in NVML's units.
  NvmlStandIn& two_gpus() {
    return set("GPUS", "00000000:3B:00.0,00000000:86:00.0")
        .set("UUIDS", std::string(kGpu0) + "," + kGpu1)
        .set("UTILIZATION", "12,87")
        .set("MEMORY_USED", "1000,81604378624")
        .set("MEMORY_TOTAL", "85899345920,85520809984")
        .set("POWER_MW", "71250,699123")
        .set("TEMPERATURE", "33,71")
        .set("SM_CLOCK_MHZ", "345,1980")
        .set("MEMORY_CLOCK_MHZ", "1593,2619");
  }

  static constexpr const char* kSlice0 = "MIG-0e8d7c6b-5a49-4382-9170-f1e2d3c4b5a6";
  static constexpr const char* kSlice1 = "MIG-a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d";

  // two_gpus() with GPU 1 in MIG mode, split into two slices whose memory
  // differs from each other's and from the board's: kSlice0 (GPU instance 1,
  // compute instance 0, at MIG index 0) and kSlice1 (GPU instance 2, compute
  // instance 0, at MIG index 3: NVML's MIG indices have gaps).
  NvmlStandIn& two_gpus_one_split() {
    two_gpus();
    return set("MIG_MODE", "0,1")
        .set("MIG_DEVICES", std::string("1:0:1:0:") + kSlice0 + ":3221225472:42949672960,1:3:2:0:" + kSlice1 +
                                ":7516192768:21474836480");
  }

 private:
  std::vector<std::string> set_;
};

}  // namespace tessera::testing
