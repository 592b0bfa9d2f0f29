// Megatron indexed datasets and llm.c token shards (io/token_files.h): their
// headers parsed and checked against the files, and their tokens read as one
// stream of ids.
#include "io/token_files.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;

constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

int64_t size_of(const std::string& path, const std::string& what) {
  std::error_code error;
  TESSERA_CHECK(fs::exists(path, error), what, " ", path, " does not exist; check the path");
  TESSERA_CHECK(fs::is_regular_file(path, error), what, " ", path, " is not a regular file");
  const auto size = fs::file_size(path, error);
  TESSERA_CHECK(!error, "cannot read the size of ", path, ": ", error.message());
  return int64_t(size);
}

// Little-endian fields read one after another from a byte buffer.
class FieldReader {
 public:
  FieldReader(const std::vector<char>& bytes, std::string path) : bytes_(bytes), path_(std::move(path)) {}
  template <typename T>
  T next(const char* field) {
    T value;
    TESSERA_CHECK(at_ + sizeof value <= bytes_.size(), path_, ": the file ends inside field '", field, "'");
    std::memcpy(&value, bytes_.data() + at_, sizeof value);
    at_ += sizeof value;
    return value;
  }
  size_t at() const { return at_; }
  void skip(size_t bytes) { at_ += bytes; }

 private:
  const std::vector<char>& bytes_;
  std::string path_;
  size_t at_ = 0;
};

std::vector<char> read_whole(const std::string& path, int64_t size) {
  std::vector<char> bytes(static_cast<size_t>(size));
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", path, ": ", std::strerror(errno));
  in.read(bytes.data(), size);
  TESSERA_CHECK(in.gcount() == size, path, " ended after ", in.gcount(), " of its ", size,
                " bytes; did it change while being read?");
  return bytes;
}

// Megatron's DType codes: (bytes, signed), or 0 bytes for a code that holds no token ids.
struct MegatronDtype {
  int bytes;
  bool is_signed;
  const char* name;
};
MegatronDtype megatron_dtype(const std::string& path, uint8_t code) {
  switch (code) {
    case 1:
      return {1, false, "uint8"};
    case 2:
      return {1, true, "int8"};
    case 3:
      return {2, true, "int16"};
    case 4:
      return {4, true, "int32"};
    case 5:
      return {8, true, "int64"};
    case 8:
      return {2, false, "uint16"};
    case 6:
    case 7:
      TESSERA_THROW(path, ": field 'dtype' is ", int(code), " (", code == 6 ? "float64" : "float32",
                    "): the dataset holds floating-point values, not token ids");
    default:
      TESSERA_THROW(path, ": field 'dtype' is ", int(code),
                    ", not one of Megatron's codes (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)");
  }
}

// The sequences as byte ranges, consecutive ones merged.
void add_range(TokenSource& source, int64_t offset, int64_t tokens) {
  if (tokens == 0) return;
  if (!source.ranges.empty()) {
    TokenSource::Range& last = source.ranges.back();
    if (last.offset + last.tokens * source.element_size == offset) {
      last.tokens += tokens;
      return;
    }
  }
  source.ranges.push_back({offset, tokens});
}

}  // namespace

TokenSource open_megatron_dataset(const std::string& given) {
  std::string prefix = given;
  for (const char* suffix : {".idx", ".bin"})
    if (prefix.size() > 4 && prefix.compare(prefix.size() - 4, 4, suffix) == 0) prefix.resize(prefix.size() - 4);
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  const int64_t idx_size = size_of(idx, "Megatron index");
  const int64_t bin_size = size_of(bin, "Megatron data file");
  TESSERA_CHECK(idx_size >= kMegatronHeaderBytes, idx, " holds ", idx_size, " bytes, fewer than the ",
                kMegatronHeaderBytes, " of the MMIDIDX header: not a Megatron indexed dataset (or truncated)");
  const std::vector<char> bytes = read_whole(idx, idx_size);
  TESSERA_CHECK(std::memcmp(bytes.data(), kMegatronMagic, sizeof kMegatronMagic) == 0, idx,
                ": field 'magic' is not \"MMIDIDX\\0\\0\": not a Megatron indexed dataset of the mmap format "
                "(convert older formats with Megatron's tools)");
  FieldReader in(bytes, idx);
  in.skip(sizeof kMegatronMagic);
  const uint64_t version = in.next<uint64_t>("version");
  TESSERA_CHECK(version == 1, idx, ": field 'version' is ", version, "; this reader knows version 1");
  const MegatronDtype dtype = megatron_dtype(idx, in.next<uint8_t>("dtype"));
  const uint64_t sequences = in.next<uint64_t>("sequence count");
  const uint64_t documents = in.next<uint64_t>("document count");
  const uint64_t limit = uint64_t(idx_size);
  TESSERA_CHECK(sequences <= limit / 12 && documents <= limit / 8, idx, ": fields 'sequence count' (", sequences,
                ") and 'document count' (", documents, ") claim more entries than the file's ", idx_size,
                " bytes hold");
  const int64_t n = int64_t(sequences), d = int64_t(documents);
  const int64_t body = kMegatronHeaderBytes + 12 * n + 8 * d;
  TESSERA_CHECK(idx_size == body || idx_size == body + n, idx, ": fields 'sequence count' ", n,
                " and 'document count' ", d, " need ", body, " bytes (", body + n,
                " with multimodal modes), but the file has ", idx_size, "; it is truncated or not this format");

  TokenSource source;
  source.path = bin;
  source.format = "Megatron indexed dataset " + prefix;
  source.element_size = dtype.bytes;
  source.is_signed = dtype.is_signed;
  source.documents = std::max<int64_t>(d - 1, 0);
  std::vector<int32_t> sizes(static_cast<size_t>(n));
  for (int32_t& size : sizes) size = in.next<int32_t>("sizes");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pointer = in.next<int64_t>("pointers");
    const int64_t size = sizes[size_t(i)];
    TESSERA_CHECK(size >= 0, idx, ": field 'sizes' of sequence ", i, " is ", size, "; sizes are token counts");
    TESSERA_CHECK(pointer >= 0 && pointer <= bin_size && size <= (bin_size - pointer) / dtype.bytes, idx,
                  ": field 'pointers' puts sequence ", i, " (", size, " ", dtype.name, " tokens) at byte ", pointer,
                  ", outside ", bin, " (", bin_size, " bytes)");
    add_range(source, pointer, size);
    source.tokens += size;
  }
  int64_t previous = 0;
  for (int64_t i = 0; i < d; ++i) {
    const int64_t index = in.next<int64_t>("document indices");
    TESSERA_CHECK(index >= previous && index <= n, idx, ": field 'document indices' entry ", i, " is ", index,
                  "; they must rise from 0 to the sequence count ", n);
    previous = index;
  }
  return source;
}

