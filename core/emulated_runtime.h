// The emulated accelerator's runtime ("emu:N" devices, core/device.h): a
// DeviceRuntime on host memory that keeps the rules a GPU imposes, so the CPU
// tests exercise the code GPU runs take and fail where a GPU run would.
//
//   - Memory: device allocations, pinned host memory and copies are host
//     memory and memcpy, but only through this runtime. Freeing pinned
//     memory waits for every stream's queued work, as cudaFreeHost does.
//   - Streams: kernels run inline (they are the CPU backend's), so a stream
//     holds only the work a communication channel enqueues on it
//     (enqueue_work(): an MPI request, say). Events record the unfinished work
//     of their stream; querying, synchronising or making a stream wait on an
//     event makes progress on it. Progress is made only on the thread that
//     enqueued the work (MPI is FUNNELED); other threads (a watchdog) see the
//     last answer.
//   - Threads: like CUDA, each thread has a current device (0 until it
//     chooses one) and every runtime call uses the current device's context.
//     A call from a thread whose current device is one this process has not
//     chosen (set_device, or a stream, event or allocation made on it) is the
//     bug that makes every rank of a GPU node create a context on GPU 0; here
//     it throws, naming the call.
//   - Faults: inject_fault() makes a device fail as a kernel fault does: every
//     later call about it throws the same sticky error.
//
// State is process-wide, as a driver's is; it lives in this file only.
#pragma once

#include <functional>
#include <string>

#include "core/device_runtime.h"

namespace tessera::emulated {

inline constexpr int kDeviceCount = 8;
inline constexpr const char* kLibrary = "emulated device";

DeviceRuntime& runtime();

// Work on `stream` (an emu stream handle): `poll` makes progress and returns
// whether the work has finished; called only on this thread. Events recorded
// on the stream afterwards cover it.
void enqueue_work(void* stream, std::function<bool()> poll);
// Drops the unfinished work of `stream` (an aborted communicator): events that
// cover it count it as finished, and nothing polls it again.
void abandon_work(void* stream) noexcept;
// Work of `stream` not yet seen finished.
size_t pending_work(void* stream);

// From now on every runtime call about `device` throws `what` (a sticky
// asynchronous error, as after a kernel's illegal memory access).
void inject_fault(int device, const std::string& what);

// For tests that check the per-thread rules: forget which devices this process
// has chosen and every injected fault, as a fresh process would start.
void reset_for_tests();

}  // namespace tessera::emulated
