// Opening and validating Tessera's HDF5 datasets, and reading ranges of
// images, labels and tokens from them; every read is checked against the
// file as it was opened (a file truncated or rewritten under a running job
// ends it).
#include "io/dataset.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "io/hdf5_file.h"
#include "io/tokenizer.h"

namespace tessera::io {

// What a data file was when it was opened: the file (device, inode) the
// path named, its size and modification time. A read is trusted only when
// the file is still that, unchanged, after the read: HDF5 returns zeros for
// bytes past the end of a truncated file, and the bytes of a file rewritten in
// place, without an error.
struct FileIdentity {
  dev_t device = 0;
  ino_t inode = 0;
  off_t size = 0;
  timespec modified{};
};

struct Hdf5Objects {
  Hdf5Handle file;
  Hdf5Handle data;  // /images or /tokens
  int fd = -1;      // the open file's descriptor (HDF5's, through its sec2 driver), or -1
  FileIdentity identity;
};

namespace {

constexpr int64_t kValidationChunk = int64_t(1) << 20;  // elements read at a time when checking labels and tokens

const char* prepare_hint(DatasetKind kind) {
  return kind == DatasetKind::classification
             ? "prepare it with `tessera prepare idx --images IMAGES --labels LABELS -o FILE`"
             : "prepare it with `tessera prepare text -o FILE TEXT_FILES...`";
}

std::string type_name(hid_t type) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  const H5T_class_t type_class = H5Tget_class(type);
  const size_t bits = H5Tget_size(type) * 8;
  switch (type_class) {
    case H5T_INTEGER:
      return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(bits);
    case H5T_FLOAT:
      return "float" + std::to_string(bits);
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    default:
      return "HDF5 type class " + std::to_string(int(type_class));
  }
}

bool is_integer(hid_t type, size_t bytes, bool is_signed) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  return H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == bytes &&
         (H5Tget_sign(type) == H5T_SGN_2) == is_signed;
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

Hdf5Handle open_dataset(const std::string& path, hid_t file, const char* name, DatasetKind kind) {
  TESSERA_CHECK(has_dataset(file, name), path, ": dataset '/", name, "' is missing (a ", dataset_kind_name(kind),
                " file needs it); ", prepare_hint(kind));
  return dataset_handle(TESSERA_HDF5_CHECK_AT(path, H5Dopen2(file, name, H5P_DEFAULT)));
}

// Every element stored (see all_elements_stored): else the file is incomplete.
void check_written(const std::string& path, hid_t dataset, const char* name, DatasetKind kind) {
  TESSERA_CHECK(all_elements_stored(path, dataset), path, ": dataset '/", name,
                "' has no data stored for some or all of its elements (created but not completely written: an ",
                "interrupted writer?); ", prepare_hint(kind));
}

// The root attributes every kind shares.
void read_header(const std::string& path, hid_t file, DatasetInfo& info) {
  TESSERA_CHECK(has_attribute(file, "tessera_schema"), path,
                ": root attribute 'tessera_schema' is missing, so this is not a Tessera dataset (or comes from an "
                "older tool); prepare it with `tessera prepare idx` or `tessera prepare text`");
  info.schema_version = read_int64_attribute(path, file, "tessera_schema");
  TESSERA_CHECK(info.schema_version == kSchemaVersion, path, ": schema version ", info.schema_version,
                " (root attribute 'tessera_schema') is not the version this build reads (", kSchemaVersion,
                "); prepare the data again with this build's `tessera prepare`");
  TESSERA_CHECK(has_attribute(file, "kind"), path,
                ": root attribute 'kind' is missing; it must be \"classification\" or \"tokens\" (prepare the file "
                "with `tessera prepare idx` or `tessera prepare text`)");
  const std::string kind = read_string_attribute(path, file, "kind");
  if (kind == "classification")
    info.kind = DatasetKind::classification;
  else if (kind == "tokens")
    info.kind = DatasetKind::tokens;
  else
    TESSERA_THROW(path, ": root attribute 'kind' is \"", kind,
                  "\"; this build reads \"classification\" and \"tokens\" files");
}

void validate_classification(const std::string& path, Hdf5Objects& objects, DatasetInfo& info,
                             std::vector<int64_t>& labels) {
  const hid_t file = objects.file.get();
  const DatasetKind kind = DatasetKind::classification;
  Hdf5Handle images = open_dataset(path, file, "images", kind);
  {
    Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_type(images.get())));
    TESSERA_CHECK(is_integer(type.get(), 1, false), path, ": dataset '/images' holds ", type_name(type.get()),
                  "; it must be uint8 [N, C, H, W]; ", prepare_hint(kind));
  }
  const std::vector<int64_t> image_dims = dataset_dims(path, images.get());
  TESSERA_CHECK(image_dims.size() == 4, path, ": dataset '/images' has shape ", shape_text(image_dims),
                "; it must be 4-D [N, C, H, W]; ", prepare_hint(kind));
  TESSERA_CHECK(image_dims[0] > 0 && image_dims[1] > 0 && image_dims[2] > 0 && image_dims[3] > 0, path,
                ": dataset '/images' has shape ", shape_text(image_dims), "; every dimension must be at least 1");
  TESSERA_CHECK(element_count(image_dims).has_value(), path, ": dataset '/images' has shape ", shape_text(image_dims),
                ", more elements than a file can hold; the file is corrupt, ", prepare_hint(kind));
  check_written(path, images.get(), "images", kind);
  info.num_samples = image_dims[0];
  info.channels = image_dims[1];
  info.height = image_dims[2];
  info.width = image_dims[3];

  Hdf5Handle label_set = open_dataset(path, file, "labels", kind);
  {
    Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_type(label_set.get())));
    TESSERA_CHECK(is_integer(type.get(), 8, true), path, ": dataset '/labels' holds ", type_name(type.get()),
                  "; it must be int64 [N]; ", prepare_hint(kind));
  }
  const std::vector<int64_t> label_dims = dataset_dims(path, label_set.get());
  TESSERA_CHECK(label_dims.size() == 1, path, ": dataset '/labels' has shape ", shape_text(label_dims),
                "; it must be 1-D [N]");
  TESSERA_CHECK(label_dims[0] == info.num_samples, path, ": dataset '/labels' has ", label_dims[0],
                " entries but '/images' has ", info.num_samples, " samples; they must match (", prepare_hint(kind),
                ")");
  check_written(path, label_set.get(), "labels", kind);

  info.num_classes = read_int64_attribute(path, file, "num_classes");
  TESSERA_CHECK(info.num_classes >= 1, path, ": root attribute 'num_classes' is ", info.num_classes,
                "; it must be at least 1");
  labels.resize(size_t(info.num_samples));
  for (int64_t begin = 0; begin < info.num_samples; begin += kValidationChunk) {
    const int64_t count = std::min(kValidationChunk, info.num_samples - begin);
    int64_t* chunk = labels.data() + begin;
    read_rows(path, label_set.get(), begin, count, H5T_NATIVE_INT64, chunk);
    for (int64_t i = 0; i < count; ++i)
      TESSERA_CHECK(chunk[i] >= 0 && chunk[i] < info.num_classes, path, ": '/labels'[", begin + i, "] = ", chunk[i],
                    " is outside [0, num_classes) with num_classes = ", info.num_classes,
                    " (root attribute 'num_classes'); fix the labels or the attribute, or prepare the file again");
  }
  objects.data = std::move(images);
}

