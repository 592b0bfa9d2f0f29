// `tessera schedule --pipeline-schedule zbv --pipeline-parallel 4 --micro-batches 8`:
// what each pipeline stage runs in one step, drawn over time from the
// schedule's simulation (parallel/pipeline_schedule.h), with its bubble and
// the micro-batches each stage holds at most: a schedule read before it is
// trained with, on any machine, without ranks.
#pragma once

#include <CLI/CLI.hpp>

namespace tessera::app {

// Adds the `schedule` subcommand to `app`; when it runs it prints the
// drawing and sets `exit_code` to 0. Flags that do not make a schedule are
// thrown as tessera::Error naming the flag, for main() to print.
void register_schedule_command(CLI::App& app, int& exit_code);

}  // namespace tessera::app
