// CpuLibraries: oneDNN engine and stream.
#include "core/cpu_libraries.h"

#include <cblas.h>

#include <sstream>

namespace tessera {

CpuLibraries::CpuLibraries() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

namespace {

const char* describe_isa(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2: return "avx2";
    default: return "other";
  }
}

}  // namespace

std::string describe_cpu_libraries() {
  std::ostringstream out;
  const dnnl_version_t* dnnl = dnnl_version();
  out << openblas_get_config() << " (kernel " << openblas_get_corename() << ", "
      << openblas_get_num_threads() << " threads), oneDNN " << dnnl->major << "." << dnnl->minor << "." << dnnl->patch
      << " (CPU ISA " << describe_isa(dnnl_get_effective_cpu_isa()) << ")"
     ;
  return out.str();
}

}  // namespace tessera
