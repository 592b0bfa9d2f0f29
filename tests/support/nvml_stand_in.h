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

  // Two GPUs whose readings differ, so that a reading of the wrong one shows:
  // NVML's 0 at 3B:00.0, 1 at 86:00.0 (readings in NVML's units).
  NvmlStandIn& two_gpus() {
    return set("GPUS", "00000000:3B:00.0,00000000:86:00.0")
        .set("UTILIZATION", "12,87")
        .set("MEMORY_USED", "1000,81604378624")
        .set("MEMORY_TOTAL", "85899345920,85520809984")
        .set("POWER_MW", "71250,699123")
        .set("TEMPERATURE", "33,71")
        .set("SM_CLOCK_MHZ", "345,1980")
        .set("MEMORY_CLOCK_MHZ", "1593,2619");
  }

 private:
  std::vector<std::string> set_;
};

}  // namespace tessera::testing
