// SaveDirectoryLock: the --save directory's lock file and the description of
// its holder (see save_lock.h).
#include "io/save_lock.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>

#include "core/error.h"

namespace tessera::io {
namespace {

// Who this process is, for the next job that finds the directory taken.
std::string holder_description() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  char started[64] = "?";
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  if (::localtime_r(&now, &local)) std::strftime(started, sizeof started, "%Y-%m-%d %H:%M:%S %Z", &local);
  std::string text = std::string("host ") + host + ", pid " + std::to_string(::getpid()) + ", started " + started;
  for (const char* variable : {"SLURM_JOB_ID", "PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid"}) {
    if (const char* value = std::getenv(variable); value && *value) {
      text += std::string(", ") + variable + "=" + value;
      break;
    }
  }
  return text;
}

std::string read_holder(int fd) {
  std::string text(512, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? size_t(n) : 0);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text.empty() ? std::string("a process that has not written its name yet") : text;
}

}  // namespace

SaveDirectoryLock::SaveDirectoryLock(const std::string& dir) : dir_(dir) {
  take();
}

void SaveDirectoryLock::take() {
  const std::string& dir = dir_;
  const std::string path = (std::filesystem::path(dir) / kSaveLockFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TESSERA_CHECK(fd_ >= 0, "--save ", dir, ": cannot open its lock file ", path, ": ", std::strerror(errno),
                "; give --save a directory this rank can write");
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  if (::fcntl(fd_, F_OFD_SETLK, &lock) != 0) {
    const int error = errno;
    const std::string holder = error == EAGAIN || error == EACCES ? read_holder(fd_) : std::string();
    ::close(fd_);
    fd_ = -1;
    TESSERA_CHECK(!holder.empty(), "--save ", dir, ": cannot lock ", path, ": ", std::strerror(error));
    TESSERA_THROW("--save ", dir, " is in use: another job is writing its checkpoints there (", holder,
                  "). Two jobs writing one directory destroy each other's checkpoints; give this job its own --save "
                  "directory, or wait for (or stop) the other job");
  }
  const std::string holder = holder_description() + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, holder.data(), holder.size(), 0) != ssize_t(holder.size())) {
    // The lock is held all the same; only the description for others is missing.
  }
}

SaveDirectoryLock::~SaveDirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the description releases the lock
}

bool SaveDirectoryLock::still_in_place() const {
  struct stat held {}, there {};
  const std::string path = (std::filesystem::path(dir_) / kSaveLockFile).string();
  return fd_ >= 0 && ::fstat(fd_, &held) == 0 && ::stat(path.c_str(), &there) == 0 && held.st_dev == there.st_dev &&
         held.st_ino == there.st_ino;
}

void SaveDirectoryLock::take_again() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  TESSERA_CHECK(!error, "--save ", dir_, ": cannot make it again: ", error.message());
  take();
}

}  // namespace tessera::io
