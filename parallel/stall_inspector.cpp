// StallInspector (parallel/stall_inspector.h): one MPI window per root
// communicator holding each rank's heartbeat and per-communicator
// [sequence, kind] slots, written locally and read remotely with bounded waits.
#include "parallel/stall_inspector.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <iomanip>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

namespace tessera::parallel {
namespace {

// Operation kinds as small codes (the window holds integers).
constexpr const char* kKinds[] = {"(none)", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                  "send",   "recv",       "send_recv",      "barrier",    "split",
                                  "all_to_all"};
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

namespace {

// The members of `comm` as ranks of `root` (where their window parts are)
// and of the world (what the job's output shows).
struct Members {
  std::vector<int> in_root, in_world;
  int self = 0;
};

Members members_of(MPI_Comm comm, MPI_Comm root) {
  int size = 0;
  Members out;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &out.self);
  std::vector<int> ranks(static_cast<size_t>(size));
  out.in_root.resize(size_t(size));
  out.in_world.resize(size_t(size));
  for (int r = 0; r < size; ++r) ranks[size_t(r)] = r;
  MPI_Group group = MPI_GROUP_NULL, root_group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(root, &root_group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_translate_ranks(group, size, ranks.data(), root_group, out.in_root.data());
  MPI_Group_translate_ranks(group, size, ranks.data(), world_group, out.in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&root_group);
  MPI_Group_free(&world_group);
  return out;
}

// What a rank's part of the window says: its header and its slot's entry.
struct PartView {
  int64_t header[kHeader] = {};
  int64_t entry[2] = {0, 0};  // sequence, kind code
};

// Reads `target`'s part (header, slot `slot`), waiting at most `patience_s`;
// nothing when it does not answer in time.
std::optional<PartView> read_part(MPI_Win window, int target, int slot, double patience_s) {
  PartView view;
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  if (MPI_Rget(view.header, kHeader, MPI_INT64_T, target, 0, kHeader, MPI_INT64_T, window, &requests[0]) !=
          MPI_SUCCESS ||
      MPI_Rget(view.entry, 2, MPI_INT64_T, target, MPI_Aint(kHeader + 2 * slot), 2, MPI_INT64_T, window,
               &requests[1]) != MPI_SUCCESS)
    return std::nullopt;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(patience_s);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    if (MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
    if (!done) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!done) return std::nullopt;
  return view;
}

}  // namespace

std::string StallInspector::report(int slot, MPI_Comm comm, uint64_t sequence, double patience_s,
                                   double stalled_after_s) const {
  std::ostringstream out;
  if (!enabled() || slot < 0) {
    out << "  (which ranks arrived is unknown: "
        << (enabled() ? "more communicators than the stall inspector has slots" : "this MPI has no RMA windows")
        << ")\n";
    return out.str();
  }
  const Members members = members_of(comm, root_);
  const int64_t now = now_ns();
  for (size_t r = 0; r < members.in_root.size(); ++r) {
    out << "  rank " << r << " (world rank " << members.in_world[r] << "): ";
    const std::optional<PartView> part = read_part(window_, members.in_root[r], slot, patience_s);
    if (!part) {
      out << "did not answer within " << patience_s << " s (not making MPI progress: busy, hung or dead)\n";
      continue;
    }
    const int64_t* header = part->header;
    if (part->entry[0] >= int64_t(sequence))
      out << "reached it (last started operation " << part->entry[0] << ", " << kind_name(part->entry[1]) << ")";
    else
      out << "has NOT reached it: last started operation " << part->entry[0] << " (" << kind_name(part->entry[1])
          << ")";
    const double idle = double(now - header[0]) * 1e-9;
    out << "; last active in MPI " << std::fixed << std::setprecision(1) << idle << " s ago";
    if (header[1] == kWritingCheckpoint)
      out << "; writing checkpoint step " << header[2] << " for " << double(now - header[3]) * 1e-9
          << " s  <- WRITING A CHECKPOINT (--save-timeout)";
    else if (idle > stalled_after_s)
      out << "  <- STALLED";
    out << (int(r) == members.self ? "  (this rank)" : "") << "\n";
    out.unsetf(std::ios::fixed);
  }
  return out.str();
}

std::string StallInspector::silent(int slot, MPI_Comm comm, uint64_t sequence, double silence_s,
                                   double patience_s) const {
  if (!enabled() || slot < 0) return {};
  const Members members = members_of(comm, root_);
  const int64_t now = now_ns();
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  for (size_t r = 0; r < members.in_root.size(); ++r) {
    if (int(r) == members.self) continue;
    const std::optional<PartView> part = read_part(window_, members.in_root[r], slot, patience_s);
    // No answer: this MPI reads a busy rank's part only when it calls MPI
    // again (it may be in a long write): not called silent; --save-timeout holds.
    if (!part || part->entry[0] >= int64_t(sequence)) continue;
    const double idle = double(now - part->header[0]) * 1e-9;
    if (idle <= silence_s) continue;  // alive: in communication, or its writer making progress
    out << "  world rank " << members.in_world[r] << ": no sign of life for " << idle << " s";
    if (part->header[1] == kWritingCheckpoint)
      out << ", while writing checkpoint step " << part->header[2] << " (for " << double(now - part->header[3]) * 1e-9
          << " s): its writer has stopped making progress";
    out << "\n";
  }
  return out.str();
}

}  // namespace tessera::parallel
