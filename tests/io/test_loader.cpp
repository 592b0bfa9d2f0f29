// io/loader.h: batches hold exactly the samples their plan names (pixel/255
// in each input dtype, labels as int32); the same seed gives the same batches
// and epochs differ; data-parallel shards are disjoint and together form the
// single-rank global batch; evaluation covers every sample once, in order;
// token windows are valid and targets are the inputs shifted by one; the
// thread stops cleanly mid-epoch; a reader failure reaches next(); delivery
// to a device (emulated here) binds the worker thread to the device and keeps
// every batch intact through the copy stream.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <set>

#include "core/device_runtime.h"
#include "core/emulated_runtime.h"
#include "core/error.h"
#include "io/loader.h"
#include "tests/io/io_test_files.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using io::DataLoader;
using io::LoaderOptions;

void expect_error(const std::function<void()>& run, const std::vector<std::string>& parts) {
  try {
    run();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << ::testing::PrintToString(parts);
  } catch (const Error& error) {
    const std::string what = error.what();
    for (const std::string& part : parts)
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
}

// What a classification batch must hold for `indices`: pixel/255 rounded to `dtype`, and labels.
void expect_classification_batch(const io::Batch& batch, const ClassificationFile& data,
                                 const std::vector<int64_t>& indices, DType dtype) {
  const auto count = int64_t(indices.size());
  ASSERT_EQ(batch.inputs.shape(), (Shape{count, data.c, data.h, data.w}));
  ASSERT_EQ(batch.inputs.dtype(), dtype);
  ASSERT_EQ(batch.targets.shape(), (Shape{count}));
  ASSERT_EQ(batch.targets.dtype(), DType::i32);
  const int64_t sample = data.c * data.h * data.w;
  std::vector<double> expected;
  std::vector<int32_t> labels;
  for (int64_t index : indices) {
    for (int64_t i = 0; i < sample; ++i) expected.push_back(double(data.images[size_t(index * sample + i)]) / 255.0);
    labels.push_back(int32_t(data.labels[size_t(index)]));
  }
  // f32: x/255 is correctly rounded; bf16/f16: the rounding of that float.
  EXPECT_TRUE(all_close(batch.inputs, round_to(dtype, round_to(DType::f32, expected)), {0.0, 0.0}));
  EXPECT_EQ(batch.targets.to_vector<int32_t>(), labels);
}

TEST(Loader, ClassificationBatchesHoldTheirSamples) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("images.h5");
  const ClassificationFile data = random_classification(rng, 101, 2, 3, 4, 5);
  write_classification(path, data);
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    LoaderOptions options;
    options.batch_size = 8;
    options.seed = rng();
    options.input_dtype = dtype;
    DataLoader loader(ctx, path, options);
    ASSERT_EQ(loader.batches_per_epoch(), 101 / 8);
    EXPECT_EQ(loader.info().num_samples, 101);
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      std::set<int64_t> seen;
      for (int64_t step = 0; step < loader.batches_per_epoch(); ++step) {
        const io::Batch batch = loader.next();
        EXPECT_EQ(batch.epoch, epoch);
        EXPECT_EQ(batch.step_in_epoch, step);
        const std::vector<int64_t> indices = loader.batch_indices(epoch, step);
        ASSERT_EQ(indices.size(), 8u);
        seen.insert(indices.begin(), indices.end());
        expect_classification_batch(batch, data, indices, dtype);
      }
      EXPECT_EQ(seen.size(), size_t(loader.batches_per_epoch() * 8)) << "a sample repeats within epoch " << epoch;
      EXPECT_TRUE(*seen.begin() >= 0 && *seen.rbegin() < 101);
    }
  }
}

