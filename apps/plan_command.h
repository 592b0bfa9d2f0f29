// `tessera plan`: which layout, and will it fit? The model flags of `tessera
// train` (--model, --num-layers, --hidden-size, ..., --seq-length,
// --global-batch-size, --precision) and a cluster (--cluster SPEC or a TOML
// file: plan/cluster.h, apps/cluster_file.h) in; every layout that fits out,
// ranked by predicted step time (plan/planner.h), as a table and as
// name=value lines (predicted_step_s, ...). Layout flags given (--tp 8,
// --zero 1, --recompute, ...) fix those axes; --explain prints where the best
// remaining layout's step and memory go.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "apps/train_config.h"

namespace tessera::app {

// `tessera train --plan`: `config` with the layout axes it does not give
// chosen by the plan's fastest layout that fits --cluster (which must have
// `world_size` accelerators); `chosen` says which, with its flags. Throws
// when no layout fits, naming the nearest.
TrainConfig with_planned_layout(const TrainConfig& config, int world_size, std::string& chosen);

// Adds the `plan` subcommand to `app`; exit code 0 when a layout fits, 1
// (with the nearest layout and why the others were refused) when none does.
void register_plan_command(CLI::App& app, int& exit_code);

}  // namespace tessera::app
