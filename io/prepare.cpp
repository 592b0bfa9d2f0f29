// Dataset preparation: IDX (MNIST format, plain or gzip) to a classification
// file; text files to a byte-level or BPE token stream, and other tools'
// token files (io/token_files.h) to a token stream, each with a held-out tail.
#include "io/prepare.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <system_error>

#include "core/error.h"
#include "io/hdf5_file.h"
#include "io/tokenizer.h"

namespace tessera::io {
namespace {

constexpr int64_t kImagesPerChunk = 4096;              // IDX images converted per write
constexpr int64_t kTextChunkBytes = int64_t(1) << 20;  // text bytes read per write
constexpr int64_t kTokenChunk = int64_t(1) << 20;      // token ids read per write

void report(const PrepareProgress& progress, std::string_view stage, int64_t done, int64_t total) {
  if (progress) progress(stage, done, total);
}

// Writes go to "<path>.partial", renamed onto `path` by commit(); removed if
// the preparation fails first.
class PartialFile {
 public:
  explicit PartialFile(std::string path) : path_(std::move(path)), partial_(path_ + ".partial") {}
  ~PartialFile() {
    if (!committed_) {
      std::error_code ignored;
      std::filesystem::remove(partial_, ignored);
    }
  }
  PartialFile(const PartialFile&) = delete;
  PartialFile& operator=(const PartialFile&) = delete;

  const std::string& partial() const { return partial_; }
  void commit() {
    std::error_code error;
    std::filesystem::rename(partial_, path_, error);
    TESSERA_CHECK(!error, "cannot rename ", partial_, " to ", path_, ": ", error.message());
    committed_ = true;
  }

 private:
  std::string path_, partial_;
  bool committed_ = false;
};

void check_input_file(const std::string& path, const char* what) {
  check_readable_file(path, what, "check the path");
}

// Reads an IDX file, decompressing it when it is gzip (zlib detects the gzip
// magic 1f 8b and reads other files as they are).
class IdxReader {
 public:
  IdxReader(std::string path, const char* flag) : path_(std::move(path)), flag_(flag) {
    check_input_file(path_, flag_);
    file_ = gzopen(path_.c_str(), "rb");
    TESSERA_CHECK(file_ != nullptr, "cannot open ", flag_, " ", path_, ": ", std::strerror(errno));
    gzbuffer(file_, 1 << 18);
  }
  ~IdxReader() {
    if (file_) gzclose(file_);
  }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  const std::string& path() const { return path_; }

  // Reads up to `bytes` bytes, fewer only at the end of the file; returns how many.
  int64_t read_some(void* out, int64_t bytes, const char* what) {
    auto* cursor = static_cast<char*>(out);
    int64_t done = 0;
    while (done < bytes) {
      const unsigned request = unsigned(std::min<int64_t>(bytes - done, int64_t(1) << 30));
      const int got = gzread(file_, cursor + done, request);
      if (got < 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        TESSERA_THROW(flag_, " ", path_, ": cannot read ", what, ": ", message,
                      " (corrupt gzip data? download the file again)");
      }
      if (got == 0) break;
      done += got;
    }
    return done;
  }

  // Reads exactly `bytes` bytes; a short read is a truncated or corrupt file.
  void read(void* out, int64_t bytes, const char* what) {
    const int64_t done = read_some(out, bytes, what);
    TESSERA_CHECK(done == bytes, flag_, " ", path_, " ends after ", done, " of the ", bytes, " bytes of ", what,
                  ": the file is truncated; download it again");
  }

  // The same into `out`, grown as the data arrives (16 MiB at a time): a
  // header that claims more than the file holds ends in the truncation
  // message, not in an allocation of the size it claims.
  void read(std::vector<uint8_t>& out, int64_t bytes, const char* what) {
    constexpr int64_t kStep = int64_t(1) << 24;
    out.clear();
    while (int64_t(out.size()) < bytes) {
      const int64_t done = int64_t(out.size());
      const int64_t step = std::min(bytes - done, kStep);
      out.resize(size_t(done + step));
      const int64_t got = read_some(out.data() + done, step, what);
      TESSERA_CHECK(got == step, flag_, " ", path_, " ends after ", done + got, " of the ", bytes, " bytes of ", what,
                    ": the file is truncated; download it again");
    }
  }

  // True if bytes remain after what was read.
  bool has_more() {
    char extra;
    return gzread(file_, &extra, 1) == 1;
  }

