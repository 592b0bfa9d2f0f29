// libFuzzer harness: `tessera prepare megatron|llmc` (io/token_files.h and
// io::prepare_token_files) on fuzzed token files. Headers, counts, pointers,
// document indices, dtypes and token ids must be reported as tessera::Error,
// never a crash, a huge allocation, a leak or undefined behaviour; a
// successful preparation must hold the source's tokens in order.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "io/dataset.h"
#include "io/prepare.h"
#include "io/token_files.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

// The whole stream of `path` as its own reader sees it.
std::vector<int64_t> tokens_of(const std::string& path) {
  io::TokenData data(path);
  std::vector<int32_t> ids(size_t(data.size()));
  data.read(0, data.size(), ids.data());
  return std::vector<int64_t>(ids.begin(), ids.end());
}

}  // namespace

// The input: a flags byte (1: a Megatron dataset, else an llm.c shard; 2:
// pass --vocab-size, its value the next 2 bytes little-endian), for Megatron
// the .idx file's length (16-bit little-endian), then the file(s).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 3) return 0;
  const uint8_t flags = bytes[0];
  const int64_t vocab = flags & 2 ? int64_t(bytes[1]) | int64_t(bytes[2]) << 8 : 0;
  size_t at = 3;
  const fs::path dir = fresh_scratch_dir();
  std::string input;
  if (flags & 1) {
    if (size < at + 2) return 0;
    const size_t idx_length = std::min(size - at - 2, size_t(bytes[at]) | size_t(bytes[at + 1]) << 8);
    at += 2;
    write_file(dir / "data.idx", std::vector<uint8_t>(bytes + at, bytes + at + idx_length));
    write_file(dir / "data.bin", std::vector<uint8_t>(bytes + at + idx_length, bytes + size));
    input = (dir / "data").string();
  } else {
    write_file(dir / "shard.bin", std::vector<uint8_t>(bytes + at, bytes + size));
    input = (dir / "shard.bin").string();
  }
  const std::string out = (dir / "tokens.h5").string();
  expect_clean_errors([&] {
    const io::TokenSource source = flags & 1 ? io::open_megatron_dataset(input) : io::open_llmc_shard(input);
    const io::TextPrepareResult result = io::prepare_token_files({source}, out, "", 0.0, vocab);
    std::vector<int64_t> expected(size_t(source.tokens));
    io::read_source_tokens(source, 0, source.tokens, expected.data());
    if (tokens_of(out) != expected || (vocab > 0 && result.train.vocab_size != vocab)) std::abort();
  });
  check_hdf5_ids_closed();
  return 0;
}
