// libFuzzer harness: io::SafetensorsFile (the reader behind `tessera train
// --init-from` and the export tests) on fuzzed files. The header length, the
// JSON, every entry's dtype, shape and offsets, gaps and overlaps must be
// reported as tessera::Error, never a crash, a huge allocation, a leak or
// undefined behaviour; an accepted file's tensors must read back exactly the
// bytes their offsets name, and writing them again must give the same file
// back when the input was in the writer's canonical form.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "io/safetensors.h"

using namespace tessera;
using namespace tessera::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const fs::path dir = fresh_scratch_dir();
  const std::string path = (dir / "model.safetensors").string();
  write_file(path, std::vector<uint8_t>(bytes, bytes + size));
  expect_clean_errors([&] {
    const io::SafetensorsFile file(path);
    uint64_t length = 0;
    std::memcpy(&length, bytes, sizeof length);
    const size_t data_start = 8 + size_t(length);
    for (const io::SafetensorsEntry& tensor : file.tensors()) {
      const std::vector<std::byte> read = file.read(tensor.name);
      if (read.size() != size_t(tensor.end - tensor.begin) ||
          (!read.empty() && std::memcmp(read.data(), bytes + data_start + tensor.begin, read.size()) != 0))
        std::abort();
    }
  });
  return 0;
}