TEST(Loader, SameSeedSameBatchesWhileEpochsAndSeedsDiffer) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("images.h5");
  const ClassificationFile data = random_classification(rng, 64, 1, 2, 2, 3);
  write_classification(path, data);
  LoaderOptions options;
  options.batch_size = 16;
  options.seed = rng();
  options.prefetch = 1;
  DataLoader first(ctx, path, options);
  options.prefetch = 3;  // a different read-ahead must not change anything
  DataLoader second(ctx, path, options);
  for (int i = 0; i < 3 * 4; ++i) {
    const io::Batch a = first.next(), b = second.next();
    EXPECT_EQ(a.inputs.to_vector<float>(), b.inputs.to_vector<float>()) << "batch " << i;
    EXPECT_EQ(a.targets.to_vector<int32_t>(), b.targets.to_vector<int32_t>()) << "batch " << i;
  }
  auto epoch_order = [](const DataLoader& loader, int64_t epoch) {
    std::vector<int64_t> order;
    for (int64_t step = 0; step < loader.batches_per_epoch(); ++step) {
      const auto indices = loader.batch_indices(epoch, step);
      order.insert(order.end(), indices.begin(), indices.end());
    }
    return order;
  };
  EXPECT_NE(epoch_order(first, 0), epoch_order(first, 1));
  EXPECT_NE(epoch_order(first, 1), epoch_order(first, 2));
  options.seed += 1;
  DataLoader other_seed(ctx, path, options);
  EXPECT_NE(epoch_order(first, 0), epoch_order(other_seed, 0));
  // Every epoch is a permutation: all 64 samples, once each.
  std::vector<int64_t> sorted = epoch_order(first, 1);
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> all(64);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(sorted, all);
}

TEST(Loader, ShardsAreDisjointAndFormTheGlobalBatch) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("images.h5");
  const int64_t n = 53, batch = 5;
  const ClassificationFile data = random_classification(rng, n, 1, 2, 3, 4);
  write_classification(path, data);
  const uint64_t seed = rng();
  for (const bool shuffle : {true, false})
    for (const bool drop_last : {true, false})
      for (const int64_t shards : {1, 2, 3}) {
        SCOPED_TRACE("shuffle " + std::to_string(shuffle) + ", drop_last " + std::to_string(drop_last) + ", shards " +
                     std::to_string(shards));
        LoaderOptions options;
        options.batch_size = batch;
        options.seed = seed;
        options.shuffle = shuffle;
        options.drop_last = drop_last;
        options.shard_count = shards;
        std::vector<std::unique_ptr<DataLoader>> ranks;
        for (int64_t rank = 0; rank < shards; ++rank) {
          options.shard_rank = rank;
          ranks.push_back(std::make_unique<DataLoader>(ctx, path, options));
        }
        LoaderOptions single = options;  // one rank with the whole global batch
        single.shard_count = 1;
        single.shard_rank = 0;
        single.batch_size = batch * shards;
        DataLoader whole(ctx, path, single);
        const int64_t global = batch * shards;
        const int64_t steps = drop_last ? n / global : (n + global - 1) / global;
        ASSERT_EQ(whole.batches_per_epoch(), steps);
        for (int64_t epoch = 0; epoch < 2; ++epoch) {
          std::vector<int64_t> covered;
          for (int64_t step = 0; step < steps; ++step) {
            std::vector<int64_t> joined;
            std::vector<size_t> sizes;
            for (auto& rank : ranks) {
              ASSERT_EQ(rank->batches_per_epoch(), steps);
              const auto indices = rank->batch_indices(epoch, step);
              sizes.push_back(indices.size());
              joined.insert(joined.end(), indices.begin(), indices.end());
            }
            EXPECT_EQ(joined, whole.batch_indices(epoch, step)) << "step " << step;
            const auto [smallest, largest] = std::minmax_element(sizes.begin(), sizes.end());
            EXPECT_LE(*largest - *smallest, 1u) << "step " << step;
            covered.insert(covered.end(), joined.begin(), joined.end());
          }
          std::set<int64_t> distinct(covered.begin(), covered.end());
          EXPECT_EQ(distinct.size(), covered.size()) << "shards overlap in epoch " << epoch;
          EXPECT_EQ(int64_t(covered.size()), drop_last ? n / global * global : n);
        }
        // The data each rank delivers is what its plan names.
        for (int64_t step = 0; step < steps; ++step)
          for (auto& rank : ranks)
            expect_classification_batch(rank->next(), data, rank->batch_indices(0, step), DType::f32);
      }
}

