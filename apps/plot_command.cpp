// The `plot` subcommand: parses its flags, refuses non-SVG output names with
// the .svg name to use instead, and reports what it drew.
#include "apps/plot_command.h"

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "io/plot.h"

namespace tessera::app {
namespace {

struct PlotCommandOptions {
  std::string metrics;
  std::string output;
  io::PlotOptions plot;
};

}  // namespace

void register_plot_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<PlotCommandOptions>();
  auto* plot = app.add_subcommand("plot", "Draw a run's training curves (loss, throughput, lr, eval) as SVG");
  plot->add_option("metrics", options->metrics, "The metrics JSONL file a training run wrote (its --metrics)")
      ->required();
  plot->add_option("-o,--output", options->output,
                   "The SVG file to write (default: the metrics file's name with .svg)");
  plot->add_option("--title", options->plot.title, "The plot's title (default: the metrics file's name)");
  plot->add_option("--width", options->plot.width, "Width in pixels")->capture_default_str();
  plot->add_option("--panel-height", options->plot.panel_height, "Height of each panel in pixels")
      ->capture_default_str();
  plot->callback([options, &exit_code] {
    std::string output = options->output;
    if (output.empty()) output = std::filesystem::path(options->metrics).replace_extension(".svg").string();
    if (const auto problem = io::plot_output_problem(output)) {
      std::fprintf(stderr, "tessera plot: %s\n", problem->c_str());
      exit_code = 2;
      return;
    }
    const io::PlotSummary summary = io::plot_metrics(options->metrics, output, options->plot);
    for (const std::string& warning : summary.warnings)
      std::fprintf(stderr, "tessera plot: warning: %s\n", warning.c_str());
    std::printf("wrote %s (%zu steps, %zu evaluations from %s)\n", output.c_str(), summary.steps, summary.evals,
                options->metrics.c_str());
    exit_code = 0;
  });
}

}  // namespace tessera::app