// The bytes of text a token file encodes: its 'text_bytes' attribute
// (checked), or one byte per token for a byte file written before the
// attribute existed (uint8 ids, vocabulary 256, no tokenizer); else unknown.
std::optional<int64_t> text_bytes_of(const std::string& path, hid_t file, const DatasetInfo& info) {
  if (has_attribute(file, "text_bytes")) {
    const int64_t bytes = read_int64_attribute(path, file, "text_bytes");
    TESSERA_CHECK(bytes >= info.num_tokens, path, ": root attribute 'text_bytes' is ", bytes, " for ", info.num_tokens,
                  " tokens; every token holds at least one byte (prepare the file again)");
    return bytes;
  }
  if (info.token_type == TokenType::u8 && info.vocab_size == 256 && info.tokenizer.empty()) return info.num_tokens;
  return std::nullopt;
}

void validate_tokens(const std::string& path, Hdf5Objects& objects, DatasetInfo& info) {
  const hid_t file = objects.file.get();
  const DatasetKind kind = DatasetKind::tokens;
  Hdf5Handle tokens = open_dataset(path, file, "tokens", kind);
  {
    Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_type(tokens.get())));
    if (is_integer(type.get(), 1, false))
      info.token_type = TokenType::u8;
    else if (is_integer(type.get(), 2, false))
      info.token_type = TokenType::u16;
    else if (is_integer(type.get(), 4, true))
      info.token_type = TokenType::i32;
    else
      TESSERA_THROW(path, ": dataset '/tokens' holds ", type_name(type.get()), "; it must be uint8, uint16 or int32; ",
                    prepare_hint(kind));
  }
  const std::vector<int64_t> dims = dataset_dims(path, tokens.get());
  TESSERA_CHECK(dims.size() == 1, path, ": dataset '/tokens' has shape ", shape_text(dims), "; it must be 1-D");
  info.num_tokens = dims[0];
  TESSERA_CHECK(info.num_tokens >= 2, path, ": dataset '/tokens' holds ", info.num_tokens,
                " token(s); at least 2 are needed for one input and its next-token target");
  check_written(path, tokens.get(), "tokens", kind);
  info.vocab_size = read_int64_attribute(path, file, "vocab_size");
  TESSERA_CHECK(info.vocab_size >= 1 && info.vocab_size <= int64_t(1) << 31, path, ": root attribute 'vocab_size' is ",
                info.vocab_size, "; it must be in [1, 2^31]");
  if (const std::optional<Tokenizer> tokenizer = Tokenizer::load(path)) {
    TESSERA_CHECK(tokenizer->vocab_size() == info.vocab_size, path, ": root attribute 'vocab_size' is ",
                  info.vocab_size, " but the tokenizer in group '/tokenizer' has ", tokenizer->vocab_size(),
                  " tokens; they must agree (prepare the file again)");
    info.tokenizer = tokenizer->describe();
  }
  info.text_bytes = text_bytes_of(path, file, info);

  // Only ids the storage type can hold need checking: uint8 with vocab >= 256
  // and uint16 with vocab >= 65536 are valid by construction.
  const int64_t type_limit = info.token_type == TokenType::u8    ? 256
                             : info.token_type == TokenType::u16 ? 65536
                                                                 : int64_t(1) << 31;
  const bool can_be_negative = info.token_type == TokenType::i32;
  if (can_be_negative || type_limit > info.vocab_size) {
    std::vector<int32_t> chunk(size_t(std::min(kValidationChunk, info.num_tokens)));
    for (int64_t begin = 0; begin < info.num_tokens; begin += kValidationChunk) {
      const int64_t count = std::min(kValidationChunk, info.num_tokens - begin);
      read_rows(path, tokens.get(), begin, count, H5T_NATIVE_INT32, chunk.data());
      const auto [low, high] = std::minmax_element(chunk.begin(), chunk.begin() + count);
      if (*low < 0 || *high >= info.vocab_size) {
        const auto bad = std::find_if(chunk.begin(), chunk.begin() + count,
                                      [&](int32_t id) { return id < 0 || id >= info.vocab_size; });
        TESSERA_THROW(path, ": '/tokens'[", begin + (bad - chunk.begin()), "] = ", *bad,
                      " is outside [0, vocab_size) with vocab_size = ", info.vocab_size,
                      " (root attribute 'vocab_size'); fix the tokens or the attribute, or prepare the file again");
      }
    }
  }
  objects.data = std::move(tokens);
}

