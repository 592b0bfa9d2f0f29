// Training curves as a hand-written SVG (no plotting library): read a metrics
// JSONL (io/metrics.h) and draw stacked panels sharing the step axis:
// training loss with the eval-loss points, throughput (samples/s or
// tokens/s), learning rate, and eval accuracy / bits per byte when logged.
// Behind `tessera plot metrics.jsonl -o curves.svg`.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/metrics.h"

namespace tessera::io {

struct PlotOptions {
  std::string title{};       // default: "Training metrics"
  int width = 960;           // pixels
  int panel_height = 240;    // pixels per panel
  size_t max_points = 2000;  // per curve; a longer curve keeps each stretch's lowest and highest point
};

// The whole SVG document. Lines logged twice for a step (a resumed run
// appending to its file) count once, the later one; non-finite values leave
// a gap in their curve. Throws tessera::Error when the log holds no step and
// no evaluation.
std::string render_metrics_svg(const MetricsLog& log, const PlotOptions& options = {});

struct PlotSummary {
  size_t steps = 0;
  size_t evals = 0;
  std::vector<std::string> warnings;  // from reading the file
};

// Reads `metrics_path` and writes the SVG to `svg_path` (through a temporary
// file renamed into place). Errors name the file (and line) at fault.
PlotSummary plot_metrics(const std::string& metrics_path, const std::string& svg_path, PlotOptions options = {});

// Why `path` cannot be the plot's output, with the name to use instead
// (only SVG is written), or nullopt when it can.
std::optional<std::string> plot_output_problem(const std::string& path);

// --- pieces, public for the tests ---------------------------------------------

// About `target` evenly spaced round values (1, 2 or 5 times a power of ten)
// covering [low, high]: the first is <= low, the last >= high.
std::vector<double> nice_ticks(double low, double high, int target = 5);

// At most `max_points` of `points` (sorted by x): each of max_points/2
// stretches keeps its lowest and highest point, so spikes survive.
std::vector<std::pair<double, double>> downsample_min_max(const std::vector<std::pair<double, double>>& points,
                                                          size_t max_points);

}  // namespace tessera::io
