// `tessera plot metrics.jsonl -o curves.svg`: training curves (loss with eval
// points, throughput, learning rate, eval accuracy) from a run's metrics file,
// drawn as SVG by io/plot.h.
#pragma once

#include <CLI/CLI.hpp>

namespace tessera::app {

// Adds the `plot` subcommand to `app`; when it runs, it sets `exit_code`
// (0 on success, 2 when the output name is not an .svg file). Errors reading
// the metrics file are thrown as tessera::Error for main() to print.
void register_plot_command(CLI::App& app, int& exit_code);

}  // namespace tessera::app
