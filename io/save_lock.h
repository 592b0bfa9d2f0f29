// SaveDirectoryLock: one job at a time writes checkpoints to a --save
// directory. Two jobs writing one directory remove each other's half-written
// checkpoints and race on `latest`; the second is refused at its start instead,
// told which job holds the directory.
//
// The writer (world rank 0) holds an open-file-description lock (fcntl
// F_OFD_SETLK: kernel-released whenever the process ends, however it ends;
// it works on local filesystems and NFS) on DIR/.tessera-save.lock for its
// whole run, and writes into that file who holds it: host, pid, start time
// and the scheduler's job id when there is one. A lock left by a job that
// ended is free again: the file alone means nothing.
#pragma once

#include <string>

namespace tessera::io {

inline constexpr const char* kSaveLockFile = ".tessera-save.lock";

class SaveDirectoryLock {
 public:
  // Takes the lock of `dir` (which must exist), or throws tessera::Error
  // naming the directory, the job that holds it and what to do.
  explicit SaveDirectoryLock(const std::string& dir);
  ~SaveDirectoryLock();  // releases the lock (the file stays)
  SaveDirectoryLock(const SaveDirectoryLock&) = delete;
  SaveDirectoryLock& operator=(const SaveDirectoryLock&) = delete;

  // Whether the directory's lock file is still the one this object holds:
  // false once the directory (or the file) was removed or replaced during
  // the run, when the lock no longer keeps another job out.
  bool still_in_place() const;
  // After !still_in_place(): makes the directory again if it is gone and
  // takes its lock anew, or throws (as the constructor) when another job
  // holds it now.
  void take_again();

 private:
  void take();

  std::string dir_;
  int fd_ = -1;
};

}  // namespace tessera::io