TokenSource open_llmc_shard(const std::string& path) {
  const int64_t size = size_of(path, "llm.c token shard");
  TESSERA_CHECK(size >= kLlmcHeaderBytes, path, " holds ", size, " bytes, fewer than the ", kLlmcHeaderBytes,
                " of an llm.c shard's header (256 int32): not an llm.c token shard (or truncated)");
  std::vector<char> header_bytes(static_cast<size_t>(kLlmcHeaderBytes));
  {
    std::ifstream in(path, std::ios::binary);
    TESSERA_CHECK(in, "cannot open ", path, ": ", std::strerror(errno));
    in.read(header_bytes.data(), kLlmcHeaderBytes);
    TESSERA_CHECK(in.gcount() == kLlmcHeaderBytes, path, ": cannot read the 1024-byte header");
  }
  int32_t header[3];
  std::memcpy(header, header_bytes.data(), sizeof header);
  TESSERA_CHECK(header[0] == kLlmcMagic, path, ": header[0] (magic) is ", header[0], ", not ", kLlmcMagic,
                ": not an llm.c token shard");
  TESSERA_CHECK(header[1] == 1 || header[1] == 2, path, ": header[1] (version) is ", header[1],
                "; known: 1 (uint16 tokens, GPT-2) and 2 (uint32 tokens)");
  TokenSource source;
  source.path = path;
  source.format = "llm.c token shard";
  source.element_size = header[1] == 1 ? 2 : 4;
  source.is_signed = false;
  const int64_t tokens = header[2];
  TESSERA_CHECK(tokens >= 0 && tokens * source.element_size == size - kLlmcHeaderBytes, path,
                ": header[2] (token count) is ", tokens, " (", int64_t(tokens) * source.element_size,
                " bytes of tokens) but the file holds ", size - kLlmcHeaderBytes, " bytes after the header");
  add_range(source, kLlmcHeaderBytes, tokens);
  source.tokens = tokens;
  return source;
}

void read_source_tokens(const TokenSource& source, int64_t first, int64_t count, int64_t* out, int64_t vocab_size) {
  TESSERA_CHECK(first >= 0 && count >= 0 && first + count <= source.tokens, source.path, ": tokens [", first, ", ",
                first + count, ") lie outside its ", source.tokens);
  std::ifstream in(source.path, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", source.path, ": ", std::strerror(errno));
  std::vector<char> buffer;
  int64_t range_start = 0;  // stream position of the current range's first token
  int64_t done = 0;
  for (const TokenSource::Range& range : source.ranges) {
    if (done == count) break;
    const int64_t range_end = range_start + range.tokens;
    if (range_end > first + done) {
      const int64_t from = first + done - range_start;
      const int64_t take = std::min(range.tokens - from, count - done);
      buffer.resize(size_t(take * source.element_size));
      in.seekg(range.offset + from * source.element_size);
      in.read(buffer.data(), std::streamsize(buffer.size()));
      TESSERA_CHECK(in.gcount() == std::streamsize(buffer.size()), source.path, " ended inside its tokens (at byte ",
                    range.offset + from * source.element_size, "); did it change while being read?");
      for (int64_t i = 0; i < take; ++i) {
        const char* at = buffer.data() + i * source.element_size;
        int64_t value = 0;
        switch (source.element_size) {
          case 1:
            value = source.is_signed ? int64_t(int8_t(at[0])) : int64_t(uint8_t(at[0]));
            break;
          case 2: {
            uint16_t bits;
            std::memcpy(&bits, at, 2);
            value = source.is_signed ? int64_t(int16_t(bits)) : int64_t(bits);
            break;
          }
          case 4: {
            uint32_t bits;
            std::memcpy(&bits, at, 4);
            value = source.is_signed ? int64_t(int32_t(bits)) : int64_t(bits);
            break;
          }
          default:
            std::memcpy(&value, at, 8);
        }
        const int64_t position = first + done + i;
        TESSERA_CHECK(value >= 0, source.format, ": token ", position, " of ", source.path, " is ", value,
                      "; token ids are not negative");
        TESSERA_CHECK(vocab_size <= 0 || value < vocab_size, source.format, ": token ", position, " of ", source.path,
                      " is ", value, ", not below the vocabulary size ", vocab_size, " (--vocab-size)");
        out[done + i] = value;
      }
      done += take;
    }
    range_start = range_end;
  }
}

}  // namespace tessera::io
