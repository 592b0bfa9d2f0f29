// libFuzzer harness: a Hugging Face model directory (io/safetensors_directory.h:
// model.safetensors, or shards with model.safetensors.index.json) and a
// Llama's config.json (io/hf_llama.h), the outside input of `train
// --init-from DIR`. The index's JSON and weight map, missing or extra
// shards, tensors in two shards or absent from theirs, and every config key
// must end in tessera::Error, never a crash, a hang, a huge allocation or
// undefined behaviour. A directory that opens must read every tensor's
// elements, whole and by any run, as the same bytes; a config that parses
// must be written and parsed back to the same values.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.h"
#include "io/hf_llama.h"
#include "io/safetensors_directory.h"

using namespace tessera;
using namespace tessera::fuzz;

namespace {

// The next part of the input: a 32-bit little-endian length (cut to what is left), then that many bytes.
std::string_view next_part(std::string_view& input) {
  if (input.size() < 4) {
    const std::string_view rest = input;
    input = {};
    return rest;
  }
  uint32_t length = 0;
  std::memcpy(&length, input.data(), 4);
  input.remove_prefix(4);
  const size_t taken = std::min<size_t>(length, input.size());
  const std::string_view part = input.substr(0, taken);
  input.remove_prefix(taken);
  return part;
}

void check_config(std::string_view text) {
  const io::HfLlamaConfig config = io::parse_hf_llama_config(std::string(text), "config.json");
  const io::HfLlamaConfig again = io::parse_hf_llama_config(io::hf_llama_config_json(config), "written");
  if (again.vocab_size != config.vocab_size || again.hidden_size != config.hidden_size ||
      again.num_key_value_heads != config.num_key_value_heads || again.rope_theta != config.rope_theta ||
      again.rms_norm_eps != config.rms_norm_eps || again.tie_word_embeddings != config.tie_word_embeddings ||
      again.bos_token_id != config.bos_token_id)
    std::abort();
}

// Every tensor read whole and in two runs: the same bytes.
void check_directory(const fs::path& dir) {
  const io::SafetensorsDirectory weights(dir.string());
  for (const std::string& name : weights.names()) {
    const io::SafetensorsDirectory::Located found = weights.find(name);
    if (found.entry == nullptr) std::abort();
    const std::vector<std::byte> whole = found.file->read(name);
    const int64_t size = found.entry->float64 ? 8 : int64_t(dtype_size(found.entry->dtype));
    const int64_t count = int64_t(whole.size()) / size, split = count / 3;
    std::vector<std::byte> runs(whole.size());
    found.file->read_elements(*found.entry, 0, split, runs.data());
    found.file->read_elements(*found.entry, split, count - split, runs.data() + split * size);
    if (runs != whole) std::abort();
    if (found.entry->float64 || is_floating(found.entry->dtype)) {
      std::vector<float> floats(static_cast<size_t>(count));
      found.file->read_floats(*found.entry, 0, count, floats.data());
    }
  }
}

}  // namespace

// The input: a flags byte (bit 0: one model.safetensors rather than two
// shards), then length-prefixed parts: config.json, the index, the first
// file, the second shard.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = bytes[0];
  std::string_view input(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  const std::string_view config = next_part(input), index = next_part(input), first = next_part(input),
                         second = next_part(input);
  expect_clean_errors([&] { check_config(config); });

  const fs::path dir = fresh_scratch_dir();
  if (flags & 1) {
    write_file(dir / "model.safetensors", first);
  } else {
    write_file(dir / "model.safetensors.index.json", index);
    write_file(dir / "model-00001-of-00002.safetensors", first);
    write_file(dir / "model-00002-of-00002.safetensors", second);
  }
  expect_clean_errors([&] { check_directory(dir); });
  return 0;
}
