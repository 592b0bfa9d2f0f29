// TESSERA_FAULT=device_fault on CUDA (core/fault.h): one thread writes to an
// address no allocation holds, so the device faults for real
// (cudaErrorIllegalAddress, sticky) and the fault reports can be checked on a
// GPU the way the emulated device checks them on the CPU.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "core/cuda_runtime.h"
#include "core/fault.h"

namespace tessera::detail {
namespace {

__global__ void write_to_invalid_address(uintptr_t address) {
  *reinterpret_cast<volatile int*>(address) = 1;
}

}  // namespace

void cuda_provoke_illegal_address(int device) {
  cuda_runtime::set_device(device);
  write_to_invalid_address<<<1, 1>>>(uintptr_t(0x10));
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::detail
