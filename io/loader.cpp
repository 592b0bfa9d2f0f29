// DataLoader: the batch plan (a pure function of seed, epoch, step and shard)
// and the background thread that reads and assembles batches ahead of use and,
// for an accelerator, copies them there on a stream of its own.
#include "io/loader.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>

#include "core/device_runtime.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/storage.h"

namespace tessera::io {
namespace {

// Philox streams of the loader's draws, apart from those of parameter
// initialisation and dropout that may share the seed.
constexpr uint64_t kPermutationStream = uint64_t(0x5045524d) << 32;  // "PERM" | epoch
constexpr uint64_t kWindowStream = uint64_t(0x57494e44) << 32;       // "WIND" | epoch

// Uniform in [0, bound) from element `index` of a Philox stream. The modulo
// bias is below bound / 2^64: negligible for any dataset size.
uint64_t random_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t bound) {
  const PhiloxOutput bits = philox_bits(seed, stream, index);
  const uint64_t value = uint64_t(bits.v[0]) | uint64_t(bits.v[1]) << 32;
  return value % bound;
}

// A permutation of [0, count) for `epoch`: Fisher-Yates, position i swapped
// with a uniform j in [0, i].
std::vector<int64_t> epoch_permutation(uint64_t seed, int64_t epoch, int64_t count) {
  std::vector<int64_t> order(static_cast<size_t>(count));
  std::iota(order.begin(), order.end(), int64_t(0));
  const uint64_t stream = kPermutationStream | uint64_t(epoch);
  for (int64_t i = count - 1; i > 0; --i) {
    const auto j = int64_t(random_below(seed, stream, uint64_t(i), uint64_t(i) + 1));
    std::swap(order[size_t(i)], order[size_t(j)]);
  }
  return order;
}

// `error` with "what" in front of its message, keeping its library, code and call site.
Error annotated(const Error& error, const std::string& what) {
  return Error(
      ErrorSite{error.library(), error.code(), {}, error.statement(), error.file(), error.line(), error.device()},
      what + error.message());
}

}  // namespace

// How long the worker waits, when it stops, for copies still reading its
// pinned buffers; past it the buffers are left allocated (a device that does
// not drain must not turn into a use-after-free or a hang at exit).
constexpr std::chrono::seconds kCopyDrainTimeout{30};

struct DataLoader::State {
  struct Item {
    Batch batch;
    std::shared_ptr<Event> copied;  // on the copy stream: the batch is on the device (accelerators)
    std::exception_ptr error;
  };
  // Pinned host buffers that a copy may still be reading, until `copied` passes.
  struct InFlight {
    std::shared_ptr<Event> copied;
    Tensor inputs, targets;
  };

  State(Context& context, const std::string& file, LoaderOptions loader_options)
      : ctx(context), path(file), options(loader_options) {}

  Context& ctx;
  std::string path;
  LoaderOptions options;
  std::unique_ptr<ClassificationData> images;  // one of these two
  std::unique_ptr<TokenData> tokens;
  DatasetInfo info;
  int64_t items = 0;                  // positions in one epoch's sequence (samples or windows)
  int64_t full_steps = 0;             // steps with a whole global batch
  int64_t steps = 0;                  // steps per epoch
  std::shared_ptr<Allocator> pinned;  // non-owning view of ctx.pinned_allocator(device) (accelerators)
  std::optional<Stream> copy_stream;  // host-to-device copies, apart from the compute stream (accelerators)

  // Used by the background thread only.
  int64_t permutation_epoch = -1;
  std::vector<int64_t> permutation;
  std::vector<uint8_t> image_bytes;
  std::vector<int32_t> token_ids;
  std::deque<InFlight> in_flight;

  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Item> queue;
  bool stop = false;
  std::exception_ptr error;  // the reader error next() rethrows, once seen
  std::thread worker;

  int64_t global_batch() const { return options.batch_size * options.shard_count; }

  // This rank's positions [begin, end) in the epoch's sequence at `step`.
  std::pair<int64_t, int64_t> positions(int64_t step) const {
    const int64_t batch = options.batch_size, rank = options.shard_rank, shards = options.shard_count;
    if (step < full_steps) return {step * global_batch() + rank * batch, step * global_batch() + (rank + 1) * batch};
    const int64_t base = full_steps * global_batch(), remaining = items - base;
    return {base + rank * remaining / shards, base + (rank + 1) * remaining / shards};
  }