std::string size_text(off_t bytes) {
  return std::to_string(static_cast<long long>(bytes)) + " bytes";
}

bool same_time(const timespec& a, const timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

// The open file's identity, from its descriptor (or the path when HDF5 does
// not expose one).
FileIdentity identity_now(const std::string& path, int fd) {
  struct stat info {};
  const int status = fd >= 0 ? ::fstat(fd, &info) : ::stat(path.c_str(), &info);
  TESSERA_CHECK(status == 0, "data file ", path, ": cannot stat it: ", std::strerror(errno));
  return {info.st_dev, info.st_ino, info.st_size, info.st_mtim};
}

// "" while `path` is still the file that was opened, with the same size and
// modification time; else what changed.
std::string what_changed(const std::string& path, const Hdf5Objects& objects) {
  const FileIdentity& opened = objects.identity;
  const FileIdentity now = identity_now(path, objects.fd);
  if (now.size < opened.size)
    return "it was " + size_text(opened.size) + " when opened and is now " + size_text(now.size) +
           " (truncated): HDF5 reads zeros past its end";
  if (now.size != opened.size)
    return "it was " + size_text(opened.size) + " when opened and is now " + size_text(now.size) +
           " (rewritten while open)";
  if (!same_time(now.modified, opened.modified))
    return "its contents were rewritten while open (its modification time changed)";
  struct stat named {};
  if (::stat(path.c_str(), &named) != 0) return "it was deleted (the path no longer exists)";
  if (named.st_dev != opened.device || named.st_ino != opened.inode)
    return "the path now names another file (it was replaced, e.g. by mv or cp --remove-destination)";
  return "";
}

// Throws when the file changed since it was opened: whatever was just read
// from it cannot be trusted.
void check_unchanged(const std::string& path, const Hdf5Objects& objects) {
  const std::string change = what_changed(path, objects);
  TESSERA_CHECK(change.empty(), "data file ", path, " changed while this job was reading it: ", change,
                ". Batches read from it can no longer be trusted, so training stops here (checkpoints already written "
                "are untouched). Restore the file, or train from a copy that nothing rewrites, and resume with "
                "--resume auto");
}

// The descriptor HDF5's default (sec2) driver reads through, or -1.
int file_descriptor(hid_t file) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  void* handle = nullptr;
  if (H5Fget_vfd_handle(file, H5P_DEFAULT, &handle) < 0 || handle == nullptr) {
    H5Eclear2(H5E_DEFAULT);
    return -1;
  }
  return *static_cast<int*>(handle);
}

