// `tessera generate CHECKPOINT --prompt TEXT`: text from a trained GPT (a
// checkpoint saved under any layout), with a KV cache, on one rank or on
// the ranks of `mpirun` as one tensor-parallel group (models/generation.h).
#pragma once

#include <CLI/CLI.hpp>
#include <optional>

#include "parallel/mpi_env.h"

namespace tessera::app {

// Adds `generate` to `app`; it starts MPI in `mpi` when it runs.
void register_generate_command(CLI::App& app, std::optional<parallel::MpiEnv>& mpi, int& exit_code);

}  // namespace tessera::app