TEST(Loader, EvaluationCoversEverySampleOnceInOrder) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("images.h5");
  const ClassificationFile data = random_classification(rng, 53, 3, 2, 2, 7);
  write_classification(path, data);
  LoaderOptions options;
  options.batch_size = 8;
  options.shuffle = false;
  options.drop_last = false;
  DataLoader loader(ctx, path, options);
  ASSERT_EQ(loader.batches_per_epoch(), 7);
  std::vector<float> inputs;
  std::vector<int32_t> targets;
  for (int64_t step = 0; step < 7; ++step) {
    const io::Batch batch = loader.next();
    EXPECT_EQ(batch.inputs.size(0), step < 6 ? 8 : 5);
    const auto x = batch.inputs.to_vector<float>();
    const auto y = batch.targets.to_vector<int32_t>();
    inputs.insert(inputs.end(), x.begin(), x.end());
    targets.insert(targets.end(), y.begin(), y.end());
  }
  EXPECT_EQ(targets, std::vector<int32_t>(data.labels.begin(), data.labels.end()));
  ASSERT_EQ(inputs.size(), data.images.size());
  for (size_t i = 0; i < inputs.size(); ++i) ASSERT_EQ(inputs[i], float(data.images[i]) / 255.0f) << "element " << i;
  // The next epoch starts over.
  const io::Batch again = loader.next();
  EXPECT_EQ(again.epoch, 1);
  EXPECT_EQ(again.targets.to_vector<int32_t>(), std::vector<int32_t>(data.labels.begin(), data.labels.begin() + 8));
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, size_t count, int32_t vocab) {
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> tokens(count);
  for (auto& t : tokens) t = id(rng);
  return tokens;
}

TEST(Loader, TokenWindowsAreValidAndTargetsAreShifted) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("tokens.h5");
  const int64_t n = 5000, length = 16, batch = 4;
  const std::vector<int32_t> tokens = random_tokens(rng, size_t(n), 1000);
  write_tokens(path, tokens, H5T_STD_U16LE, 1000);
  LoaderOptions options;
  options.batch_size = batch;
  options.seq_length = length;
  options.seed = rng();
  DataLoader loader(ctx, path, options);
  DataLoader twin(ctx, path, options);
  ASSERT_EQ(loader.batches_per_epoch(), n / (batch * length));
  std::set<int64_t> offsets_seen;
  for (int64_t i = 0; i < loader.batches_per_epoch() + 3; ++i) {
    const io::Batch b = loader.next();
    const io::Batch t = twin.next();
    ASSERT_EQ(b.inputs.shape(), (Shape{batch, length}));
    ASSERT_EQ(b.targets.shape(), (Shape{batch, length}));
    ASSERT_EQ(b.inputs.dtype(), DType::i32);
    const auto x = b.inputs.to_vector<int32_t>(), y = b.targets.to_vector<int32_t>();
    EXPECT_EQ(x, t.inputs.to_vector<int32_t>());
    const auto offsets = loader.batch_indices(b.epoch, b.step_in_epoch);
    ASSERT_EQ(int64_t(offsets.size()), batch);
    for (int64_t row = 0; row < batch; ++row) {
      const int64_t offset = offsets[size_t(row)];
      ASSERT_TRUE(offset >= 0 && offset <= n - length - 1) << offset;
      offsets_seen.insert(offset);
      for (int64_t k = 0; k < length; ++k) {
        ASSERT_EQ(x[size_t(row * length + k)], tokens[size_t(offset + k)]);
        ASSERT_EQ(y[size_t(row * length + k)], tokens[size_t(offset + k + 1)]);
      }
    }
  }
  EXPECT_GT(offsets_seen.size(), size_t(loader.batches_per_epoch() * batch / 2)) << "offsets barely vary";
  EXPECT_NE(loader.batch_indices(0, 0), loader.batch_indices(1, 0));
}

TEST(Loader, TokenEvaluationWindowsAreConsecutive) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("tokens.h5");
  const auto n = std::uniform_int_distribution<int64_t>(200, 400)(rng);
  const int64_t length = 7, batch = 3;
  const std::vector<int32_t> tokens = random_tokens(rng, size_t(n), 50000);
  write_tokens(path, tokens, H5T_STD_I32LE, 50000);
  for (const int64_t shards : {1, 2}) {
    SCOPED_TRACE("shards " + std::to_string(shards));
    std::vector<std::unique_ptr<DataLoader>> ranks;
    for (int64_t rank = 0; rank < shards; ++rank) {
      LoaderOptions options;
      options.batch_size = batch;
      options.seq_length = length;
      options.shuffle = false;
      options.drop_last = false;
      options.shard_rank = rank;
      options.shard_count = shards;
      ranks.push_back(std::make_unique<DataLoader>(ctx, path, options));
    }
    const int64_t windows = (n - 1) / length;
    ASSERT_EQ(ranks[0]->batches_per_epoch(), (windows + batch * shards - 1) / (batch * shards));
    std::vector<int32_t> inputs, targets;
    for (int64_t step = 0; step < ranks[0]->batches_per_epoch(); ++step)
      for (auto& rank : ranks) {
        const io::Batch b = rank->next();
        const auto x = b.inputs.to_vector<int32_t>(), y = b.targets.to_vector<int32_t>();
        inputs.insert(inputs.end(), x.begin(), x.end());
        targets.insert(targets.end(), y.begin(), y.end());
      }
    EXPECT_EQ(inputs, std::vector<int32_t>(tokens.begin(), tokens.begin() + windows * length));
    EXPECT_EQ(targets, std::vector<int32_t>(tokens.begin() + 1, tokens.begin() + windows * length + 1));
  }
}

