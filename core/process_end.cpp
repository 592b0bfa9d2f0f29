// end_process() and its hook (see process_end.h).
#include "core/process_end.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace tessera {
namespace {

std::atomic<ProcessEndHook>& installed_hook() {
  static std::atomic<ProcessEndHook> hook{nullptr};
  return hook;
}

}  // namespace

const char* process_end_name(ProcessEnd how) {
  switch (how) {
    case ProcessEnd::stalled_collective:
      return "stalled_collective";
    case ProcessEnd::watchdog_thread:
      return "watchdog_thread";
    case ProcessEnd::injected_crash:
      return "injected_crash";
  }
  return "unknown";
}

ProcessEndHook set_process_end_hook(ProcessEndHook hook) noexcept {
  return installed_hook().exchange(hook);
}

void end_process(ProcessEnd how, int exit_code) noexcept {
  std::fflush(nullptr);
  if (const ProcessEndHook hook = installed_hook().load()) hook(how, exit_code);
  std::_Exit(exit_code);
}

}  // namespace tessera