  // The IDX header: magic (0, 0, type, rank) then `rank` big-endian sizes.
  std::vector<int64_t> read_header(int expected_rank, const char* content) {
    uint8_t magic[4];
    read(magic, 4, "the IDX magic number");
    const uint32_t value = uint32_t(magic[0]) << 24 | uint32_t(magic[1]) << 16 | uint32_t(magic[2]) << 8 | magic[3];
    const uint32_t expected = 0x0800u | uint32_t(expected_rank);
    if (value != expected) {
      char text[64];
      std::snprintf(text, sizeof text, "0x%08x, expected 0x%08x", value, expected);
      TESSERA_THROW(flag_, " ", path_, ": IDX magic number is ", text, " (unsigned bytes, ", expected_rank,
                    "-D: ", content, "); ",
                    value == 0x0801u || value == 0x0803u ? "were --images and --labels swapped?"
                                                         : "is this an IDX file (e.g. train-images-idx3-ubyte.gz)?");
    }
    std::vector<int64_t> dims(static_cast<size_t>(expected_rank));
    for (auto& dim : dims) {
      uint8_t bytes[4];
      read(bytes, 4, "the IDX header");
      dim = int64_t(uint32_t(bytes[0]) << 24 | uint32_t(bytes[1]) << 16 | uint32_t(bytes[2]) << 8 | bytes[3]);
    }
    return dims;
  }

