// Checkpoint directories on disk (io/checkpoint_internal.h): names, POSIX
// durability (fsync, atomic rename), publishing a save, keep-K retention and
// `latest`, free space, the advice when one is corrupt, and the public
// check_save_directory, find_latest_checkpoint, resolve_checkpoint,
// is_checkpoint and list_checkpoints.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "core/error.h"
#include "core/units.h"
#include "io/checkpoint_internal.h"

namespace tessera::io {
namespace checkpoint_detail {

// ---------------------------------------------------------------------------
// Names of directories.

std::string step_directory_name(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

std::optional<int64_t> parse_digits(std::string_view digits) {
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

// The step of a directory named "step_<digits>".
std::optional<int64_t> parse_step_name(std::string_view name) {
  if (!name.starts_with("step_")) return std::nullopt;
  return parse_digits(name.substr(5));
}

// A save's temporary directory: ".step_<anything>.tmp".
std::string temporary_directory_name(int64_t step) {
  char name[48];
  std::snprintf(name, sizeof name, ".step_%08lld.tmp", static_cast<long long>(step));
  return name;
}

bool is_temporary_name(std::string_view name) {
  return name.starts_with(".step_") && name.ends_with(".tmp");
}

// The published checkpoints of `dir` (step_* directories holding the file), oldest first.
std::vector<StepDirectory> list_step_directories(const fs::path& dir) {
  std::vector<StepDirectory> found;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    const auto step = parse_step_name(name);
    std::error_code ignored;
    if (step && it->is_directory(ignored) && fs::exists(it->path() / kCheckpointFile, ignored))
      found.push_back({*step, it->path()});
  }
  std::sort(found.begin(), found.end(), [](const StepDirectory& a, const StepDirectory& b) {
    return a.step != b.step ? a.step < b.step : a.path < b.path;
  });
  return found;
}

std::string read_latest_name(const fs::path& dir) {
  std::ifstream in(dir / kLatestFile);
  std::string name;
  if (in) std::getline(in, name);
  while (!name.empty() && (name.back() == '\r' || name.back() == ' ' || name.back() == '\t')) name.pop_back();
  return name;
}

// ---------------------------------------------------------------------------
// POSIX durability helpers; each throws naming the path.

std::string errno_text(int error) {
  return std::error_code(error, std::generic_category()).message();
}

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TESSERA_CHECK(fd >= 0, "cannot open ", path.string(), " to fsync it: ", errno_text(errno));
  const int status = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  TESSERA_CHECK(status == 0, "fsync of ", path.string(), " failed: ", errno_text(error),
                "; check the file system (full? read-only?)");
}

void rename_path(const fs::path& from, const fs::path& to) {
  TESSERA_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from.string(), " to ", to.string(), ": ",
                errno_text(errno));
}

// Writes `text` to `path` atomically: `path`.tmp, fsync, rename, fsync of the directory.
void write_file_atomically(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TESSERA_CHECK(fd >= 0, "cannot create ", temporary.string(), ": ", errno_text(errno));
  const ssize_t written = ::write(fd, text.data(), text.size());
  const int write_error = errno;
  const int synced = ::fsync(fd);
  const int sync_error = errno;
  ::close(fd);
  if (written != ssize_t(text.size()) || synced != 0) ::unlink(temporary.c_str());  // `path` keeps its old text
  TESSERA_CHECK(written == ssize_t(text.size()), "cannot write ", temporary.string(), ": ", errno_text(write_error));
  TESSERA_CHECK(synced == 0, "fsync of ", temporary.string(), " failed: ", errno_text(sync_error));
  rename_path(temporary, path);
  fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path(), true);
}

// Removes `.step_*.tmp` directories left by crashed saves (rank 0, before writing).
void remove_stale_temporaries(const fs::path& dir) {
  std::error_code error;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error))
    if (is_temporary_name(it->path().filename().string())) stale.push_back(it->path());
  for (const fs::path& path : stale) {
    std::error_code removal;
    fs::remove_all(path, removal);
    TESSERA_CHECK(!removal, "cannot remove ", path.string(), " (left by an interrupted save): ", removal.message());
  }
}

