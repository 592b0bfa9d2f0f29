// The SVG renderer of training curves: series extraction, axis ticks,
// min/max downsampling, and the panels written as plain SVG elements.
#include "io/plot.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include "core/error.h"

namespace tessera::io {
namespace {

using Points = std::vector<std::pair<double, double>>;  // (step, value), sorted by step

constexpr double kLeft = 84, kRight = 28, kHeaderHeight = 64, kPanelTop = 30, kPanelBottom = 46;
constexpr const char* kTrainColor = "#1f77b4";
constexpr const char* kEvalColor = "#d62728";
constexpr const char* kThroughputColor = "#2ca02c";
constexpr const char* kLrColor = "#9467bd";
constexpr const char* kAccuracyColor = "#ff7f0e";

std::string fixed(double value, int decimals = 1) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

std::string xml_escape(std::string_view text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // XML 1.0 forbids most control characters even escaped.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') out += c;
    }
  }
  return out;
}

// A tick label: enough decimals for the tick spacing; k/M/G for big values,
// scientific notation for tiny ones (learning rates).
std::string tick_label(double value, double spacing, double largest) {
  if (std::abs(value) < spacing * 1e-6) value = 0;  // -0.0 and rounding noise
  char buffer[64];
  if (largest >= 1e5) {
    const double scale = largest >= 1e9 ? 1e9 : largest >= 1e6 ? 1e6 : 1e3;
    const char* suffix = largest >= 1e9 ? "G" : largest >= 1e6 ? "M" : "k";
    const int decimals = std::max(0, int(-std::floor(std::log10(spacing / scale) + 1e-9)));
    std::snprintf(buffer, sizeof(buffer), "%.*f%s", decimals, value / scale, value == 0 ? "" : suffix);
    return buffer;
  }
  if (largest < 1e-2 && largest > 0) {
    std::snprintf(buffer, sizeof(buffer), "%.1e", value);
    return value == 0 ? "0" : buffer;
  }
  const int decimals = std::max(0, int(-std::floor(std::log10(spacing) + 1e-9)));
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

// Splits at non-finite values: each run of finite points is one curve.
std::vector<Points> finite_runs(const Points& points) {
  std::vector<Points> runs(1);
  for (const auto& point : points) {
    if (std::isfinite(point.second)) {
      runs.back().push_back(point);
    } else if (!runs.back().empty()) {
      runs.emplace_back();
    }
  }
  if (runs.back().empty()) runs.pop_back();
  return runs;
}

// The last value logged for each step, in step order.
template <typename Record, typename Get>
Points series(const std::vector<Record>& records, Get get) {
  std::map<int64_t, std::optional<double>> by_step;
  for (const Record& record : records) by_step[record.step] = get(record);
  Points points;
  for (const auto& [step, value] : by_step)
    if (value) points.emplace_back(double(step), *value);
  return points;
}

struct Curve {
  std::string label;
  std::string color;
  Points points;
  bool markers = false;  // a circle on every point (few points: evaluations)
  bool line = true;
};

struct Panel {
  std::string title;
  std::string y_label;
  std::vector<Curve> curves;
};

bool has_finite(const Points& points) {
  return std::any_of(points.begin(), points.end(), [](const auto& p) { return std::isfinite(p.second); });
}

class SvgWriter {
 public:
  SvgWriter(const PlotOptions& options, double x_low, double x_high)
      : options_(options), x_ticks_(nice_ticks(x_low, x_high, 8)) {
    // One step only: nice_ticks pads the range on both sides; steps are never negative.
    if (x_low >= 0) std::erase_if(x_ticks_, [](double tick) { return tick < 0; });
  }

  void panel(const Panel& panel, double top) {
    const double left = kLeft, right = options_.width - kRight;
    const double plot_top = top + kPanelTop, plot_bottom = top + options_.panel_height - kPanelBottom;
    double y_low = std::numeric_limits<double>::infinity(), y_high = -y_low;
    for (const Curve& curve : panel.curves)
      for (const auto& [x, y] : curve.points)
        if (std::isfinite(y)) y_low = std::min(y_low, y), y_high = std::max(y_high, y);
    const std::vector<double> y_ticks = nice_ticks(y_low, y_high, 5);
    const double x0 = x_ticks_.front(), x1 = x_ticks_.back(), y0 = y_ticks.front(), y1 = y_ticks.back();
    auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * (right - left); };
    auto py = [&](double y) { return plot_bottom - (y - y0) / (y1 - y0) * (plot_bottom - plot_top); };

    out_ += "<g class=\"panel\">\n";
    out_ += "<text x=\"" + fixed(left) + "\" y=\"" + fixed(top + 20) + "\" font-size=\"14\" font-weight=\"bold\">" +
            xml_escape(panel.title) + "</text>\n";
    // Grid and tick labels.
    const double largest_x = std::max(std::abs(x0), std::abs(x1));
    const double x_spacing = x_ticks_.size() > 1 ? x_ticks_[1] - x_ticks_[0] : 1;
    for (const double tick : x_ticks_) {
      const std::string x = fixed(px(tick));
      out_ += "<line x1=\"" + x + "\" y1=\"" + fixed(plot_top) + "\" x2=\"" + x + "\" y2=\"" + fixed(plot_bottom) +
              "\" stroke=\"#e5e5e5\"/>\n";
      out_ += "<text x=\"" + x + "\" y=\"" + fixed(plot_bottom + 16) + "\" text-anchor=\"middle\">" +
              xml_escape(tick_label(tick, x_spacing, largest_x)) + "</text>\n";
    }
    const double largest_y = std::max(std::abs(y0), std::abs(y1));
    const double y_spacing = y_ticks.size() > 1 ? y_ticks[1] - y_ticks[0] : 1;
    for (const double tick : y_ticks) {
      const std::string y = fixed(py(tick));
      out_ += "<line x1=\"" + fixed(left) + "\" y1=\"" + y + "\" x2=\"" + fixed(right) + "\" y2=\"" + y +
              "\" stroke=\"#e5e5e5\"/>\n";
      out_ += "<text x=\"" + fixed(left - 6) + "\" y=\"" + fixed(py(tick) + 4) + "\" text-anchor=\"end\">" +
              xml_escape(tick_label(tick, y_spacing, largest_y)) + "</text>\n";
    }
    out_ += "<rect x=\"" + fixed(left) + "\" y=\"" + fixed(plot_top) + "\" width=\"" + fixed(right - left) +
            "\" height=\"" + fixed(plot_bottom - plot_top) + "\" fill=\"none\" stroke=\"#444\"/>\n";
    out_ += "<text x=\"" + fixed((left + right) / 2) + "\" y=\"" + fixed(plot_bottom + 36) +
            "\" text-anchor=\"middle\">step</text>\n";
    const double label_y = (plot_top + plot_bottom) / 2;
    out_ += "<text x=\"18\" y=\"" + fixed(label_y) + "\" text-anchor=\"middle\" transform=\"rotate(-90 18 " +
            fixed(label_y) + ")\">" + xml_escape(panel.y_label) + "</text>\n";

    // Curves, then their legend (top right).
    for (const Curve& curve : panel.curves) {
      const std::string css_class = "series " + curve.label;
      for (const Points& run : finite_runs(curve.points)) {
        if (curve.line && run.size() > 1) {
          out_ += "<polyline class=\"" + xml_escape(css_class) + "\" fill=\"none\" stroke=\"" + curve.color +
                  "\" stroke-width=\"1.5\" stroke-linejoin=\"round\" points=\"";
          const Points shown = downsample_min_max(run, options_.max_points);
          for (size_t i = 0; i < shown.size(); ++i) {
            if (i > 0) out_ += ' ';
            out_ += fixed(px(shown[i].first)) + "," + fixed(py(shown[i].second));
          }
          out_ += "\"/>\n";
        }
        if (curve.markers || run.size() == 1) {
          for (const auto& [x, y] : run)
            out_ += "<circle class=\"" + xml_escape(css_class) + "\" cx=\"" + fixed(px(x)) + "\" cy=\"" + fixed(py(y)) +
                    "\" r=\"3\" fill=\"" + curve.color + "\"/>\n";
        }
      }
    }
    if (panel.curves.size() > 1) {
      double legend_y = plot_top + 16;
      for (const Curve& curve : panel.curves) {
        const double legend_x = right - 120;
        out_ += "<line x1=\"" + fixed(legend_x) + "\" y1=\"" + fixed(legend_y - 4) + "\" x2=\"" + fixed(legend_x + 20) +
                "\" y2=\"" + fixed(legend_y - 4) + "\" stroke=\"" + curve.color + "\" stroke-width=\"2\"/>\n";
        out_ += "<text x=\"" + fixed(legend_x + 26) + "\" y=\"" + fixed(legend_y) + "\">" + xml_escape(curve.label) +
                "</text>\n";
        legend_y += 16;
      }
    }
    out_ += "</g>\n";
  }

  std::string document(const std::string& title, const std::string& subtitle, int panels) {
    const double height = kHeaderHeight + panels * options_.panel_height;
    std::string doc = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
    doc += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(options_.width) + "\" height=\"" +
           fixed(height, 0) + "\" viewBox=\"0 0 " + std::to_string(options_.width) + " " + fixed(height, 0) +
           "\" font-family=\"sans-serif\" font-size=\"12\">\n";
    doc += "<rect x=\"0\" y=\"0\" width=\"" + std::to_string(options_.width) + "\" height=\"" + fixed(height, 0) +
           "\" fill=\"white\"/>\n";
    doc += "<text x=\"" + fixed(options_.width / 2.0) +
           "\" y=\"26\" text-anchor=\"middle\" font-size=\"18\" font-weight=\"bold\">" + xml_escape(title) +
           "</text>\n";
    doc += "<text x=\"" + fixed(options_.width / 2.0) + "\" y=\"48\" text-anchor=\"middle\" fill=\"#555\">" +
           xml_escape(subtitle) + "</text>\n";
    doc += out_;
    doc += "</svg>\n";
    return doc;
  }

 private:
  const PlotOptions& options_;
  std::vector<double> x_ticks_;
  std::string out_;
};