 private:
  std::string path_;
  const char* flag_;
  gzFile file_ = nullptr;
};

void write_root_attributes(const std::string& path, hid_t file, const char* kind) {
  write_int64_attribute(path, file, "tessera_schema", kSchemaVersion);
  write_string_attribute(path, file, "kind", kind);
}

}  // namespace

DatasetInfo prepare_idx(const std::string& images_idx, const std::string& labels_idx, const std::string& out_h5,
                        const PrepareProgress& progress, int64_t num_classes) {
  TESSERA_CHECK(num_classes >= 0, "prepare idx: --num-classes is ", num_classes,
                "; give a positive count, or 0 to use the largest label + 1");
  IdxReader image_file(images_idx, "--images");
  IdxReader label_file(labels_idx, "--labels");
  const std::vector<int64_t> image_dims = image_file.read_header(3, "images [N, H, W]");
  const std::vector<int64_t> label_dims = label_file.read_header(1, "labels [N]");
  const int64_t count = image_dims[0], height = image_dims[1], width = image_dims[2];
  TESSERA_CHECK(count == label_dims[0], "prepare idx: --images ", images_idx, " holds ", count, " images but --labels ",
                labels_idx, " holds ", label_dims[0], " labels; pass the matching pair (e.g. t10k-images with ",
                "t10k-labels)");
  TESSERA_CHECK(count > 0 && height > 0 && width > 0, "prepare idx: --images ", images_idx, " has shape [", count, ", ",
                height, ", ", width, "]; every size must be at least 1");
  int64_t image_bytes = 0, total_bytes = 0;  // the sizes are 32-bit: their product can overflow
  TESSERA_CHECK(
      !__builtin_mul_overflow(height, width, &image_bytes) && !__builtin_mul_overflow(count, image_bytes, &total_bytes),
      "prepare idx: --images ", images_idx, " claims ", count, " images of ", height, " x ", width,
      " pixels, more bytes than a file can hold; its header is corrupt (download it again)");

  // Labels first: they are small, and num_classes must be known before writing.
  report(progress, "labels", 0, count);
  std::vector<uint8_t> label_bytes;
  label_file.read(label_bytes, count, "the labels");
  TESSERA_CHECK(!label_file.has_more(), "--labels ", labels_idx, " has data after its ", count,
                " labels; is it an IDX label file?");
  const int64_t largest = *std::max_element(label_bytes.begin(), label_bytes.end());
  if (num_classes == 0) num_classes = largest + 1;
  TESSERA_CHECK(largest < num_classes, "prepare idx: --labels ", labels_idx, " holds label ", largest,
                " but --num-classes is ", num_classes, "; raise --num-classes or omit it");
  const std::vector<int64_t> labels(label_bytes.begin(), label_bytes.end());
  report(progress, "labels", count, count);

  PartialFile output(out_h5);
  {
    const std::string& path = output.partial();
    Hdf5QuietErrors quiet;
    Hdf5Handle file = create_hdf5_file(path);
    const int64_t image_shape[] = {count, 1, height, width};
    Hdf5Handle images = create_dataset(path, file.get(), "images", H5T_STD_U8LE, image_shape);
    const int64_t label_shape[] = {count};
    Hdf5Handle label_set = create_dataset(path, file.get(), "labels", H5T_STD_I64LE, label_shape);
    write_rows(path, label_set.get(), 0, count, H5T_NATIVE_INT64, labels.data());

    std::vector<uint8_t> chunk;
    report(progress, "images", 0, count);
    for (int64_t begin = 0; begin < count; begin += kImagesPerChunk) {
      const int64_t rows = std::min(kImagesPerChunk, count - begin);
      image_file.read(chunk, rows * image_bytes, "the images");
      write_rows(path, images.get(), begin, rows, H5T_NATIVE_UINT8, chunk.data());
      report(progress, "images", begin + rows, count);
    }
    TESSERA_CHECK(!image_file.has_more(), "--images ", images_idx, " has data after its ", count,
                  " images; is it an IDX image file?");
    write_root_attributes(path, file.get(), "classification");
    write_int64_attribute(path, file.get(), "num_classes", num_classes);
    TESSERA_HDF5_CHECK_AT(path, H5Fflush(file.get(), H5F_SCOPE_GLOBAL));
  }
  output.commit();
  return inspect_dataset(out_h5);
}

int64_t text_eval_tokens(int64_t total, double eval_fraction) {
  return int64_t(std::floor(double(total) * eval_fraction));
}

namespace {

// Checks the held-out split's flags (`what`: "prepare text").
void check_split_flags(const std::string& what, const std::string& out_h5, const std::string& eval_out_h5,
                       double eval_fraction) {
  TESSERA_CHECK(eval_fraction >= 0.0 && eval_fraction < 1.0, what, ": --eval-fraction is ", eval_fraction,
                "; it must be in [0, 1)");
  TESSERA_CHECK(!eval_out_h5.empty() || eval_fraction == 0.0, what, ": --eval-fraction ", eval_fraction,
                " holds tokens out but no eval file was given; pass --eval-output FILE");
  if (!eval_out_h5.empty()) {
    TESSERA_CHECK(eval_fraction > 0.0, what, ": --eval-output ", eval_out_h5,
                  " was given with --eval-fraction 0; give a fraction in (0, 1)");
    std::error_code error;
    TESSERA_CHECK(eval_out_h5 != out_h5 && !std::filesystem::equivalent(eval_out_h5, out_h5, error), what,
                  ": -o and --eval-output are the same file (", out_h5, "); give two names");
  }
}

// A stream of `total` tokens written in order into a training file and, for
// its last `eval_count`, an eval file: /tokens of `file_type` and the
// vocabulary size, each as "<file>.partial" renamed into place by commit().
class TokenStreamWriter {
 public:
  TokenStreamWriter(const std::string& what, const std::string& out_h5, const std::string& eval_out_h5,
                    double eval_fraction, int64_t total, hid_t file_type, int64_t vocab_size, const char* unit)
      : out_h5_(out_h5),
        eval_out_h5_(eval_out_h5),
        file_type_(file_type),
        vocab_size_(vocab_size),
        train_output_(out_h5) {
    const int64_t eval_count = eval_out_h5.empty() ? 0 : text_eval_tokens(total, eval_fraction);
    train_count_ = total - eval_count;
    TESSERA_CHECK(train_count_ >= 2, what, ": the input holds ", total, " ", unit, ", leaving ", train_count_,
                  " for training; at least 2 are needed (give more input or a smaller --eval-fraction)");
    TESSERA_CHECK(eval_out_h5.empty() || eval_count >= 2, what, ": --eval-fraction ", eval_fraction, " of ", total, " ",
                  unit, " holds out ", eval_count, "; at least 2 are needed (give more input or a larger fraction)");
    train_ = open(train_output_.partial(), train_count_);
    if (!eval_out_h5.empty()) {
      eval_output_.emplace(eval_out_h5);
      eval_ = open(eval_output_->partial(), eval_count);
    }
  }

  // The next `count` tokens of the stream (`memory_type`, `element_size` bytes each).
  void write(const void* tokens, int64_t count, hid_t memory_type, size_t element_size) {
    const auto* bytes = static_cast<const char*>(tokens);
    const int64_t to_train = std::clamp<int64_t>(train_count_ - position_, 0, count);
    if (to_train > 0) write_rows(train_output_.partial(), train_.tokens.get(), position_, to_train, memory_type, bytes);
    if (count > to_train)
      write_rows(eval_output_->partial(), eval_.tokens.get(), position_ + to_train - train_count_, count - to_train,
                 memory_type, bytes + size_t(to_train) * element_size);
    position_ += count;
  }