// Moves `temporary` to `final_path`; an existing `final_path` (the same step
// saved again) is replaced atomically where the file system can swap.
void publish_directory(const fs::path& temporary, const fs::path& final_path) {
  std::error_code error;
  if (!fs::exists(final_path, error)) {
    rename_path(temporary, final_path);
    return;
  }
  if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(temporary, error);  // now the old checkpoint; a leftover is removed by the next save
    return;
  }
  std::string aside_name = ".";  // (built by appends: GCC 12 misreports `"." + string` under -Wrestrict)
  aside_name += final_path.filename().string();
  aside_name += ".replaced.tmp";
  const fs::path aside = final_path.parent_path() / aside_name;
  fs::remove_all(aside, error);
  rename_path(final_path, aside);
  rename_path(temporary, final_path);
  fs::remove_all(aside, error);
}

// Rank 0, before any rank writes: the save directory created (and its
// parent fsynced when new), leftovers of crashed saves removed, the room for
// `needed` bytes checked, the empty temporary directory created.
void prepare_save_directory(const fs::path& save_dir, const fs::path& temporary, int64_t needed) {
  std::error_code error;
  const bool existed = fs::is_directory(save_dir, error);
  fs::create_directories(save_dir, error);
  TESSERA_CHECK(!error, "cannot create the directory ", save_dir.string(), ": ", error.message());
  if (!existed) fsync_path(save_dir.has_parent_path() ? save_dir.parent_path() : fs::path("."), true);
  remove_stale_temporaries(save_dir);
  // Before writing anything: a checkpoint that cannot fit fails now, with a message saying so.
  TESSERA_CHECK(has_room(save_dir, needed), no_room_message(save_dir, needed, false));
  fs::create_directory(temporary, error);
  TESSERA_CHECK(!error, "cannot create ", temporary.string(), ": ", error.message());
}

std::string publish_checkpoint(const fs::path& save_dir, const fs::path& temporary, const fs::path& final_path,
                               int keep) {
  bool published = false;
  try {
    fsync_path(temporary, true);
    publish_directory(temporary, final_path);
    published = true;
    fsync_path(save_dir, true);
    write_file_atomically(save_dir / kLatestFile, final_path.filename().string() + "\n");
    prune(save_dir, keep, final_path.filename().string());
    return {};
  } catch (const std::exception& error) {
    std::string failure = message_of(error);
    if (published)
      failure += " (" + final_path.string() +
                 " itself is complete, but 'latest' still names the previous checkpoint, which --resume auto uses)";
    return failure;
  }
}

std::string abandon_checkpoint(const fs::path& save_dir, const fs::path& temporary, int64_t needed,
                               std::string failure) {
  std::error_code ignored;
  fs::remove_all(temporary, ignored);
  // A write that ran out of room (more than estimated, or another writer
  // filled the disk) says so first; HDF5's stack follows.
  if (failure.find("No space left on device") != std::string::npos &&
      failure.find("free space there") == std::string::npos)
    failure = no_room_message(save_dir, needed, true) + ". " + failure;
  return failure;
}

// Keeps the newest `keep` checkpoints and the one `latest` names; a
// checkpoint that cannot be removed is reported on stderr (the new one is
// already safe, so this is no reason to fail the save).
void prune(const fs::path& dir, int keep, const std::string& latest) {
  if (keep <= 0) return;
  std::vector<StepDirectory> steps = list_step_directories(dir);
  if (int(steps.size()) <= keep) return;
  for (size_t i = 0; i + size_t(keep) < steps.size(); ++i) {
    if (steps[i].path.filename() == latest) continue;
    std::error_code error;
    fs::remove_all(steps[i].path, error);
    if (error)
      std::fprintf(stderr, "tessera: warning: cannot remove old checkpoint %s (--keep-checkpoints %d): %s\n",
                   steps[i].path.c_str(), keep, error.message().c_str());
  }
}

std::vector<std::string> other_checkpoints(const fs::path& save_dir, const fs::path& except) {
  std::vector<std::string> names;
  for (const StepDirectory& found : list_step_directories(save_dir))
    if (found.path.filename() != except.filename()) names.push_back(found.path.filename().string());
  return names;
}

// What to tell a user whose checkpoint in `directory` is corrupt: the newest
// other checkpoint of the same --save directory, as the flag to resume it.
std::string corrupt_advice(const fs::path& directory) {
  const fs::path save_dir = directory.parent_path();
  const std::vector<std::string> others = other_checkpoints(save_dir, directory);
  if (others.empty())
    return "the checkpoint is corrupt and " + save_dir.string() +
           " holds no other; start afresh (another --save directory, or remove this one)";
  return "the checkpoint is corrupt; resume from an earlier one: --resume " + (save_dir / others.back()).string() +
         " (the files are left as they are)";
}