std::string short_number(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.4g", value);
  return buffer;
}

std::string lowercase_extension(const std::string& path) {
  std::string extension = std::filesystem::path(path).extension().string();
  std::transform(extension.begin(), extension.end(), extension.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  return extension;
}

}  // namespace

std::vector<double> nice_ticks(double low, double high, int target) {
  TESSERA_CHECK(std::isfinite(low) && std::isfinite(high), "nice_ticks: the range [", low, ", ", high,
                "] is not finite");
  if (high < low) std::swap(low, high);
  if (high - low <= std::max(std::abs(high), std::abs(low)) * 1e-12) {  // one value: a range around it
    const double pad = low == 0 ? 1.0 : std::abs(low) * 0.1;
    low -= pad;
    high += pad;
  }
  const double raw = (high - low) / std::max(1, target);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double normalized = raw / magnitude;
  const double spacing = (normalized < 1.5 ? 1 : normalized < 3 ? 2 : normalized < 7 ? 5 : 10) * magnitude;
  const double first = std::floor(low / spacing + 1e-9), last = std::ceil(high / spacing - 1e-9);
  std::vector<double> ticks;
  for (double i = first; i <= last + 0.5; ++i) ticks.push_back(i * spacing);
  if (ticks.size() < 2) ticks.push_back(ticks.back() + spacing);
  return ticks;
}