  int64_t train_count() const { return train_count_; }

  // The bytes of text the training file's and the eval file's tokens encode
  // (root attribute 'text_bytes', for bits per byte); unset: unknown.
  void set_text_bytes(int64_t train, int64_t eval) { text_bytes_ = {train, eval}; }

  // Attributes (and the tokenizer, if any) written, the files closed and
  // renamed into place, re-opened through the validating reader.
  TextPrepareResult commit(const Tokenizer* tokenizer = nullptr) {
    close(train_output_.partial(), train_, text_bytes_ ? std::optional(text_bytes_->first) : std::nullopt);
    if (eval_output_)
      close(eval_output_->partial(), eval_, text_bytes_ ? std::optional(text_bytes_->second) : std::nullopt);
    if (tokenizer) {
      tokenizer->save(train_output_.partial());
      if (eval_output_) tokenizer->save(eval_output_->partial());
    }
    train_output_.commit();
    if (eval_output_) eval_output_->commit();
    TextPrepareResult result;
    result.train = inspect_dataset(out_h5_);
    if (eval_output_) result.eval = inspect_dataset(eval_out_h5_);
    return result;
  }

 private:
  struct File {
    Hdf5Handle file, tokens;
  };
  File open(const std::string& path, int64_t count) const {
    File out;
    out.file = create_hdf5_file(path);
    const int64_t shape[] = {count};
    out.tokens = create_dataset(path, out.file.get(), "tokens", file_type_, shape);
    return out;
  }
  void close(const std::string& path, File& file, std::optional<int64_t> text_bytes) const {
    write_root_attributes(path, file.file.get(), "tokens");
    write_int64_attribute(path, file.file.get(), "vocab_size", vocab_size_);
    if (text_bytes) write_int64_attribute(path, file.file.get(), "text_bytes", *text_bytes);
    file.tokens.reset();
    file.file.reset();
  }

