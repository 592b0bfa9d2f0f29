// CpuLibraries: oneDNN engine and stream.
#include "core/cpu_libraries.h"

namespace tessera {

CpuLibraries::CpuLibraries() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

}  // namespace tessera
