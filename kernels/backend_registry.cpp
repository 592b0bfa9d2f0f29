// backend_for(): the backend that runs work for a device, and the note of the
// last operation dispatched to an accelerator.
#include "core/context.h"
#include "kernels/backend.h"

namespace tessera {

Backend& backend_for(Device device) {
  return device.is_cuda() ? cuda_backend() : cpu_backend();
}

Backend& backend_for(const Tensor& on, const char* op) {
  const Device device = on.device();
  if (device.is_accelerator()) on.context().note_operation(device, op);
  return backend_for(device);
}

}  // namespace tessera
