// HDF5 from several threads. The data loader's worker reads batches while the
// main thread and --async-save's writer thread write checkpoints; a build of
// HDF5 with --enable-threadsafe (Debian's) takes a global lock in every call,
// but a cluster's (often the MPI build, which cannot be thread-safe) may have
// none, and then two threads in HDF5 at once corrupt its state. So Tessera
// asks the library at start-up (H5is_library_threadsafe) and, where it is not
// thread-safe, takes a process-wide lock of its own around each of its HDF5
// calls (Hdf5Serial, taken by TESSERA_HDF5_CHECK and at every other call site
// in io/): what the thread-safe build does, at the same granularity, so the
// loader still waits at most one 8 MiB slab of a checkpoint write. The lock
// is process-wide because the library's state is. No hdf5.h here: apps/ and
// tests include this.
#pragma once

#include <string>

namespace tessera::io {

// Whether the linked HDF5 was built thread-safe (H5is_library_threadsafe).
bool hdf5_library_threadsafe();

// The start-up decision, given the library's answer: serialise Tessera's
// HDF5 calls exactly when the library is not thread-safe. Returns what a log
// should say then ("" when the library is thread-safe).
std::string set_up_hdf5_threading(bool library_threadsafe);

// Turns serialisation on or off (set_up_hdf5_threading's switch; tests force
// it). While on, HDF5's automatic printing of error stacks is off for good:
// a non-thread-safe library keeps one printing switch for every thread, which
// scoped silencers (Hdf5QuietErrors) on two threads would leave in either
// state; the stacks still reach every error Tessera throws.
void serialise_hdf5_calls(bool on);
bool hdf5_calls_serialised();

// Holds the process-wide HDF5 lock for its lifetime while serialisation is
// on; nothing otherwise. Recursive: a guarded helper may call another.
class Hdf5Serial {
 public:
  Hdf5Serial();
  ~Hdf5Serial();
  Hdf5Serial(const Hdf5Serial&) = delete;
  Hdf5Serial& operator=(const Hdf5Serial&) = delete;

 private:
  bool locked_ = false;
};

// Threads waiting for the HDF5 lock now (for tests: a thread that reached an
// HDF5 call while another held the lock).
int hdf5_serial_waiters();

}  // namespace tessera::io