  // Sample indices or window offsets of (epoch, step); `order` is the epoch's
  // permutation when shuffling classification data.
  std::vector<int64_t> indices(int64_t epoch, int64_t step, const std::vector<int64_t>& order) const {
    const auto [begin, end] = positions(step);
    std::vector<int64_t> result(size_t(end - begin));
    for (int64_t position = begin; position < end; ++position) {
      int64_t& value = result[size_t(position - begin)];
      if (images)
        value = options.shuffle ? order[size_t(position)] : position;
      else if (options.shuffle)
        value = int64_t(random_below(options.seed, kWindowStream | uint64_t(epoch), uint64_t(position),
                                     uint64_t(info.num_tokens - options.seq_length)));
      else
        value = position * options.seq_length;
    }
    return result;
  }

  const std::vector<int64_t>& order_for(int64_t epoch) {
    if (images && options.shuffle && permutation_epoch != epoch) {
      permutation = epoch_permutation(options.seed, epoch, items);
      permutation_epoch = epoch;
    }
    return permutation;
  }

  // Host memory for a batch: pinned when it will be copied to a GPU.
  Tensor host_tensor(const Shape& shape, DType dtype) {
    if (!pinned) return ctx.empty(shape, dtype, Device::cpu());
    const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
    return Tensor(std::make_shared<Storage>(ctx, pinned, bytes, nullptr), 0, shape, dtype);
  }

  // Context parallelism: the columns of a token batch at options.token_positions.
  Batch keep_token_positions(Batch batch) {
    const std::vector<int64_t>& keep = options.token_positions;
    if (keep.empty() || batch.inputs.ndim() != 2) return batch;
    const int64_t rows = batch.inputs.size(0), length = batch.inputs.size(1), kept = int64_t(keep.size());
    for (Tensor* part : {&batch.inputs, &batch.targets}) {
      Tensor narrow = host_tensor(Shape{rows, kept}, DType::i32);
      const int32_t* from = part->data<int32_t>();
      int32_t* to = narrow.data<int32_t>();
      for (int64_t row = 0; row < rows; ++row)
        for (int64_t i = 0; i < kept; ++i) to[row * kept + i] = from[row * length + keep[size_t(i)]];
      *part = std::move(narrow);
    }
    return batch;
  }

  Batch make_batch(int64_t epoch, int64_t step) {
    const std::vector<int64_t> chosen = indices(epoch, step, order_for(epoch));
    const auto count = int64_t(chosen.size());
    Batch batch;
    batch.epoch = epoch;
    batch.step_in_epoch = step;
    if (images) {
      image_bytes.resize(size_t(count * info.sample_bytes()));
      images->read_images(chosen, image_bytes.data());
      batch.inputs = host_tensor(Shape{count, info.channels, info.height, info.width}, options.input_dtype);
      dispatch_float(options.input_dtype, "data loader inputs", [&](auto tag) {
        using T = decltype(tag);
        T table[256];
        for (int value = 0; value < 256; ++value) table[value] = from_float<T>(float(value) / 255.0f);
        T* out = batch.inputs.data<T>();
        for (size_t i = 0; i < image_bytes.size(); ++i) out[i] = table[image_bytes[i]];
      });
      batch.targets = host_tensor(Shape{count}, DType::i32);
      int32_t* targets = batch.targets.data<int32_t>();
      const std::span<const int64_t> labels = images->labels();
      for (int64_t i = 0; i < count; ++i) targets[i] = int32_t(labels[size_t(chosen[size_t(i)])]);
      return batch;
    }
    const int64_t length = options.seq_length;
    batch.inputs = host_tensor(Shape{count, length}, DType::i32);
    batch.targets = host_tensor(Shape{count, length}, DType::i32);
    int32_t* inputs = batch.inputs.data<int32_t>();
    int32_t* targets = batch.targets.data<int32_t>();
    if (count == 0) return batch;
    if (!options.shuffle) {  // consecutive windows: one read of count*T + 1 tokens
      token_ids.resize(size_t(count * length + 1));
      tokens->read(chosen[0], count * length + 1, token_ids.data());
      for (int64_t row = 0; row < count; ++row)
        for (int64_t t = 0; t < length; ++t) {
          inputs[row * length + t] = token_ids[size_t(row * length + t)];
          targets[row * length + t] = token_ids[size_t(row * length + t + 1)];
        }
      return batch;
    }
    token_ids.resize(size_t(length + 1));
    for (int64_t row = 0; row < count; ++row) {
      tokens->read(chosen[size_t(row)], length + 1, token_ids.data());
      std::copy(token_ids.begin(), token_ids.end() - 1, inputs + row * length);
      std::copy(token_ids.begin() + 1, token_ids.end(), targets + row * length);
    }
    return batch;
  }