  std::string out_h5_, eval_out_h5_;
  hid_t file_type_;
  int64_t vocab_size_;
  int64_t train_count_ = 0, position_ = 0;
  PartialFile train_output_;
  std::optional<PartialFile> eval_output_;
  File train_, eval_;
  std::optional<std::pair<int64_t, int64_t>> text_bytes_;
};

// The size of each text file (each checked to be readable) and their sum.
std::vector<int64_t> text_file_sizes(const std::vector<std::string>& files, int64_t& total) {
  TESSERA_CHECK(!files.empty(), "prepare text: no input files; pass one or more text files");
  std::vector<int64_t> sizes;
  total = 0;
  for (const std::string& file : files) {
    check_input_file(file, "text file");
    sizes.push_back(int64_t(std::filesystem::file_size(file)));
    total += sizes.back();
  }
  return sizes;
}

// Hands the files' bytes in order to `take(bytes, count)`, at most kTextChunkBytes at a time.
template <typename Take>
void read_text_files(const std::vector<std::string>& files, const std::vector<int64_t>& sizes, int64_t total,
                     const PrepareProgress& progress, Take&& take) {
  std::vector<char> chunk(size_t(std::min(kTextChunkBytes, total)));
  int64_t position = 0;  // in the concatenated stream
  report(progress, "text", 0, total);
  for (size_t index = 0; index < files.size(); ++index) {
    std::ifstream in(files[index], std::ios::binary);
    TESSERA_CHECK(in, "cannot open text file ", files[index], ": ", std::strerror(errno));
    int64_t file_done = 0;
    while (file_done < sizes[index]) {
      const int64_t want = std::min<int64_t>(int64_t(chunk.size()), sizes[index] - file_done);
      in.read(chunk.data(), want);
      TESSERA_CHECK(in.gcount() == want, "text file ", files[index], " ended after ", file_done + in.gcount(),
                    " of its ", sizes[index], " bytes; did it change while being read?");
      take(chunk.data(), want);
      position += want;
      file_done += want;
      report(progress, "text", position, total);
    }
  }
}

// "bytes" or "bpe", once the flags are checked against each other.
std::string checked_tokenizer_kind(const TextTokenizerOptions& options) {
  const bool files = !options.vocab_json.empty() || !options.merges_txt.empty();
  TESSERA_CHECK(options.tokenizer.empty() || options.tokenizer == "bytes" || options.tokenizer == "bpe",
                "prepare text: --tokenizer ", options.tokenizer, " is not known; give bytes or bpe");
  TESSERA_CHECK(options.vocab_json.empty() == options.merges_txt.empty(),
                "prepare text: ", options.vocab_json.empty() ? "--merges needs --vocab" : "--vocab needs --merges",
                "; a GPT-2 tokenizer is the pair vocab.json and merges.txt");
  const std::string kind = options.tokenizer.empty() ? (files ? "bpe" : "bytes") : options.tokenizer;
  if (kind == "bytes") {
    TESSERA_CHECK(!files, "prepare text: --vocab and --merges load a BPE tokenizer, but --tokenizer is bytes; drop ",
                  "--tokenizer bytes (or the files)");
    TESSERA_CHECK(options.vocab_size == 0, "prepare text: --vocab-size ", options.vocab_size,
                  " is for BPE training, but the tokenizer is bytes (vocabulary 256); add --tokenizer bpe or drop "
                  "--vocab-size");
    return kind;
  }
  if (files) {
    TESSERA_CHECK(options.vocab_size == 0, "prepare text: --vocab-size ", options.vocab_size,
                  " cannot be used with --vocab and --merges (the files fix the vocabulary); drop --vocab-size");
  } else {
    TESSERA_CHECK(options.vocab_size != 0,
                  "prepare text: --tokenizer bpe needs --vocab-size N to train on the text "
                  "(e.g. 4096), or --vocab vocab.json --merges merges.txt to load GPT-2's files");
    TESSERA_CHECK(options.vocab_size >= 257 && options.vocab_size <= kMaxVocabSize, "prepare text: --vocab-size ",
                  options.vocab_size, " is outside [257, 2^20]: 256 bytes plus at least one merge");
  }
  return kind;
}

TextPrepareResult prepare_bpe_text(const std::vector<std::string>& files, const std::string& out_h5,
                                   const std::string& eval_out_h5, double eval_fraction,
                                   const PrepareProgress& progress, const TextTokenizerOptions& options) {
  int64_t total = 0;
  const std::vector<int64_t> sizes = text_file_sizes(files, total);
  std::optional<Tokenizer> loaded;
  if (!options.vocab_json.empty()) loaded = Tokenizer::from_gpt2_files(options.vocab_json, options.merges_txt);
  std::string text;
  text.reserve(size_t(total));
  read_text_files(files, sizes, total, progress, [&](const char* bytes, int64_t count) { text.append(bytes, count); });
  std::string note;
  if (!loaded) {
    BpeTraining training = Tokenizer::train_bpe(
        text, options.vocab_size, [&](int64_t done, int64_t merges) { report(progress, "merges", done, merges); });
    loaded = std::move(training.tokenizer);
    note = std::move(training.note);
  }
  const Tokenizer& tokenizer = *loaded;
  const std::vector<int32_t> ids =
      tokenizer.encode(text, [&](int64_t done, int64_t bytes) { report(progress, "encode", done, bytes); });
  text = std::string();  // the ids from here on
  const bool narrow = tokenizer.vocab_size() <= 65536;
  Hdf5QuietErrors quiet;
  TokenStreamWriter writer("prepare text", out_h5, eval_out_h5, eval_fraction, int64_t(ids.size()),
                           narrow ? H5T_STD_U16LE : H5T_STD_I32LE, tokenizer.vocab_size(), "tokens");
  std::vector<uint16_t> narrow_chunk;
  const auto count = int64_t(ids.size());
  for (int64_t first = 0; first < count; first += kTokenChunk) {
    const int64_t rows = std::min(kTokenChunk, count - first);
    if (narrow) {
      narrow_chunk.assign(ids.begin() + first, ids.begin() + first + rows);
      writer.write(narrow_chunk.data(), rows, H5T_NATIVE_UINT16, 2);
    } else {
      writer.write(ids.data() + first, rows, H5T_NATIVE_INT32, 4);
    }
    report(progress, "tokens", first + rows, count);
  }
  int64_t train_bytes = 0, eval_bytes = 0;
  for (int64_t i = 0; i < count; ++i)
    (i < writer.train_count() ? train_bytes : eval_bytes) += int64_t(tokenizer.token_text(ids[size_t(i)]).size());
  writer.set_text_bytes(train_bytes, eval_bytes);
  TextPrepareResult result = writer.commit(&tokenizer);
  result.note = std::move(note);
  return result;
}

}  // namespace

TextPrepareResult prepare_text(const std::vector<std::string>& files, const std::string& out_h5,
                               const std::string& eval_out_h5, double eval_fraction, const PrepareProgress& progress,
                               const TextTokenizerOptions& tokenizer) {
  check_split_flags("prepare text", out_h5, eval_out_h5, eval_fraction);
  if (checked_tokenizer_kind(tokenizer) == "bpe")
    return prepare_bpe_text(files, out_h5, eval_out_h5, eval_fraction, progress, tokenizer);
  int64_t total = 0;
  const std::vector<int64_t> sizes = text_file_sizes(files, total);
  Hdf5QuietErrors quiet;
  TokenStreamWriter writer("prepare text", out_h5, eval_out_h5, eval_fraction, total, H5T_STD_U8LE, 256, "bytes");
  read_text_files(files, sizes, total, progress,
                  [&](const char* bytes, int64_t count) { writer.write(bytes, count, H5T_NATIVE_UINT8, 1); });
  writer.set_text_bytes(writer.train_count(), total - writer.train_count());  // a token is a byte
  return writer.commit();
}

TextPrepareResult prepare_token_files(const std::vector<TokenSource>& sources, const std::string& out_h5,
                                      const std::string& eval_out_h5, double eval_fraction, int64_t vocab_size,
                                      const PrepareProgress& progress) {
  const std::string what = "prepare " + std::string(sources.empty() ? "tokens" : sources.front().format);
  TESSERA_CHECK(!sources.empty(), "prepare: no token files; pass one or more");
  TESSERA_CHECK(vocab_size >= 0 && vocab_size <= (int64_t(1) << 31), what, ": --vocab-size is ", vocab_size,
                "; give the tokenizer's vocabulary size (at most 2^31), or 0 for the largest token id + 1");
  check_split_flags(what, out_h5, eval_out_h5, eval_fraction);
  int64_t total = 0;
  for (const TokenSource& source : sources) total += source.tokens;
  std::vector<int64_t> chunk(size_t(std::min(kTokenChunk, std::max<int64_t>(total, 1))));
  // Pass 1: every id checked (against --vocab-size, or what int32 storage holds), the largest found.
  const int64_t limit = vocab_size > 0 ? vocab_size : int64_t(1) << 31;
  int64_t largest = -1, done = 0;
  for (const TokenSource& source : sources)
    for (int64_t first = 0; first < source.tokens; first += int64_t(chunk.size())) {
      const int64_t count = std::min<int64_t>(int64_t(chunk.size()), source.tokens - first);
      read_source_tokens(source, first, count, chunk.data(), limit);
      largest = std::max(largest, *std::max_element(chunk.begin(), chunk.begin() + count));
      report(progress, "check", done += count, total);
    }
  const int64_t vocabulary = vocab_size > 0 ? vocab_size : largest + 1;
  const bool narrow = vocabulary <= 65536;
  Hdf5QuietErrors quiet;
  TokenStreamWriter writer(what, out_h5, eval_out_h5, eval_fraction, total, narrow ? H5T_STD_U16LE : H5T_STD_I32LE,
                           vocabulary, "tokens");
  // Pass 2: the stream, converted to the stored dtype.
  std::vector<uint16_t> narrow_chunk(narrow ? chunk.size() : 0);
  std::vector<int32_t> wide_chunk(narrow ? 0 : chunk.size());
  done = 0;
  for (const TokenSource& source : sources)
    for (int64_t first = 0; first < source.tokens; first += int64_t(chunk.size())) {
      const int64_t count = std::min<int64_t>(int64_t(chunk.size()), source.tokens - first);
      read_source_tokens(source, first, count, chunk.data(), vocabulary);
      if (narrow) {
        std::transform(chunk.begin(), chunk.begin() + count, narrow_chunk.begin(),
                       [](int64_t id) { return uint16_t(id); });
        writer.write(narrow_chunk.data(), count, H5T_NATIVE_UINT16, 2);
      } else {
        std::transform(chunk.begin(), chunk.begin() + count, wide_chunk.begin(),
                       [](int64_t id) { return int32_t(id); });
        writer.write(wide_chunk.data(), count, H5T_NATIVE_INT32, 4);
      }
      report(progress, "tokens", done += count, total);
    }
  return writer.commit();
}

}  // namespace tessera::io