// A full disk, said so that a user can act: the save directory's
// filesystem, the room it has, what the checkpoint needs, what to do.
// `while_writing`: the write itself ran out of room (the partial checkpoint
// is already removed again); with bytes to spare, files (inodes) or a quota
// ran out.
std::string no_room_message(const fs::path& save_dir, int64_t needed, bool while_writing) {
  std::error_code error;
  const fs::space_info space = fs::space(save_dir, error);
  const std::string free = error ? "an unknown amount" : human_bytes(double(space.available));
  std::string text;
  if (!while_writing)
    text = "the filesystem of " + save_dir.string() + " has " + free + " free, the checkpoint needs about " +
           human_bytes(double(needed));
  else if (!error && space.available >= std::uintmax_t(needed))
    text = "the filesystem of " + save_dir.string() + " has " + free + " free but no room for more files (inodes) " +
           "or a quota is exhausted";
  else
    text = "the filesystem of " + save_dir.string() + " ran out of space while writing the checkpoint (about " +
           human_bytes(double(needed)) + "; " + free + " free without it)";
  return text + "; free space there, keep fewer checkpoints (--keep-checkpoints N), or --save to a larger filesystem";
}

// Whether the save directory's filesystem has room for `needed` bytes
// (true when it cannot tell).
bool has_room(const fs::path& save_dir, int64_t needed) {
  std::error_code error;
  const fs::space_info space = fs::space(save_dir, error);
  return error || space.available >= std::uintmax_t(needed);
}

}  // namespace checkpoint_detail

using namespace checkpoint_detail;

void check_save_directory(const std::string& dir) {
  const std::string fix = "; give --save a directory this rank can create and write (it is checked at the start)";
  TESSERA_CHECK(!dir.empty(), "--save is empty", fix);
  std::error_code error;
  fs::create_directories(dir, error);
  TESSERA_CHECK(!error, "--save ", dir, ": cannot create the directory: ", error.message(), fix);
  TESSERA_CHECK(fs::is_directory(dir, error), "--save ", dir, " is not a directory", fix);
  const fs::path probe = fs::path(dir) / (".tessera-write-test." + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TESSERA_CHECK(fd >= 0, "--save ", dir, ": cannot write in it: ", errno_text(errno), fix);
  const ssize_t written = ::write(fd, "ok\n", 3);
  const int write_error = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  TESSERA_CHECK(written == 3, "--save ", dir, ": cannot write in it: ", errno_text(write_error), fix);
}

// ---------------------------------------------------------------------------
// find_latest_checkpoint

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  const fs::path save_dir(dir);
  std::error_code error;
  if (!fs::is_directory(save_dir, error)) return std::nullopt;
  const std::string latest = read_latest_name(save_dir);
  if (!latest.empty() && parse_step_name(latest) && fs::exists(save_dir / latest / kCheckpointFile, error))
    return (save_dir / latest).string();
  const std::vector<StepDirectory> steps = list_step_directories(save_dir);
  if (steps.empty()) return std::nullopt;
  return steps.back().path.string();
}

std::string resolve_checkpoint(const std::string& path, const std::string& command) {
  std::error_code error;
  TESSERA_CHECK(fs::exists(path, error), command, ": ", path, " does not exist");
  if (!fs::is_directory(path, error) || fs::exists(fs::path(path) / "checkpoint.h5", error)) return path;
  const std::optional<std::string> latest = find_latest_checkpoint(path);
  TESSERA_CHECK(latest.has_value(), command, ": ", path,
                " holds no checkpoint (neither a checkpoint.h5 nor step_* directories)");
  return *latest;
}

bool is_checkpoint(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error))
    return fs::exists(fs::path(path) / kCheckpointFile, error) || find_latest_checkpoint(path).has_value();
  if (!is_hdf5_file(path)) return false;
  Hdf5QuietErrors quiet;
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) return false;
  const Hdf5Handle file = file_handle(id);
  const bool tagged = attribute_exists(file.get(), kFormatAttribute).value_or(false);
  H5Eclear2(H5E_DEFAULT);  // a damaged header's complaint: not a checkpoint this can read either
  return tagged;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> paths;
  for (const StepDirectory& found : list_step_directories(dir)) paths.push_back(found.path.string());
  return paths;
}

}  // namespace tessera::io