  // Copies a host batch to the device on the copy stream: after the compute
  // stream's queued work (the device memory may have been freed by it just
  // now), returning the event that marks the copy done. The host buffers stay
  // alive until then.
  std::shared_ptr<Event> copy_to_device(Batch& batch) {
    const Device device = options.device;
    const Stream& compute = ctx.compute_stream(device);
    Tensor inputs = ctx.empty(batch.inputs.shape(), batch.inputs.dtype(), device);
    Tensor targets = ctx.empty(batch.targets.shape(), batch.targets.dtype(), device);
    Event ready(device);
    ready.record(compute);
    ready.wait(*copy_stream);
    DeviceRuntime& runtime = device_runtime(device);
    runtime.memcpy_async(inputs.data_ptr(), batch.inputs.data_ptr(), inputs.nbytes(), copy_stream->native_handle());
    runtime.memcpy_async(targets.data_ptr(), batch.targets.data_ptr(), targets.nbytes(), copy_stream->native_handle());
    auto copied = std::make_shared<Event>(device);
    copied->record(*copy_stream);
    in_flight.push_back({copied, std::move(batch.inputs), std::move(batch.targets)});
    batch.inputs = std::move(inputs);
    batch.targets = std::move(targets);
    return copied;
  }

  // Frees the pinned buffers whose copies have finished; with `all`, waits
  // for the rest (bounded, then leaves them allocated).
  void release_copied(bool all) {
    const auto deadline = std::chrono::steady_clock::now() + kCopyDrainTimeout;
    while (!in_flight.empty()) {
      if (in_flight.front().copied->ready()) {
        in_flight.pop_front();
      } else if (!all) {
        return;
      } else if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "tessera: data loader for %s: %zu copies to %s did not finish; leaving their buffers\n",
                     path.c_str(), in_flight.size(), options.device.to_string().c_str());
        abandon_copies();
        return;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  // The worker's last act: wait for its copies, or, when the device has
  // failed (the query throws), leave their buffers; the failure itself
  // reaches the user through the main thread.
  void finish_copies() noexcept {
    try {
      release_copied(true);
    } catch (...) {
      abandon_copies();
    }
  }

  // Deliberately never freed: a copy may still read them.
  void abandon_copies() noexcept {
    new std::deque<InFlight>(std::move(in_flight));
    in_flight.clear();
  }

  Item produce(int64_t epoch, int64_t step) {
    Item item;
    try {
      release_copied(false);
      item.batch = keep_token_positions(make_batch(epoch, step));
      if (options.device.is_accelerator()) item.copied = copy_to_device(item.batch);
    } catch (const Error& failure) {
      item.error =
          std::make_exception_ptr(annotated(failure, "data loader for " + path + " (epoch " + std::to_string(epoch) +
                                                         ", step " + std::to_string(step) + "): "));
    } catch (const std::exception& failure) {
      item.error = std::make_exception_ptr(Error(ErrorSite{"tessera", 0, {}, {}, __FILE__, __LINE__, {}},
                                                 "data loader for " + path + " (epoch " + std::to_string(epoch) +
                                                     ", step " + std::to_string(step) + "): " + failure.what()));
    } catch (...) {
      item.error = std::current_exception();
    }
    return item;
  }

  // The worker thread. It touches the device (pinned memory, copies, events),
  // so it binds to it first: a thread that does not would make the runtime
  // create a context on device 0 (core/device_runtime.h).
  void run() {
    try {
      bind_thread_to_device(options.device);
    } catch (...) {
      std::lock_guard lock(mutex);
      queue.push_back(Item{{}, nullptr, std::current_exception()});
      changed.notify_all();
      return;
    }
    int64_t epoch = options.start_epoch, step = options.start_step;
    while (true) {
      {
        std::unique_lock lock(mutex);
        changed.wait(lock, [&] { return stop || int64_t(queue.size()) < options.prefetch; });
        if (stop) break;
      }
      Item item = produce(epoch, step);
      const bool failed = item.error != nullptr;
      {
        std::lock_guard lock(mutex);
        queue.push_back(std::move(item));
      }
      changed.notify_all();
      if (failed) break;
      if (++step == steps) {
        step = 0;
        ++epoch;
      }
    }
    finish_copies();
  }
};

DataLoader::DataLoader(Context& ctx, const std::string& path, LoaderOptions options)
    : state_(std::make_unique<State>(ctx, path, options)) {
  State& s = *state_;
  TESSERA_CHECK(options.batch_size >= 1, "data loader: batch size is ", options.batch_size, "; it must be at least 1");
  TESSERA_CHECK(options.shard_count >= 1 && options.shard_rank >= 0 && options.shard_rank < options.shard_count,
                "data loader: shard ", options.shard_rank, " of ", options.shard_count,
                " is not a valid data-parallel rank; need 0 <= rank < count");
  TESSERA_CHECK(options.prefetch >= 1, "data loader: prefetch is ", options.prefetch, "; it must be at least 1");
  TESSERA_CHECK(options.start_epoch >= 0 && options.start_epoch < (int64_t(1) << 32), "data loader: start epoch ",
                options.start_epoch, " is out of range");
  if (options.device.is_accelerator()) {
    ctx.compute_stream(options.device);  // throws, naming the device, when it does not exist here
    s.pinned = std::shared_ptr<Allocator>(std::shared_ptr<void>(), &ctx.pinned_allocator(options.device));
    s.copy_stream.emplace(Stream::create(options.device));
  }

  const int64_t global = s.global_batch();
  if (peek_dataset_kind(path) == DatasetKind::classification) {
    TESSERA_CHECK(is_floating(options.input_dtype), "data loader: input dtype ", dtype_name(options.input_dtype),
                  " for images of ", path, "; use f32, bf16 or f16");
    s.images = std::make_unique<ClassificationData>(path);
    s.info = s.images->info();
    s.items = s.info.num_samples;
  } else {
    s.tokens = std::make_unique<TokenData>(path);
    s.info = s.tokens->info();
    const int64_t n = s.info.num_tokens, length = options.seq_length;
    TESSERA_CHECK(length >= 1 && length <= n - 1, "data loader: sequence length ", length, " for ", path,
                  " which holds ", n, " tokens; it must be in [1, ", n - 1, "] (set --seq-length)");
    if (options.shuffle) {
      s.full_steps = n / (global * length);
      TESSERA_CHECK(s.full_steps >= 1, "data loader: ", path, " holds ", n, " tokens, fewer than one global batch of ",
                    options.batch_size, " x ", options.shard_count, " ranks x ", length,
                    " tokens; reduce the batch size or sequence length");
      s.items = s.full_steps * global;
    } else {
      s.items = (n - 1) / length;
    }
  }
  if (!(s.tokens && options.shuffle)) s.full_steps = s.items / global;
  s.steps = options.drop_last || (s.tokens && options.shuffle) ? s.full_steps : (s.items + global - 1) / global;
  TESSERA_CHECK(s.steps >= 1, "data loader: ", path, " holds ", s.items, s.tokens ? " windows" : " samples",
                ", fewer than one global batch of ", global, " (", options.batch_size, " x ", options.shard_count,
                " ranks) with drop_last; reduce the batch size");
  TESSERA_CHECK(options.start_step >= 0 && options.start_step < s.steps, "data loader: start step ", options.start_step,
                " is outside the epoch's ", s.steps, " steps");
  s.worker = std::thread([&s] { s.run(); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->changed.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
}

Batch DataLoader::next() {
  State& s = *state_;
  State::Item item;
  {
    std::unique_lock lock(s.mutex);
    if (s.error) std::rethrow_exception(s.error);
    s.changed.wait(lock, [&] { return !s.queue.empty(); });
    item = std::move(s.queue.front());
    s.queue.pop_front();
    if (item.error) s.error = item.error;
  }
  s.changed.notify_all();
  if (item.error) std::rethrow_exception(item.error);
  // The compute stream waits for the copy; the host does not.
  if (item.copied) item.copied->wait(s.ctx.compute_stream(s.options.device));
  return std::move(item.batch);
}

int64_t DataLoader::batches_per_epoch() const {
  return state_->steps;
}

const DatasetInfo& DataLoader::info() const {
  return state_->info;
}

const LoaderOptions& DataLoader::options() const {
  return state_->options;
}

std::vector<int64_t> DataLoader::batch_indices(int64_t epoch, int64_t step) const {
  const State& s = *state_;
  TESSERA_CHECK(epoch >= 0 && step >= 0 && step < s.steps, "batch_indices: step ", step, " of epoch ", epoch,
                " is outside the epoch's ", s.steps, " steps");
  std::vector<int64_t> order;
  if (s.images && s.options.shuffle) order = epoch_permutation(s.options.seed, epoch, s.items);
  return s.indices(epoch, step, order);
}

}  // namespace tessera::io
