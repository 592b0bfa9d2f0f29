// StallInspector: what every rank is doing, readable by the others without
// their help, so a rank whose collective timed out can say which ranks have
// reached it, which have not, and which have stopped making progress (as
// Horovod's stall inspector does).
//
// One MPI window per root communicator (the world), shared by every
// communicator split from it: each rank's part holds a heartbeat (when it was
// last seen alive in MPI: starting an operation or waiting for one) and, per
// communicator, the sequence number and kind of the operation it last
// started, and what the rank is busy with outside MPI (writing a checkpoint,
// since when). Communicators get their slot in creation order, which is the same
// on every rank. Writes are local stores plus MPI_Win_sync (nothing
// travels); report() reads the other ranks' parts with MPI_Rget under one
// passive-target epoch (MPI_Win_lock_all for the window's life), waiting at
// most `patience` seconds for each, so a report never hangs. Without RMA
// support the inspector is disabled and report() says so.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

namespace tessera::parallel {

class StallInspector {
 public:
  static constexpr int kSlots = 64;  // communicators per root with a slot

  // Collective over `root` (size > 1).
  explicit StallInspector(MPI_Comm root);
  ~StallInspector();  // collective (MPI_Win_free), except while an error unwinds
  StallInspector(const StallInspector&) = delete;
  StallInspector& operator=(const StallInspector&) = delete;

  // A slot for a new communicator (call in the same order on every rank); -1 when full.
  int add_group();
  void publish(int slot, uint64_t sequence, const char* kind);
  void heartbeat();  // this rank is alive now (in MPI, or a checkpoint writer between slabs)
  // What this rank is busy with (RankActivity as an integer, and its step),
  // since now; reports show it next to the rank instead of calling it stalled.
  void set_activity(int64_t activity, int64_t step);
  // One line per rank of `comm` (whose slot is `slot`): whether it has
  // reached operation `sequence`, and when it was last seen alive in MPI
  // (marked STALLED when longer ago than `stalled_after_s`).
  std::string report(int slot, MPI_Comm comm, uint64_t sequence, double patience_s, double stalled_after_s) const;
  // The ranks of `comm` other than this one that have not reached operation
  // `sequence` and show no sign of life: last seen alive (in MPI, or a
  // writer's heartbeat) more than `silence_s` ago, or not answering within
  // `patience_s`. One line each; empty when there is none.
  std::string silent(int slot, MPI_Comm comm, uint64_t sequence, double silence_s, double patience_s) const;
  bool enabled() const { return window_ != MPI_WIN_NULL; }

 private:
  MPI_Comm root_;
  MPI_Win window_ = MPI_WIN_NULL;
  int64_t* part_ = nullptr;  // [heartbeat ns, activity, its step, since ns, then kSlots × (sequence, kind code)]
  int next_slot_ = 0;
};

}  // namespace tessera::parallel
