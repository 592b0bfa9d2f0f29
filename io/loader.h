// DataLoader: batches from a Tessera HDF5 dataset (io/dataset.h), read on a
// background thread up to `prefetch` batches ahead of the training step.
//
// Which samples a batch holds is a pure function of (seed, epoch, step,
// shard), never of thread timing, so runs are reproducible and resumable
// (start_epoch/start_step):
//   - each step draws one global batch of G = batch_size * shard_count
//     consecutive positions of the epoch's sequence; rank r takes positions
//     [r*B, (r+1)*B) of it. A global batch is the same whatever the shard
//     count, so dp=K sees at each step exactly the samples dp=1 sees with
//     K times the batch;
//   - classification: the sequence is a permutation of all N samples drawn
//     from (seed, epoch) by Fisher-Yates on Philox (shuffle), or 0..N-1
//     (no shuffle). drop_last drops the last partial global batch; without
//     it, the last step splits the R remaining samples evenly over the ranks
//     (rank r gets [floor(r*R/S), floor((r+1)*R/S))), so every rank runs the
//     same number of steps and all ranks together see every sample once;
//   - tokens (shuffle): sample i of an epoch is the T+1-token window at an
//     offset drawn uniformly in [0, n-T-1] from (seed, epoch, i); an epoch is
//     floor(n / (G*T)) steps. Without shuffle: consecutive non-overlapping
//     windows (inputs tokens[w*T, (w+1)*T), targets one token later), w in
//     [0, floor((n-1)/T)), batched like classification.
//
// Batches: classification inputs [B, C, H, W] in input_dtype (pixel / 255),
// targets [B] int32; tokens inputs and targets [B, T] int32, targets[b, t] =
// inputs[b, t+1] within the window. They are assembled in host memory (pinned
// when `device` is an accelerator) and, for an accelerator, copied there by
// the background thread on a copy stream of the loader's own, ordered after
// the compute stream's queued work; next() makes the compute stream wait for
// the copy (the host does not), so the copy of batch k+1 overlaps step k. The
// thread binds to `device` before it touches it (core/device_runtime.h).
//
// A reader error ends the background thread and is rethrown by next() (and
// every later call), naming the file. The destructor stops and joins the
// thread, also mid-epoch. A loader must not outlive its Context.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "io/dataset.h"

namespace tessera::io {

struct LoaderOptions {
  int64_t batch_size = 0;  // samples per batch on this rank (B)
  uint64_t seed = 0;
  bool shuffle = true;                      // false: in order (evaluation)
  bool drop_last = true;                    // false: keep the last partial batch (evaluation)
  int64_t shard_rank = 0, shard_count = 1;  // data-parallel rank and world size
  Device device = Device::cpu();            // where next() delivers batches
  DType input_dtype = DType::f32;           // classification inputs: f32, bf16 or f16
  int64_t seq_length = 0;                   // tokens: T
  // Context parallelism: each sample's tokens (inputs and targets) at these
  // positions of its T, in this order (a rank's zigzag share); empty: all T.
  std::vector<int64_t> token_positions;
  int prefetch = 2;                         // batches prepared ahead (>= 1)
  int64_t start_epoch = 0, start_step = 0;  // where the first next() starts (resuming a run)
};

struct Batch {
  Tensor inputs;   // [B, C, H, W] input_dtype, or [B, T] int32
  Tensor targets;  // [B] int32, or [B, T] int32
  int64_t epoch = 0;
  int64_t step_in_epoch = 0;
};

class DataLoader {
 public:
  DataLoader(Context& ctx, const std::string& path, LoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch in (epoch, step) order; epochs follow each other forever.
  Batch next();

  int64_t batches_per_epoch() const;
  const DatasetInfo& info() const;
  const LoaderOptions& options() const;

  // What batch (epoch, step) holds on this rank, without reading data:
  // sample indices (classification) or window start offsets (tokens).
  std::vector<int64_t> batch_indices(int64_t epoch, int64_t step) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tessera::io