TEST(Loader, StopsCleanlyMidEpoch) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("images.h5");
  write_classification(path, random_classification(rng, 300, 1, 8, 8, 10));
  std::uniform_int_distribution<int> prefetch(1, 4), taken(0, 5);
  for (int round = 0; round < 25; ++round) {
    LoaderOptions options;
    options.batch_size = 7;
    options.seed = uint64_t(round);
    options.prefetch = prefetch(rng);
    DataLoader loader(ctx, path, options);
    for (int i = taken(rng); i > 0; --i) loader.next();
  }  // each destructor must stop and join a thread that may be blocked on a full queue
  // The context still works and every batch went back to the allocator.
  EXPECT_EQ(ctx.allocator(Device::cpu()).stats().allocated_bytes, 0u);
}

TEST(Loader, ReaderFailureReachesNextWithTheFileName) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("corrupt.h5");
  const ClassificationFile data = random_classification(rng, 40, 1, 6, 6, 3);
  write_classification(path, data, /*chunk_rows=*/40);  // one deflated chunk; opening never reads it
  haddr_t address = 0;
  hsize_t chunk_bytes = 0;
  {
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t images = H5Dopen2(file, "images", H5P_DEFAULT);
    const hid_t space = H5Dget_space(images);
    hsize_t offset[4];
    unsigned filter_mask = 0;
    ASSERT_GE(H5Dget_chunk_info(images, space, 0, offset, &filter_mask, &address, &chunk_bytes), 0);
    H5Sclose(space);
    H5Dclose(images);
    H5Fclose(file);
  }
  ASSERT_GT(chunk_bytes, 8u);
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(std::streamoff(address));
    const std::string garbage(size_t(chunk_bytes), '\xff');
    file.write(garbage.data(), std::streamsize(garbage.size()));
  }
  LoaderOptions options;
  options.batch_size = 4;
  DataLoader loader(ctx, path, options);  // validation reads labels only: this succeeds
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      loader.next();
      ADD_FAILURE() << "a corrupt chunk was read without error";
    } catch (const Error& error) {
      const std::string what = error.what();
      EXPECT_EQ(error.library(), "HDF5") << what;
      EXPECT_NE(what.find("data loader for " + path), std::string::npos) << what;
      EXPECT_NE(what.find("epoch 0, step 0"), std::string::npos) << what;
    }
  }
}

TEST(Loader, ResumesAtStartEpochAndStep) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string path = dir.file("images.h5");
  write_classification(path, random_classification(rng, 50, 1, 3, 3, 4));
  LoaderOptions options;
  options.batch_size = 6;
  options.seed = rng();
  DataLoader fresh(ctx, path, options);
  io::Batch expected;
  do expected = fresh.next();
  while (!(expected.epoch == 1 && expected.step_in_epoch == 2));
  options.start_epoch = 1;
  options.start_step = 2;
  DataLoader resumed(ctx, path, options);
  const io::Batch first = resumed.next();
  EXPECT_EQ(first.epoch, 1);
  EXPECT_EQ(first.step_in_epoch, 2);
  EXPECT_EQ(first.inputs.to_vector<float>(), expected.inputs.to_vector<float>());
  EXPECT_EQ(first.targets.to_vector<int32_t>(), expected.targets.to_vector<int32_t>());
}

