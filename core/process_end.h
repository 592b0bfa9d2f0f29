// The one way library code ends the process: end_process(). Library code
// never calls exit, _Exit, abort, MPI_Abort or raise(SIGKILL) itself (the
// floors check, scripts/check_floors.py, refuses it). Where it must end the
// process (a collective past its deadline, a watchdog thread that found a
// failure, a crash injected by TESSERA_FAULT) it calls end_process() with
// how, and the hook the program installed decides what that means for the
// whole job: apps/process_end.cpp's, installed first thing in main(), calls
// MPI_Abort for a stalled collective on the main thread (every rank ends),
// std::_Exit from a watchdog thread (MPI is FUNNELED; the launcher ends the
// job when a rank exits without MPI_Finalize) and raise(SIGKILL) for an
// injected crash. Without a hook, or if the hook returns: std::_Exit(code).
//
// The hook is process-wide state, as std::set_terminate's is: it must be
// reachable from threads and code that hold no Context (a watchdog thread,
// the MPI communicator's deadline path).
#pragma once

namespace tessera {

enum class ProcessEnd {
  stalled_collective,  // the main thread, in a collective or transfer past its deadline (MPI may be called)
  watchdog_thread,     // a watchdog's own thread found a failure (MPI must not be called from it)
  injected_crash,      // TESSERA_FAULT asked for a crash: end as a killed process would
};

const char* process_end_name(ProcessEnd how);  // "stalled_collective", ...

// Ends the process; must not return (end_process falls back to std::_Exit if it does).
using ProcessEndHook = void (*)(ProcessEnd how, int exit_code);

// Installs `hook` (nullptr: back to the default, std::_Exit); returns the previous one.
ProcessEndHook set_process_end_hook(ProcessEndHook hook) noexcept;

// Flushes stdout and stderr and hands the end of the process to the hook.
[[noreturn]] void end_process(ProcessEnd how, int exit_code) noexcept;

}  // namespace tessera
