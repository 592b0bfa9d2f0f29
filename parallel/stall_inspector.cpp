// StallInspector (parallel/stall_inspector.h): one MPI window per root
// communicator holding each rank's heartbeat and per-communicator
// [sequence, kind] slots, written locally and read remotely with bounded waits.
#include "parallel/stall_inspector.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <iomanip>
#include <sstream>
#include <thread>
#include <vector>

namespace tessera::parallel {
namespace {

// Operation kinds as small codes (the window holds integers).
constexpr const char* kKinds[] = {"(none)", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                  "send",   "recv",       "send_recv",      "barrier",    "split"};
constexpr int kHeader = 4;  // heartbeat, activity, activity step, activity since
constexpr int kPartSize = kHeader + 2 * StallInspector::kSlots;
constexpr int64_t kWritingCheckpoint = 1;  // RankActivity::writing_checkpoint

int64_t kind_code(const char* kind) {
  for (int64_t i = 1; i < int64_t(std::size(kKinds)); ++i)
    if (std::strcmp(kKinds[i], kind) == 0) return i;
  return 0;
}

const char* kind_name(int64_t code) {
  return code >= 0 && code < int64_t(std::size(kKinds)) ? kKinds[code] : "(unknown)";
}

// One clock for every process of a node (and good enough across nodes for "seconds ago").
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

StallInspector::StallInspector(MPI_Comm root) : root_(root) {
  void* base = nullptr;
  // No shared-memory segment: Open MPI's osc/rdma names its segments per
  // window and node, and concurrent jobs' or windows' names can collide.
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shm", "false");
  const int made =
      MPI_Win_allocate(MPI_Aint(kPartSize * sizeof(int64_t)), int(sizeof(int64_t)), info, root_, &base, &window_);
  MPI_Info_free(&info);
  if (made != MPI_SUCCESS) {
    window_ = MPI_WIN_NULL;  // no RMA: the inspector stays off
    return;
  }
  MPI_Win_set_errhandler(window_, MPI_ERRORS_RETURN);
  part_ = static_cast<int64_t*>(base);
  for (int i = 0; i < kPartSize; ++i) part_[i] = 0;
  part_[0] = now_ns();
  if (MPI_Win_lock_all(MPI_MODE_NOCHECK, window_) != MPI_SUCCESS) {
    MPI_Win_free(&window_);
    window_ = MPI_WIN_NULL;
    part_ = nullptr;
  }
}

StallInspector::~StallInspector() {
  if (window_ == MPI_WIN_NULL) return;
  int finalised = 0;
  MPI_Finalized(&finalised);
  // MPI_Win_free is collective: not while an error unwinds this rank alone
  // (the job is about to be aborted; the window goes with the process).
  if (finalised || std::uncaught_exceptions() > 0) return;
  MPI_Win_unlock_all(window_);
  MPI_Win_free(&window_);
}

int StallInspector::add_group() {
  return next_slot_ < kSlots ? next_slot_++ : -1;
}

void StallInspector::publish(int slot, uint64_t sequence, const char* kind) {
  if (!part_ || slot < 0) return;
  part_[0] = now_ns();
  part_[kHeader + 2 * slot] = int64_t(sequence);
  part_[kHeader + 1 + 2 * slot] = kind_code(kind);
  MPI_Win_sync(window_);
}

void StallInspector::heartbeat() {
  if (!part_) return;
  part_[0] = now_ns();
  MPI_Win_sync(window_);
}

void StallInspector::set_activity(int64_t activity, int64_t step) {
  if (!part_) return;
  part_[0] = now_ns();
  part_[1] = activity;
  part_[2] = step;
  part_[3] = part_[0];
  MPI_Win_sync(window_);
}

std::string StallInspector::report(int slot, MPI_Comm comm, uint64_t sequence, double patience_s,
                                   double stalled_after_s) const {
  std::ostringstream out;
  if (!enabled() || slot < 0) {
    out << "  (which ranks arrived is unknown: "
        << (enabled() ? "more communicators than the stall inspector has slots" : "this MPI has no RMA windows")
        << ")\n";
    return out.str();
  }
  int size = 0, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  // The members' ranks in the root (where their window parts are) and in the world (what the job's output shows).
  std::vector<int> members(static_cast<size_t>(size)), in_root(static_cast<size_t>(size)),
      in_world(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) members[size_t(r)] = r;
  MPI_Group group = MPI_GROUP_NULL, root_group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(root_, &root_group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_translate_ranks(group, size, members.data(), root_group, in_root.data());
  MPI_Group_translate_ranks(group, size, members.data(), world_group, in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&root_group);
  MPI_Group_free(&world_group);

  const int64_t now = now_ns();
  for (int r = 0; r < size; ++r) {
    out << "  rank " << r << " (world rank " << in_world[size_t(r)] << "): ";
    int64_t header[kHeader] = {}, entry[2] = {0, 0};
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    bool answered = false;
    const int target = in_root[size_t(r)];
    if (MPI_Rget(header, kHeader, MPI_INT64_T, target, 0, kHeader, MPI_INT64_T, window_, &requests[0]) == MPI_SUCCESS &&
        MPI_Rget(entry, 2, MPI_INT64_T, target, MPI_Aint(kHeader + 2 * slot), 2, MPI_INT64_T, window_, &requests[1]) ==
            MPI_SUCCESS) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(patience_s);
      int done = 0;
      while (!done && std::chrono::steady_clock::now() < deadline) {
        if (MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
        if (!done) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      answered = done != 0;
    }
    if (!answered) {
      out << "did not answer within " << patience_s << " s (not making MPI progress: busy, hung or dead)\n";
      continue;
    }
    if (entry[0] >= int64_t(sequence))
      out << "reached it (last started operation " << entry[0] << ", " << kind_name(entry[1]) << ")";
    else
      out << "has NOT reached it: last started operation " << entry[0] << " (" << kind_name(entry[1]) << ")";
    const double idle = double(now - header[0]) * 1e-9;
    out << "; last active in MPI " << std::fixed << std::setprecision(1) << idle << " s ago";
    if (header[1] == kWritingCheckpoint)
      out << "; writing checkpoint step " << header[2] << " for " << double(now - header[3]) * 1e-9
          << " s  <- WRITING A CHECKPOINT (--save-timeout)";
    else if (idle > stalled_after_s)
      out << "  <- STALLED";
    out << (r == rank ? "  (this rank)" : "") << "\n";
    out.unsetf(std::ios::fixed);
  }
  return out.str();
}

}  // namespace tessera::parallel
