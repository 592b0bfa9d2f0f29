// libFuzzer harness: Tessera's HDF5 dataset readers (io/dataset.h) and the
// data loader (io/loader.h) on fuzz-built files. The fuzz bytes describe a
// classification or token file (root attributes, datasets, their types,
// shapes, layouts and values; fuzz_support.h), possibly truncated; the
// harness then inspects it, opens it with the reader of its kind, reads
// samples or tokens, and draws batches from a DataLoader with fuzzed
// options. Bad files must end in tessera::Error, never a crash, a leak, an
// HDF5 id left open or undefined behaviour.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/context.h"
#include "fuzz_support.h"
#include "io/dataset.h"
#include "io/hdf5_file.h"
#include "io/loader.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

void build_dataset_file(FuzzedDataProvider& data, const fs::path& path) {
  io::Hdf5Handle file = io::file_handle(create_file(path));
  const hid_t root = file.get();
  const int kind = data.ConsumeIntegralInRange<int>(0, 2);  // classification, tokens, another
  fuzz_int_attribute(data, root, "tessera_schema", io::kSchemaVersion);
  fuzz_string_attribute(data, root, "kind", kind == 0 ? "classification" : kind == 1 ? "tokens" : "images");

  const auto samples = data.ConsumeIntegralInRange<hsize_t>(1, 16);
  if (kind != 1) {
    const auto channels = data.ConsumeIntegralInRange<hsize_t>(1, 3);
    const auto height = data.ConsumeIntegralInRange<hsize_t>(1, 8);
    const auto width = data.ConsumeIntegralInRange<hsize_t>(1, 8);
    const int64_t classes = data.ConsumeIntegralInRange<int64_t>(1, 12);
    fuzz_int_attribute(data, root, "num_classes", classes);
    fuzz_dataset(data, root, "images", {ElementType::u8, {samples, channels, height, width}, 256});
    fuzz_dataset(data, root, "labels", {ElementType::i64, {samples}, classes});
  } else {
    const auto token_type =
        ElementType(data.PickValueInArray({int(ElementType::u8), int(ElementType::u16), int(ElementType::i32)}));
    const int64_t vocab = data.PickValueInArray<int64_t>({256, 7, 65536, 300, int64_t(1) << 31});
    fuzz_int_attribute(data, root, "vocab_size", vocab);
    const hsize_t tokens = samples * data.ConsumeIntegralInRange<hsize_t>(2, 64);
    fuzz_dataset(data, root, "tokens", {token_type, {tokens}, vocab});
  }
}

io::LoaderOptions fuzzed_options(FuzzedDataProvider& data) {
  io::LoaderOptions options;
  options.batch_size = data.ConsumeIntegralInRange<int64_t>(1, 8);
  options.seq_length = data.ConsumeIntegralInRange<int64_t>(1, 32);
  options.shuffle = data.ConsumeBool();
  options.drop_last = data.ConsumeBool();
  options.shard_count = data.ConsumeIntegralInRange<int64_t>(1, 3);
  options.shard_rank = data.ConsumeIntegralInRange<int64_t>(0, options.shard_count - 1);
  options.seed = data.ConsumeIntegral<uint64_t>();
  options.prefetch = data.ConsumeIntegralInRange<int>(1, 2);
  options.input_dtype = data.PickValueInArray({DType::f32, DType::bf16, DType::f16});
  return options;
}

void read_with_the_readers(FuzzedDataProvider& data, const std::string& path) {
  expect_clean_errors([&] { io::inspect_dataset(path); });
  expect_clean_errors([&] {
    // At most kMaxRead samples or tokens: a valid file may be large.
    constexpr int64_t kMaxRead = 4096;
    if (io::peek_dataset_kind(path) == io::DatasetKind::classification) {
      io::ClassificationData images(path);
      const int64_t n = std::min(images.size(), kMaxRead), sample = images.info().sample_bytes();
      if (sample > kMaxRead * 64) return;
      std::vector<uint8_t> out(size_t(n * sample));
      images.read_images(0, n, out.data());
      const std::vector<int64_t> picks = {images.size() - 1, 0, 0, images.size() / 2};  // any order, repeats
      std::vector<uint8_t> picked(picks.size() * size_t(sample));
      images.read_images(picks, picked.data());
    } else {
      io::TokenData tokens(path);
      const int64_t n = std::min(tokens.size(), kMaxRead);
      std::vector<int32_t> out(static_cast<size_t>(n));
      tokens.read(tokens.size() - n, n, out.data());
    }
  });
  static Context ctx;
  const io::LoaderOptions options = fuzzed_options(data);
  expect_clean_errors([&] {
    io::DataLoader loader(ctx, path, options);
    for (int i = 0; i < 3; ++i) loader.next();
    loader.batch_indices(1, loader.batches_per_epoch() - 1);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  const fs::path path = fresh_scratch_dir() / "data.h5";
  build_dataset_file(data, path);
  maybe_truncate(data, path);
  read_with_the_readers(data, path.string());
  check_hdf5_ids_closed();
  return 0;
}
