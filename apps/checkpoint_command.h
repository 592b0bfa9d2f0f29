// `tessera checkpoint`: look into checkpoints written by `tessera train --save`.
//   tessera checkpoint inspect PATH   step, layout, metadata, rank state and every
//                                     tensor (shape, dtype, size); verifies every checksum
//   tessera checkpoint list DIR       the checkpoints of a save directory and which is latest
//   tessera export PATH -o OUT        the weights as safetensors (io/export.h)
// PATH is a step directory, its checkpoint.h5, or a save directory (its latest).
#pragma once

#include <CLI/CLI.hpp>

namespace tessera::app {

// Adds the `checkpoint` subcommand (with `inspect` and `list`) to `app`.
// `inspect` sets `exit_code` to 0 when every checksum matches and to 1
// (naming the bad tensors on stderr) otherwise; `list` sets 0. Unreadable
// paths are thrown as tessera::Error for main() to print.
void register_checkpoint_command(CLI::App& app, int& exit_code);

// Adds `export CHECKPOINT -o FILE|DIR [--format tessera|hf-gpt2] [--force]` (io/export.h).
void register_export_command(CLI::App& app, int& exit_code);

}  // namespace tessera::app
