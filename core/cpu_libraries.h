// CPU library handles owned by the Context: the oneDNN engine and stream used
// by the bf16 matrix multiply (AMX / AVX512_BF16 kernels).
#pragma once

#include <dnnl.hpp>
#include <string>

namespace tessera {

class CpuLibraries {
 public:
  CpuLibraries();
  dnnl::engine& engine() { return engine_; }
  dnnl::stream& stream() { return stream_; }

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
};

// The CPU math libraries in use, for logs and `tessera --version`: OpenBLAS's
// version, kernel (core) and threads, and oneDNN's version and instruction set.
std::string describe_cpu_libraries();

}  // namespace tessera
