// The CPU backend object. Stateless: one immutable instance serves every Context.
#include "kernels/cpu/cpu_backend.h"

namespace tessera {

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace tessera