// Opens and validates `path`; fills `objects` and (classification) `labels`.
DatasetInfo open_dataset_file(const std::string& path, Hdf5Objects& objects, std::vector<int64_t>& labels) {
  Hdf5QuietErrors quiet;
  DatasetInfo info;
  info.path = path;
  objects.file = open_hdf5_read(path);
  objects.fd = file_descriptor(objects.file.get());
  objects.identity = identity_now(path, objects.fd);
  read_header(path, objects.file.get(), info);
  if (info.kind == DatasetKind::classification)
    validate_classification(path, objects, info, labels);
  else
    validate_tokens(path, objects, info);
  check_unchanged(path, objects);  // validation read all labels and tokens: from the file that was opened
  return info;
}

}  // namespace

const char* dataset_kind_name(DatasetKind kind) {
  return kind == DatasetKind::classification ? "classification" : "tokens";
}

const char* token_type_name(TokenType type) {
  switch (type) {
    case TokenType::u8:
      return "uint8";
    case TokenType::u16:
      return "uint16";
    case TokenType::i32:
      return "int32";
  }
  return "?";
}

std::string DatasetInfo::describe() const {
  std::ostringstream out;
  if (kind == DatasetKind::classification)
    out << "classification: " << num_samples << " samples of " << channels << "x" << height << "x" << width << ", "
        << num_classes << " classes";
  else
    out << "tokens: " << num_tokens << " " << token_type_name(token_type) << " tokens, vocabulary " << vocab_size
        << (tokenizer.empty() ? "" : ", tokenizer " + tokenizer);
  return out.str();
}

DatasetInfo inspect_dataset(const std::string& path) {
  Hdf5Objects objects;
  std::vector<int64_t> labels;
  return open_dataset_file(path, objects, labels);
}

DatasetKind peek_dataset_kind(const std::string& path) {
  Hdf5QuietErrors quiet;
  DatasetInfo info;
  Hdf5Handle file = open_hdf5_read(path);
  read_header(path, file.get(), info);
  return info.kind;
}

ClassificationData::ClassificationData(const std::string& path) : objects_(std::make_unique<Hdf5Objects>()) {
  info_ = open_dataset_file(path, *objects_, labels_);
  TESSERA_CHECK(info_.kind == DatasetKind::classification, path,
                " holds a token stream, not a classification set (images and labels); pass a file made by "
                "`tessera prepare idx`");
}

ClassificationData::~ClassificationData() = default;
ClassificationData::ClassificationData(ClassificationData&&) noexcept = default;
ClassificationData& ClassificationData::operator=(ClassificationData&&) noexcept = default;

void ClassificationData::read_images(int64_t begin, int64_t count, uint8_t* out) const {
  Hdf5QuietErrors quiet;
  read_rows(info_.path, objects_->data.get(), begin, count, H5T_NATIVE_UINT8, out);
  check_unchanged(info_.path, *objects_);
}

void ClassificationData::read_images(std::span<const int64_t> indices, uint8_t* out) const {
  Hdf5QuietErrors quiet;
  const int64_t sample_bytes = info_.sample_bytes();
  size_t first = 0;
  while (first < indices.size()) {
    size_t last = first + 1;  // extend the run while indices are consecutive
    while (last < indices.size() && indices[last] == indices[last - 1] + 1) ++last;
    TESSERA_CHECK(indices[first] >= 0 && indices[last - 1] < info_.num_samples, info_.path, ": sample index ",
                  indices[first] < 0 ? indices[first] : indices[last - 1], " is outside [0, ", info_.num_samples, ")");
    read_rows(info_.path, objects_->data.get(), indices[first], int64_t(last - first), H5T_NATIVE_UINT8,
              out + int64_t(first) * sample_bytes);
    first = last;
  }
  check_unchanged(info_.path, *objects_);
}

