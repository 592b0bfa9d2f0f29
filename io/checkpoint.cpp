// save_checkpoint (see checkpoint.h): the two ways a checkpoint's data is
// written. CheckpointWriters::every_rank (format 2, the default): each rank
// writes what it owns into its own file and rank 0 an index that stitches
// them into whole tensors (io/checkpoint_sharded.cpp). rank_zero (format 1):
// the owners send their pieces to rank 0, which writes every tensor whole
// into one file (here). Both share the phases of io/checkpoint_plan.cpp:
//   1. each rank checks its own pieces and rank-state keys and serialises
//      their descriptors (or its error) into bytes;
//   2. all-gather of those bytes: every rank now knows every piece and every
//      rank's state blobs, and all ranks throw together if any rank reported
//      an error;
//   3. every rank checks, from the same descriptors, that the pieces of each
//      tensor agree on shape and dtype and that the owned pieces cover it
//      exactly once (the same verdict everywhere, no communication);
// then, here (rank_zero):
//   4. data: tensor by tensor in name order, the owners send their pieces to
//      rank 0, which assembles the tensor in host memory (a piece of one run
//      is received in place, others into a buffer then scattered) and writes
//      it (one tensor at a time in memory); then the rank-state blobs. If rank 0
//      fails (disk full, ...), it keeps receiving so nobody blocks;
//   5. rank 0 closes, fsyncs and publishes, then broadcasts the outcome;
//      every rank returns the path or throws rank 0's error.
#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <utility>

#include "core/context.h"
#include "io/checkpoint_internal.h"

namespace tessera::io {

using namespace checkpoint_detail;

namespace {

// Phase 4 on a rank other than 0: what it owns of each tensor to rank 0 (host copies: the host channel of a
// device-routed communicator whatever device the pieces live on, parallel/process_group.h).
void send_to_writer(parallel::Communicator& world, const std::vector<TensorPlan>& plans,
                    const std::vector<TensorPiece>& pieces, int64_t step) {
  const int rank = world.rank();
  const size_t crash_after = plans.size() / 2;  // the fault point: after this tensor (or before closing when none)
  for (size_t t = 0; t < plans.size(); ++t) {
    for (const PieceInfo* piece : plans[t].owned)
      if (piece->rank == rank && piece->local.numel() > 0)
        world.send(pieces[size_t(piece->index)].local.to(Device::cpu()), 0)->wait();
    if (t == crash_after) crash_if_due(step, rank, [&world] { world.heartbeat(); });
  }
  if (plans.empty()) crash_if_due(step, rank, [&world] { world.heartbeat(); });
}

// Rank 0's side of phases 4 and 5. After its first error it only receives
// (so no rank blocks), and the error is what every rank reports.
class RankZeroSave {
 public:
  RankZeroSave(parallel::Communicator& world, Context& scratch, const std::string& what)
      : world_(world), scratch_(scratch), what_(what) {}

  // The save directory (created, stale temporaries removed, room checked)
  // and the temporary checkpoint directory the writer fills.
  void open(const fs::path& save_dir, const fs::path& temporary, int64_t needed, int64_t step,
            const CheckpointMetadata& metadata) {
    attempt([&] {
      prepare_save_directory(save_dir, temporary, needed);
      writer_.emplace(temporary, step, world_.size(), metadata, 1);
    });
  }