TEST(Loader, OptionErrorsNameTheProblem) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  Context ctx;
  const std::string images = dir.file("images.h5"), tokens = dir.file("tokens.h5");
  write_classification(images, random_classification(rng, 10, 1, 2, 2, 2));
  write_tokens(tokens, random_tokens(rng, 100, 256), H5T_STD_U8LE, 256);
  auto expect_refused = [&](const std::string& path, LoaderOptions options, const std::vector<std::string>& parts) {
    expect_error([&] { DataLoader loader(ctx, path, options); }, parts);
  };
  LoaderOptions options;
  options.batch_size = 4;
  options.seq_length = 8;
  LoaderOptions bad = options;
  bad.batch_size = 0;
  expect_refused(images, bad, {"batch size is 0"});
  bad = options;
  bad.shard_rank = 2;
  bad.shard_count = 2;
  expect_refused(images, bad, {"shard 2 of 2"});
  bad = options;
  bad.batch_size = 11;
  expect_refused(images, bad, {images, "holds 10 samples", "fewer than one global batch of 11"});
  bad = options;
  bad.input_dtype = DType::i32;
  expect_refused(images, bad, {"input dtype i32"});
  bad = options;
  bad.seq_length = 100;
  expect_refused(tokens, bad, {tokens, "sequence length 100", "[1, 99]"});
  bad = options;
  bad.batch_size = 13;
  expect_refused(tokens, bad, {tokens, "holds 100 tokens", "fewer than one global batch"});
  bad = options;
  bad.start_step = 2;  // 10 samples / 4 = 2 steps
  expect_refused(images, bad, {"start step 2"});
  expect_refused(dir.file("absent.h5"), options, {"absent.h5", "does not exist"});
  if (!gpu_available(ctx)) {
    bad = options;
    bad.device = Device::cuda(0);
    expect_refused(images, bad, {"cuda:0"});
  }
}

TEST(Loader, GpuDeliversToTheDevice) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  auto rng = make_rng();
  TempDir dir;
  const std::string path = dir.file("images.h5");
  const ClassificationFile data = random_classification(rng, 40, 1, 5, 5, 3);
  write_classification(path, data);
  LoaderOptions options;
  options.batch_size = 8;
  options.seed = rng();
  options.input_dtype = DType::bf16;
  options.device = Device::cuda(0);
  DataLoader loader(ctx, path, options);
  for (int64_t step = 0; step < 3; ++step) {
    const io::Batch batch = loader.next();
    EXPECT_EQ(batch.inputs.device(), Device::cuda(0));
    EXPECT_EQ(batch.targets.device(), Device::cuda(0));
    expect_classification_batch(batch, data, loader.batch_indices(0, step), DType::bf16);
  }
}

// The worker thread allocates pinned memory and copies on the device, so it
// binds to the rank's device first. In a process that uses emu:1 only (rank 1
// of a node), a worker that did not would run on device 0: on a GPU that
// creates a context on GPU 0 for every rank; the emulated runtime refuses it,
// so this test fails without the binding. Batches arrive whole through the
// copy stream, in every input dtype, over more steps than the prefetch depth
// (pinned buffers are reused only after their copies finish).
TEST(Loader, DeliveryToADeviceBindsTheWorkerThreadAndKeepsTheBatches) {
  TESSERA_SEED_TRACE();
  emulated::reset_for_tests();
  const Device device = Device::emulated(1);
  bind_thread_to_device(device);
  {
    Context ctx;
    auto rng = make_rng();
    TempDir dir;
    const std::string images = dir.file("images.h5"), tokens = dir.file("tokens.h5");
    const ClassificationFile data = random_classification(rng, 64, 1, 5, 5, 3);
    write_classification(images, data);
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)));
      LoaderOptions options;
      options.batch_size = 8;
      options.seed = rng();
      options.input_dtype = dtype;
      options.device = device;
      options.prefetch = 2;
      DataLoader loader(ctx, images, options);
      for (int64_t step = 0; step < 6; ++step) {
        const io::Batch batch = loader.next();
        EXPECT_EQ(batch.inputs.device(), device);
        EXPECT_EQ(batch.targets.device(), device);
        expect_classification_batch(batch, data, loader.batch_indices(0, step), dtype);
      }
    }
    write_tokens(tokens, random_tokens(rng, 500, 50), H5T_STD_I32LE, 50);
    LoaderOptions options;
    options.batch_size = 3;
    options.seq_length = 9;
    options.seed = rng();
    LoaderOptions on_device = options;
    on_device.device = device;
    DataLoader host(ctx, tokens, options), delivered(ctx, tokens, on_device);
    for (int step = 0; step < 5; ++step) {
      const io::Batch a = host.next(), b = delivered.next();
      EXPECT_EQ(b.inputs.device(), device);
      EXPECT_EQ(a.inputs.to_vector<int32_t>(), b.inputs.to_vector<int32_t>());
      EXPECT_EQ(a.targets.to_vector<int32_t>(), b.targets.to_vector<int32_t>());
    }
  }
  emulated::reset_for_tests();
}

}  // namespace
}  // namespace tessera::testing
