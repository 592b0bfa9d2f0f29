// io/hdf5_threads.h: the start-up decision, the switch, and the process-wide
// recursive lock that Hdf5Serial takes while the switch is on.
#include "io/hdf5_threads.h"

#include <hdf5.h>

#include <atomic>
#include <mutex>

#include "io/hdf5_version.h"

namespace tessera::io {
namespace {

// Process-wide, as the library's own state is.
std::recursive_mutex& hdf5_lock() {
  static std::recursive_mutex lock;
  return lock;
}
std::atomic<bool> serialised{false};
std::atomic<int> waiters{0};

}  // namespace

bool hdf5_library_threadsafe() {
  hbool_t threadsafe = 0;
  return H5is_library_threadsafe(&threadsafe) >= 0 && threadsafe;
}

std::string set_up_hdf5_threading(bool library_threadsafe) {
  serialise_hdf5_calls(!library_threadsafe);
  if (library_threadsafe) return "";
  return hdf5_library_version() +
         " was built without thread safety: Tessera serialises its HDF5 calls, so the data loader's reads and "
         "--async-save's writes take turns (a slab of at most 8 MiB at a time)";
}

void serialise_hdf5_calls(bool on) {
  if (on) {
    serialised.store(true);
    const Hdf5Serial serial;
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return;
  }
  serialised.store(false);
}

bool hdf5_calls_serialised() {
  return serialised.load();
}

Hdf5Serial::Hdf5Serial() {
  if (!serialised.load(std::memory_order_acquire)) return;
  if (!hdf5_lock().try_lock()) {
    waiters.fetch_add(1);
    hdf5_lock().lock();
    waiters.fetch_sub(1);
  }
  locked_ = true;
}

Hdf5Serial::~Hdf5Serial() {
  if (locked_) hdf5_lock().unlock();
}

int hdf5_serial_waiters() {
  return waiters.load();
}

}  // namespace tessera::io