std::vector<std::pair<double, double>> downsample_min_max(const std::vector<std::pair<double, double>>& points,
                                                          size_t max_points) {
  if (points.size() <= max_points || max_points < 2) return points;
  const size_t buckets = max_points / 2;
  std::vector<std::pair<double, double>> kept;
  kept.reserve(buckets * 2);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t begin = b * points.size() / buckets, end = (b + 1) * points.size() / buckets;
    size_t lowest = begin, highest = begin;
    for (size_t i = begin; i < end; ++i) {
      if (points[i].second < points[lowest].second) lowest = i;
      if (points[i].second > points[highest].second) highest = i;
    }
    kept.push_back(points[std::min(lowest, highest)]);
    if (lowest != highest) kept.push_back(points[std::max(lowest, highest)]);
  }
  return kept;
}

std::string render_metrics_svg(const MetricsLog& log, const PlotOptions& options) {
  TESSERA_CHECK(!log.steps.empty() || !log.evals.empty(),
                "plot: the metrics hold no training step and no evaluation; nothing to draw");
  TESSERA_CHECK(options.width >= 200 && options.panel_height >= 100, "plot: a ", options.width, "x",
                options.panel_height, " panel is too small; use at least 200x100 pixels");

  std::vector<Panel> panels;
  Panel loss{"Loss", "loss", {}};
  const Points train_loss = series(log.steps, [](const StepRecord& r) { return std::optional(r.loss); });
  const Points eval_loss = series(log.evals, [](const EvalRecord& r) { return std::optional(r.eval_loss); });
  if (has_finite(train_loss)) loss.curves.push_back({"train", kTrainColor, train_loss});
  if (has_finite(eval_loss)) loss.curves.push_back({"eval", kEvalColor, eval_loss, true});
  if (!loss.curves.empty()) panels.push_back(std::move(loss));

  const Points samples = series(log.steps, [](const StepRecord& r) { return r.samples_per_s; });
  const Points tokens = series(log.steps, [](const StepRecord& r) { return r.tokens_per_s; });
  if (has_finite(samples)) {
    panels.push_back({"Throughput", "samples/s", {{"samples/s", kThroughputColor, samples}}});
  } else if (has_finite(tokens)) {
    panels.push_back({"Throughput", "tokens/s", {{"tokens/s", kThroughputColor, tokens}}});
  }
  const Points lr = series(log.steps, [](const StepRecord& r) { return std::optional(r.lr); });
  if (has_finite(lr)) panels.push_back({"Learning rate", "lr", {{"lr", kLrColor, lr}}});
  const Points accuracy = series(log.evals, [](const EvalRecord& r) { return r.eval_accuracy; });
  if (has_finite(accuracy))
    panels.push_back({"Eval accuracy", "accuracy", {{"eval_accuracy", kAccuracyColor, accuracy, true}}});
  const Points bits = series(log.evals, [](const EvalRecord& r) { return r.eval_bits_per_byte; });
  if (has_finite(bits))
    panels.push_back({"Eval bits per byte", "bits/byte", {{"eval_bits_per_byte", kAccuracyColor, bits, true}}});
  TESSERA_CHECK(!panels.empty(), "plot: every logged value is NaN or infinite; nothing to draw");

  double x_low = std::numeric_limits<double>::infinity(), x_high = -x_low;
  for (const Panel& panel : panels)
    for (const Curve& curve : panel.curves)
      for (const auto& point : curve.points)
        x_low = std::min(x_low, point.first), x_high = std::max(x_high, point.first);

  // The subtitle: how far the run got and where it ended.
  std::string subtitle = std::to_string(train_loss.size()) + " steps";
  if (!train_loss.empty()) {
    subtitle += " (" + fixed(train_loss.front().first, 0) + "-" + fixed(train_loss.back().first, 0) + ")";
    subtitle += ", last loss " + short_number(train_loss.back().second);
  }
  if (has_finite(eval_loss)) {
    const auto best = std::min_element(eval_loss.begin(), eval_loss.end(), [](const auto& a, const auto& b) {
      return std::isfinite(a.second) && (!std::isfinite(b.second) || a.second < b.second);
    });
    subtitle += ", best eval loss " + short_number(best->second) + " at step " + fixed(best->first, 0);
  }
  for (const auto& [key, value] : log.run) {
    if (key == "model" || key == "name") subtitle += ", " + key + " " + value;
  }

  SvgWriter svg(options, x_low, x_high);
  for (size_t i = 0; i < panels.size(); ++i) svg.panel(panels[i], kHeaderHeight + double(i) * options.panel_height);
  return svg.document(options.title.empty() ? "Training metrics" : options.title, subtitle, int(panels.size()));
}