  // One logical tensor: the other ranks' pieces received (straight into
  // place when they are one run, else into a buffer scattered afterwards),
  // rank 0's own copied, the whole written.
  void write_tensor(const TensorPlan& plan, const std::vector<TensorPiece>& pieces) {
    const size_t element_size = dtype_size(plan.dtype);
    Tensor whole;
    if (ok()) attempt([&] { whole = scratch_.empty(Shape{plan.shape.numel()}, plan.dtype); });
    struct Incoming {
      std::vector<Run> runs;
      Tensor buffer;
    };
    std::vector<Incoming> incoming;
    std::vector<parallel::CommHandle> receives;
    for (const PieceInfo* piece : plan.owned) {
      PieceLayout layout = piece_layout(plan.name, plan.shape, piece->slice, piece->local, what_);
      if (layout.numel == 0) continue;
      if (piece->rank != 0) {
        const Run& first = layout.runs.front();
        Tensor buffer = whole.defined() && layout.contiguous() ? whole.slice(first.global, first.global + first.count)
                                                               : scratch_.empty(Shape{layout.numel}, plan.dtype);
        receives.push_back(world_.recv(buffer, piece->rank));
        incoming.push_back({std::move(layout.runs), buffer});
      } else if (whole.defined()) {
        attempt([&] {
          Tensor staging;
          const std::byte* bytes = host_bytes(pieces[size_t(piece->index)].local, staging);
          scatter_runs(layout.runs, element_size, bytes, static_cast<std::byte*>(whole.data_ptr()));
        });
      }
    }
    for (auto& handle : receives) handle->wait();
    if (!ok() || !whole.defined()) return;
    attempt([&] {
      for (Incoming& in : incoming)
        if (!in.buffer.shares_storage_with(whole))
          scatter_runs(in.runs, element_size, static_cast<const std::byte*>(in.buffer.data_ptr()),
                       static_cast<std::byte*>(whole.data_ptr()));
      writer_->write_tensor(plan, whole.data_ptr());
    });
  }

  // Rank state: every rank's blobs (they came with the descriptors), in rank and key order.
  void write_rank_states(const std::vector<RankInfo>& all) {
    for (int r = 0; r < world_.size(); ++r)
      for (const auto& [key, bytes] : all[size_t(r)].states) {
        const std::string& name = key;  // clang before 16 cannot capture a structured binding
        const std::vector<uint8_t>& blob = bytes;
        if (ok()) attempt([&] { writer_->write_rank_state(r, name, blob); });
      }
  }

  // The file closed and the temporary directory published (checkpoint_files.cpp);
  // on a failure the temporary is removed and the previous checkpoint and `latest` untouched.
  void publish(const fs::path& save_dir, const fs::path& temporary, const fs::path& final_path, int keep,
               int64_t needed) {
    if (ok())
      attempt([&] {
        writer_->close();
        writer_.reset();
      });
    if (ok()) failure_ = publish_checkpoint(save_dir, temporary, final_path, keep);
    if (ok()) return;
    writer_.reset();
    failure_ = abandon_checkpoint(save_dir, temporary, needed, failure_);
  }

  bool ok() const { return failure_.empty(); }
  const std::string& failure() const { return failure_; }

 private:
  // Runs `step`, keeping the first error instead of throwing it.
  template <typename Step>
  void attempt(Step&& step) {
    try {
      step();
    } catch (const std::exception& error) {
      if (failure_.empty()) failure_ = message_of(error);
    }
  }

  parallel::Communicator& world_;
  Context& scratch_;
  const std::string& what_;
  std::optional<CheckpointWriter> writer_;
  std::string failure_;
};

}  // namespace

namespace checkpoint_detail {

std::string save_gathered(parallel::Communicator& world, Context& scratch, const SaveJob& job,
                          const std::vector<TensorPiece>& pieces) {
  const int rank = world.rank();
  if (rank != 0) {
    send_to_writer(world, job.plans, pieces, job.step);
    const std::string failure = broadcast_outcome(world, scratch, {});
    TESSERA_CHECK(failure.empty(), job.what, " failed on rank 0 (the writer): ", failure);
    return job.final_path.string();
  }
  RankZeroSave save(world, scratch, job.what);
  save.open(job.save_dir, job.temporary, job.needed, job.step, job.metadata);
  const size_t crash_after = job.plans.size() / 2;  // the same fault point as the other ranks'
  const WriteProgress progress = [&world] { world.heartbeat(); };  // a sign of life between tensors
  for (size_t t = 0; t < job.plans.size(); ++t) {
    save.write_tensor(job.plans[t], pieces);
    progress();
    if (t == crash_after) crash_if_due(job.step, rank, progress);
  }
  if (job.plans.empty()) crash_if_due(job.step, rank, progress);
  save.write_rank_states(job.all);
  save.publish(job.save_dir, job.temporary, job.final_path, job.keep, job.needed);
  broadcast_outcome(world, scratch, save.failure());
  if (!save.ok())
    TESSERA_THROW(job.what, " failed (the previous checkpoint and 'latest' are untouched): ", save.failure());
  return job.final_path.string();
}

}  // namespace checkpoint_detail

}  // namespace tessera::io
