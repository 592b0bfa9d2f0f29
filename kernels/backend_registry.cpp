// backend_for(): the backend that runs work for a device.
#include "kernels/backend.h"

namespace tessera {

Backend& backend_for(Device device) {
  return device.is_cpu() ? cpu_backend() : cuda_backend();
}

}  // namespace tessera
