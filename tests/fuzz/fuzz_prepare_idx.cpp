// libFuzzer harness: `tessera prepare idx` (io::prepare_idx) on fuzzed IDX
// files. The input is split into an image file and a label file, each
// written as given or gzip-compressed (the reader tells them apart by the
// gzip magic, so fuzzed gzip streams reach zlib too), with a fuzzed
// --num-classes. Headers, sizes, truncation, trailing bytes and labels must
// be reported as tessera::Error, never a crash, a huge allocation, a leak or
// undefined behaviour; a successful preparation must produce a dataset its
// own reader accepts, of one channel and the --num-classes given.
//
// Built a second time as fuzz_canary (TESSERA_FUZZ_CANARY): then a prepared
// dataset of more than 2 classes sets off a deliberate bug, the kind
// TESSERA_FUZZ_CANARY_KIND names (asan: a heap read past the end; ubsan: a
// signed overflow; leak: memory never freed). The seed's labels are 0 and 1,
// so it takes a mutation that keeps both IDX files valid and raises a label.
#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "io/dataset.h"
#include "io/prepare.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

std::vector<uint8_t> gzip(const std::vector<uint8_t>& plain) {
  z_stream stream{};
  deflateInit2(&stream, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // +16: a gzip wrapper
  std::vector<uint8_t> out(deflateBound(&stream, uLong(plain.size())) + 32);
  stream.next_in = const_cast<Bytef*>(plain.data());
  stream.avail_in = uInt(plain.size());
  stream.next_out = out.data();
  stream.avail_out = uInt(out.size());
  deflate(&stream, Z_FINISH);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

void write_idx(const fs::path& path, const std::vector<uint8_t>& bytes, bool compress) {
  write_file(path, compress ? gzip(bytes) : bytes);
}

#ifdef TESSERA_FUZZ_CANARY
// The deliberate bugs of fuzz_canary.
void canary(const io::DatasetInfo& info) {
  if (info.num_classes <= 2) return;
  static const char* kind = std::getenv("TESSERA_FUZZ_CANARY_KIND");
  const std::string which = kind ? kind : "asan";
  if (which == "asan") {
    std::vector<uint8_t> labels(size_t(info.num_samples));
    volatile uint8_t past_end = labels.data()[labels.size()];  // one byte past the end of the heap block
    (void)past_end;
  } else if (which == "ubsan") {
    volatile int64_t big = std::numeric_limits<int64_t>::max() - info.num_samples + 1;
    volatile int64_t overflow = big + info.height;  // signed overflow
    (void)overflow;
  } else {
    char* volatile leaked = static_cast<char*>(std::malloc(size_t(info.width) * 16));
    leaked[0] = 1;
    leaked = nullptr;  // the only pointer to the block: it is never freed
  }
}
#endif

}  // namespace

// The input: a flags byte (1: gzip the images, 2: gzip the labels, 4: pass
// --num-classes, 8: pass --num-classes -1), the --num-classes byte, the label
// file's length (16-bit little-endian), the label file, then the image file.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 4) return 0;
  const uint8_t flags = bytes[0];
  const int64_t num_classes = flags & 8 ? -1 : flags & 4 ? int64_t(bytes[1]) : 0;
  const size_t label_bytes = std::min<size_t>(size_t(bytes[2]) | size_t(bytes[3]) << 8, size - 4);
  const std::vector<uint8_t> labels(bytes + 4, bytes + 4 + label_bytes);
  const std::vector<uint8_t> images(bytes + 4 + label_bytes, bytes + size);

  const fs::path dir = fresh_scratch_dir();
  write_idx(dir / "images-idx3-ubyte", images, flags & 1);
  write_idx(dir / "labels-idx1-ubyte", labels, flags & 2);
  expect_clean_errors([&] {
    const io::DatasetInfo info =
        io::prepare_idx((dir / "images-idx3-ubyte").string(), (dir / "labels-idx1-ubyte").string(),
                        (dir / "out.h5").string(), {}, num_classes);
    // A prepared file holds what the headers said: N samples of 1 x H x W.
    const bool sane = info.kind == io::DatasetKind::classification && info.channels == 1 && info.num_samples >= 1 &&
                      (num_classes <= 0 || info.num_classes == num_classes);
    if (!sane) std::abort();
#ifdef TESSERA_FUZZ_CANARY
    canary(info);
#endif
  });
  check_hdf5_ids_closed();
  return 0;
}