std::optional<std::string> plot_output_problem(const std::string& path) {
  if (path.empty()) return "no output file given; pass -o curves.svg";
  if (lowercase_extension(path) == ".svg") return std::nullopt;
  std::filesystem::path suggestion(path);
  suggestion.replace_extension(".svg");
  const std::string extension = lowercase_extension(path);
  return "only SVG output is supported, not " +
         (extension.empty() ? std::string("a file without extension") : "'" + extension + "'") + " ('" + path +
         "'); write to '" + suggestion.string() +
         "' instead (and convert it if you need a bitmap, e.g. rsvg-convert -o curves.png curves.svg)";
}

PlotSummary plot_metrics(const std::string& metrics_path, const std::string& svg_path, PlotOptions options) {
  if (const auto problem = plot_output_problem(svg_path)) TESSERA_THROW("plot: ", *problem);
  std::error_code ignored;
  TESSERA_CHECK(!std::filesystem::equivalent(metrics_path, svg_path, ignored), "plot: the output '", svg_path,
                "' is the metrics file itself; pass another name with -o");
  MetricsLog log = read_metrics(metrics_path);
  TESSERA_CHECK(!log.steps.empty() || !log.evals.empty(), "plot: '", metrics_path,
                "' holds no training step and no evaluation; was the run stopped before its first logged step?");
  if (options.title.empty())
    options.title = "Training metrics: " + std::filesystem::path(metrics_path).filename().string();
  const std::string svg = render_metrics_svg(log, options);

  const std::string temporary = svg_path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out.is_open(), "plot: cannot write '", temporary, "': ", std::strerror(errno),
                  "; check the output directory exists and is writable");
    out << svg;
    out.close();
    TESSERA_CHECK(!out.fail(), "plot: writing '", temporary, "' failed; check the disk has space");
  }
  std::error_code error;
  std::filesystem::rename(temporary, svg_path, error);
  TESSERA_CHECK(!error, "plot: cannot move '", temporary, "' to '", svg_path, "': ", error.message());
  return PlotSummary{log.steps.size(), log.evals.size(), std::move(log.warnings)};
}

}  // namespace tessera::io