TokenData::TokenData(const std::string& path) : objects_(std::make_unique<Hdf5Objects>()) {
  std::vector<int64_t> unused;
  info_ = open_dataset_file(path, *objects_, unused);
  TESSERA_CHECK(info_.kind == DatasetKind::tokens, path,
                " holds a classification set, not a token stream; pass a file made by `tessera prepare text`");
}

TokenData::~TokenData() = default;
TokenData::TokenData(TokenData&&) noexcept = default;
TokenData& TokenData::operator=(TokenData&&) noexcept = default;

void TokenData::read(int64_t begin, int64_t count, int32_t* out) const {
  Hdf5QuietErrors quiet;
  // Read the stored type and widen here: HDF5's own conversion costs more
  // than the read for short windows.
  auto read_as = [&](auto tag, hid_t memory_type) {
    using T = decltype(tag);
    std::vector<T> stored(static_cast<size_t>(count));
    read_rows(info_.path, objects_->data.get(), begin, count, memory_type, stored.data());
    std::copy(stored.begin(), stored.end(), out);
  };
  switch (info_.token_type) {
    case TokenType::u8:
      read_as(uint8_t{}, H5T_NATIVE_UINT8);
      break;
    case TokenType::u16:
      read_as(uint16_t{}, H5T_NATIVE_UINT16);
      break;
    case TokenType::i32:
      read_rows(info_.path, objects_->data.get(), begin, count, H5T_NATIVE_INT32, out);
      break;
  }
  check_unchanged(info_.path, *objects_);
}

namespace {

// CRC-32 of `count` values at `data`, continuing `crc` (zlib takes 32-bit lengths).
template <typename T>
uLong crc_of(uLong crc, const T* data, int64_t count) {
  const auto* bytes = reinterpret_cast<const Bytef*>(data);
  size_t left = size_t(count) * sizeof(T);
  while (left > 0) {
    const auto part = uInt(std::min<size_t>(left, size_t(1) << 30));
    crc = crc32(crc, bytes, part);
    bytes += part;
    left -= part;
  }
  return crc;
}

constexpr int64_t kDigestBlocks = 64;

// The [begin, begin + count) row ranges the digest reads from `rows` rows of
// `row_bytes` bytes each: all, or kDigestBlocks blocks evenly spread.
std::vector<std::pair<int64_t, int64_t>> digest_ranges(int64_t rows, int64_t row_bytes, int64_t whole_below) {
  if (rows * row_bytes <= whole_below) return {{0, rows}};
  const int64_t block = std::max<int64_t>(1, (whole_below / kDigestBlocks) / row_bytes);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t i = 0; i < kDigestBlocks; ++i) {
    const int64_t begin = (rows - block) * i / (kDigestBlocks - 1);
    ranges.emplace_back(begin, std::min(block, rows - begin));
  }
  return ranges;
}

std::string digest_text(uLong crc, bool whole, int64_t count, const char* unit) {
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08lx", static_cast<unsigned long>(crc));
  return std::string("crc32 0x") + hex +
         (whole ? " of all " : " of " + std::to_string(kDigestBlocks) + " blocks spread over ") +
         std::to_string(count) + " " + unit;
}

}  // namespace

std::string dataset_digest(const std::string& path, int64_t whole_below) {
  uLong crc = crc32(0L, Z_NULL, 0);
  if (peek_dataset_kind(path) == DatasetKind::tokens) {
    const TokenData data(path);
    const auto ranges = digest_ranges(data.size(), int64_t(sizeof(int32_t)), whole_below);
    std::vector<int32_t> values;
    for (const auto& [begin, count] : ranges) {
      values.resize(size_t(count));
      data.read(begin, count, values.data());
      crc = crc_of(crc, values.data(), count);
    }
    return digest_text(crc, ranges.size() == 1, data.size(), "tokens");
  }
  const ClassificationData data(path);
  crc = crc_of(crc, data.labels().data(), int64_t(data.labels().size()));
  const int64_t sample = data.info().sample_bytes();
  const auto ranges = digest_ranges(data.size(), sample, whole_below);
  std::vector<uint8_t> images;
  for (const auto& [begin, count] : ranges) {
    images.resize(size_t(count * sample));
    data.read_images(begin, count, images.data());
    crc = crc_of(crc, images.data(), count * sample);
  }
  return digest_text(crc, ranges.size() == 1, data.size(), "samples");
}

}  // namespace tessera::io
