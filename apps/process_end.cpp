// The program's process-end hook: a stalled collective on the main thread
// ends every rank with MPI_Abort (when MPI is running), a watchdog thread
// exits this rank at once (MPI is FUNNELED: that thread may not call it; the
// launcher ends the job when a rank exits without MPI_Finalize), an injected
// crash dies by SIGKILL as a killed process would.
#include "apps/process_end.h"

#include <mpi.h>

#include <csignal>
#include <cstdlib>

#include "core/process_end.h"

namespace tessera::app {
namespace {

bool mpi_running() {
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  return initialised && !finalised;
}

void end_job(ProcessEnd how, int exit_code) {
  switch (how) {
    case ProcessEnd::stalled_collective:
      if (mpi_running()) MPI_Abort(MPI_COMM_WORLD, exit_code);
      break;
    case ProcessEnd::watchdog_thread:
      break;
    case ProcessEnd::injected_crash:
      std::raise(SIGKILL);
      break;
  }
  std::_Exit(exit_code);
}

}  // namespace

void install_process_end_hook() {
  set_process_end_hook(end_job);
}

}  // namespace tessera::app
