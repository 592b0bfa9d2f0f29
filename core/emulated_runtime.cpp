// The emulated accelerator's runtime (see core/emulated_runtime.h): streams of
// pending work, events over that work, per-thread current devices with the
// context rule, sticky faults, and host memory behind the device interface.
#include "core/emulated_runtime.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"

namespace tessera::emulated {
namespace {

using Clock = std::chrono::steady_clock;

// One piece of enqueued work. `done` is written by the owner thread and read by any.
struct Work {
  std::function<bool()> poll;
  std::thread::id owner;
  std::atomic<bool> done{false};
};
using WorkList = std::vector<std::shared_ptr<Work>>;

struct EmuStream {
  int device = 0;
  std::mutex mutex;
  std::deque<std::shared_ptr<Work>> pending;
};

struct EmuEvent {
  int device = 0;
  bool timing = false;
  std::mutex mutex;
  WorkList covers;  // the stream's unfinished work when last recorded
  Clock::time_point recorded{};
};

// Process-wide state, as a driver keeps it.
struct State {
  std::array<std::atomic<bool>, kDeviceCount> chosen{};  // a thread chose it, or something was made on it
  std::array<std::atomic<bool>, kDeviceCount> faulted{};
  std::mutex fault_mutex;
  std::array<std::string, kDeviceCount> faults;
  std::mutex streams_mutex;
  std::vector<EmuStream*> streams;  // every live stream: what freeing pinned memory waits for
};

State& state() {
  static State s;
  return s;
}

// The calling thread's current device (0 until set_device, as in CUDA).
thread_local int current_device = 0;

[[noreturn]] void fail(long long code, std::string_view code_name, std::string_view call, int device,
                       std::string message) {
  throw_error(ErrorSite{kLibrary, code, code_name, call, __FILE__, __LINE__, Device::emulated(device)},
              std::move(message));
}

void check_index(int device, std::string_view call) {
  if (device < 0 || device >= kDeviceCount)
    fail(101, "emulatedErrorInvalidDevice", call, 0,
         detail::concat("invalid device emu:", device,
                        "; the emulated accelerator has devices emu:0 to emu:", kDeviceCount - 1));
}

// The rule every call obeys: it runs in the context of the thread's current
// device, which must be one this process uses; and a faulted device fails.
void enter(std::string_view call, int device) {
  State& s = state();
  const int current = current_device;
  if (!s.chosen[size_t(current)].load())
    fail(
        201, "emulatedErrorContextOnUnusedDevice", call, current,
        detail::concat(call, device == current ? std::string() : detail::concat(" (about emu:", device, ")"),
                       " ran on a thread whose current device is emu:", current,
                       ", a device this process does not use: on a GPU this call creates a context on device ", current,
                       " (hundreds of MiB for every rank of the node). The thread must call "
                       "bind_thread_to_device() with its rank's device before touching it"));
  if (s.faulted[size_t(device)].load()) {
    std::lock_guard lock(s.fault_mutex);
    fail(700, "emulatedErrorIllegalAddress", call, device, s.faults[size_t(device)]);
  }
}

void choose(int device) {
  current_device = device;
  state().chosen[size_t(device)].store(true);
}

// Progress on one piece of work; true when it has finished.
bool advance(Work& work) {
  if (work.done.load()) return true;
  if (work.owner != std::this_thread::get_id()) return false;
  if (work.poll()) work.done.store(true);
  return work.done.load();
}

bool advance_all(const WorkList& works) {
  bool finished = true;
  for (const auto& work : works) finished = advance(*work) && finished;
  return finished;
}

// Waits for `works` on the host, progressing those this thread owns.
void wait_for(const WorkList& works) {
  while (!advance_all(works)) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

WorkList unfinished(EmuStream& stream) {
  std::lock_guard lock(stream.mutex);
  while (!stream.pending.empty() && stream.pending.front()->done.load()) stream.pending.pop_front();
  return WorkList(stream.pending.begin(), stream.pending.end());
}

WorkList every_stream_unfinished() {
  State& s = state();
  std::lock_guard lock(s.streams_mutex);
  WorkList works;
  for (EmuStream* stream : s.streams) {
    const WorkList more = unfinished(*stream);
    works.insert(works.end(), more.begin(), more.end());
  }
  return works;
}

EmuStream& as_stream(void* handle) {
  return *static_cast<EmuStream*>(handle);
}
EmuEvent& as_event(void* handle) {
  return *static_cast<EmuEvent*>(handle);
}

WorkList covered(EmuEvent& event) {
  std::lock_guard lock(event.mutex);
  return event.covers;
}

void* aligned_bytes(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  return std::aligned_alloc(64, rounded);
}

class EmulatedRuntime final : public DeviceRuntime {
 public:
  int device_count() override { return kDeviceCount; }
  std::string describe() override {
    return detail::concat("emulated accelerator: ", kDeviceCount, " devices (host memory, CPU kernels)");
  }

  void set_device(int device) override {
    check_index(device, "set_device");
    choose(device);
  }

  void* stream_create(int device) override {
    set_device(device);  // as the CUDA wrapper does
    enter("stream_create", device);
    auto* stream = new EmuStream;
    stream->device = device;
    State& s = state();
    std::lock_guard lock(s.streams_mutex);
    s.streams.push_back(stream);
    return stream;
  }
  void stream_destroy(void* handle) noexcept override {
    State& s = state();
    {
      std::lock_guard lock(s.streams_mutex);
      std::erase(s.streams, static_cast<EmuStream*>(handle));
    }
    delete static_cast<EmuStream*>(handle);
  }
  void stream_synchronize(void* handle) override {
    EmuStream& stream = as_stream(handle);
    enter("stream_synchronize", stream.device);
    wait_for(unfinished(stream));
  }

  void* event_create(int device, bool timing) override {
    set_device(device);  // as the CUDA wrapper does
    enter("event_create", device);
    auto* event = new EmuEvent;
    event->device = device;
    event->timing = timing;
    return event;
  }
  void event_destroy(void* event) noexcept override { delete static_cast<EmuEvent*>(event); }
  void event_record(void* event_handle, void* stream_handle) override {
    EmuEvent& event = as_event(event_handle);
    EmuStream& stream = as_stream(stream_handle);
    enter("event_record", stream.device);
    WorkList works = unfinished(stream);
    std::lock_guard lock(event.mutex);
    event.covers = std::move(works);
    event.recorded = Clock::now();
  }
  // Kernels run inline, so a stream that waits is the host that waits.
  void stream_wait_event(void* stream_handle, void* event_handle) override {
    enter("stream_wait_event", as_stream(stream_handle).device);
    wait_for(covered(as_event(event_handle)));
  }
  void event_synchronize(void* event_handle) override {
    EmuEvent& event = as_event(event_handle);
    enter("event_synchronize", event.device);
    wait_for(covered(event));
  }
  bool event_query(void* event_handle) override {
    EmuEvent& event = as_event(event_handle);
    enter("event_query", event.device);
    return advance_all(covered(event));
  }
  float event_elapsed_ms(void* start, void* end) override {
    EmuEvent& first = as_event(start);
    enter("event_elapsed_ms", first.device);
    std::lock_guard lock_first(first.mutex);
    std::lock_guard lock_second(as_event(end).mutex);
    return std::chrono::duration<float, std::milli>(as_event(end).recorded - first.recorded).count();
  }

  void* device_malloc(int device, size_t bytes) override {
    set_device(device);  // as the CUDA wrapper does
    enter("device_malloc", device);
    return aligned_bytes(bytes);
  }
  void device_free(int, void* ptr) noexcept override { std::free(ptr); }
  void* pinned_malloc(size_t bytes) override {
    enter("pinned_malloc", current_device);
    return aligned_bytes(bytes);
  }
  // As cudaFreeHost: it synchronises with the device, waiting for every
  // stream's queued work (progressing what this thread owns), so a free of
  // pinned memory while work that never finishes is queued never returns.
  void pinned_free(void* ptr) noexcept override {
    wait_for(every_stream_unfinished());
    std::free(ptr);
  }

  void memcpy_async(void* dst, const void* src, size_t bytes, void* stream_handle) override {
    EmuStream& stream = as_stream(stream_handle);
    enter("memcpy_async", stream.device);
    wait_for(unfinished(stream));  // ordered after the stream's work
    std::memcpy(dst, src, bytes);
  }
};

}  // namespace

DeviceRuntime& runtime() {
  static EmulatedRuntime instance;
  return instance;
}

void enqueue_work(void* handle, std::function<bool()> poll) {
  EmuStream& stream = as_stream(handle);
  enter("enqueue_work", stream.device);
  auto work = std::make_shared<Work>();
  work->poll = std::move(poll);
  work->owner = std::this_thread::get_id();
  std::lock_guard lock(stream.mutex);
  stream.pending.push_back(std::move(work));
}

void abandon_work(void* handle) noexcept {
  EmuStream& stream = as_stream(handle);
  std::lock_guard lock(stream.mutex);
  for (const auto& work : stream.pending) work->done.store(true);
  stream.pending.clear();
}

size_t pending_work(void* handle) {
  return unfinished(as_stream(handle)).size();
}

void inject_fault(int device, const std::string& what) {
  check_index(device, "inject_fault");
  State& s = state();
  std::lock_guard lock(s.fault_mutex);
  s.faults[size_t(device)] = what;
  s.faulted[size_t(device)].store(true);
}

void reset_for_tests() {
  State& s = state();
  std::lock_guard lock(s.fault_mutex);
  for (int d = 0; d < kDeviceCount; ++d) {
    s.chosen[size_t(d)].store(false);
    s.faulted[size_t(d)].store(false);
    s.faults[size_t(d)].clear();
  }
  current_device = 0;
}

}  // namespace tessera::emulated
