// The program's hook for ending the process (core/process_end.h): what
// end_process() means for a whole MPI job. Installed first thing in main().
#pragma once

namespace tessera::app {

// Installs end_job (below) as the process-end hook.
void install_process_end_hook();

}  // namespace tessera::app
