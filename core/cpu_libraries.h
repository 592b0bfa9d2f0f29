// CPU library handles owned by the Context: the oneDNN engine and stream used
// by the bf16 matrix multiply (AMX / AVX512_BF16 kernels).
#pragma once

#include <dnnl.hpp>

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

}  // namespace tessera
