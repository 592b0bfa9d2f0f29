// Training-curve SVGs (io/plot.h) from synthetic metrics files: the document
// is well-formed XML (a test-local checker: balanced tags, quoted attributes,
// escaped text), each curve has one point per logged step and its points are
// an increasing-x, affine image of the logged values inside its panel's frame;
// gaps at non-finite values, downsampling that keeps spikes, the later of two
// lines for a step, tick and downsampling properties, and errors that name
// the file, the line, or the .svg name to use.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/metrics.h"
#include "io/plot.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

class ScratchDir {
 public:
  ScratchDir() {
    std::random_device device;
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_plot_test_" + std::to_string(getpid()) + "_" + std::to_string(device()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// --- a small XML checker ------------------------------------------------------

struct Element {
  std::string name;
  std::map<std::string, std::string> attributes;
  std::string text;  // unescaped character data directly inside
  int group = -1;    // index of the enclosing <g class="panel">, -1 outside
};

std::string unescape(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&') {
      out += text[i];
      continue;
    }
    const size_t end = text.find(';', i);
    if (end == std::string::npos) throw std::runtime_error("bare '&'");
    const std::string entity = text.substr(i + 1, end - i - 1);
    static const std::map<std::string, char> known{
        {"amp", '&'}, {"lt", '<'}, {"gt", '>'}, {"quot", '"'}, {"apos", '\''}};
    if (!known.count(entity)) throw std::runtime_error("unknown entity &" + entity + ";");
    out += known.at(entity);
    i = end;
  }
  return out;
}

// Every element of a well-formed document with one root; throws otherwise.
std::vector<Element> parse_xml(const std::string& doc) {
  std::vector<Element> elements;
  std::vector<size_t> open;  // indices into `elements`
  int panels = 0, current_group = -1;
  std::vector<int> group_stack;
  size_t pos = 0, roots = 0;
  if (doc.rfind("<?xml", 0) == 0) pos = doc.find("?>") + 2;
  while (pos < doc.size()) {
    const size_t lt = doc.find('<', pos);
    const std::string text = doc.substr(pos, (lt == std::string::npos ? doc.size() : lt) - pos);
    if (text.find('>') != std::string::npos) throw std::runtime_error("raw '>' in text");
    if (!open.empty())
      elements[open.back()].text += unescape(text);
    else if (text.find_first_not_of(" \n\t\r") != std::string::npos)
      throw std::runtime_error("text outside the root");
    if (lt == std::string::npos) break;
    const size_t gt = doc.find('>', lt);
    if (gt == std::string::npos) throw std::runtime_error("unterminated tag");
    std::string tag = doc.substr(lt + 1, gt - lt - 1);
    pos = gt + 1;
    if (tag.empty()) throw std::runtime_error("empty tag");
    if (tag[0] == '/') {
      if (open.empty() || elements[open.back()].name != tag.substr(1))
        throw std::runtime_error("</" + tag.substr(1) + "> closes " +
                                 (open.empty() ? "nothing" : elements[open.back()].name));
      if (tag.substr(1) == "g") {
        current_group = group_stack.back();
        group_stack.pop_back();
      }
      open.pop_back();
      continue;
    }
    const bool self_closing = tag.back() == '/';
    if (self_closing) tag.pop_back();
    Element element;
    size_t i = 0;
    while (i < tag.size() && !std::isspace(static_cast<unsigned char>(tag[i]))) element.name += tag[i++];
    for (;;) {
      while (i < tag.size() && std::isspace(static_cast<unsigned char>(tag[i]))) ++i;
      if (i >= tag.size()) break;
      const size_t eq = tag.find('=', i);
      if (eq == std::string::npos || eq + 1 >= tag.size() || tag[eq + 1] != '"')
        throw std::runtime_error("unquoted attribute in <" + element.name + ">");
      const std::string key = tag.substr(i, eq - i);
      const size_t close = tag.find('"', eq + 2);
      if (close == std::string::npos) throw std::runtime_error("unterminated attribute");
      const std::string value = tag.substr(eq + 2, close - eq - 2);
      if (value.find('<') != std::string::npos) throw std::runtime_error("'<' in an attribute");
      if (!element.attributes.emplace(key, unescape(value)).second) throw std::runtime_error("duplicate attribute");
      i = close + 1;
    }
    if (open.empty() && roots++ > 0) throw std::runtime_error("second root element");
    if (element.name == "g") {
      group_stack.push_back(current_group);
      if (element.attributes["class"] == "panel") current_group = panels++;
    }
    element.group = current_group;
    elements.push_back(element);
    if (!self_closing)
      open.push_back(elements.size() - 1);
    else if (element.name == "g") {
      current_group = group_stack.back();
      group_stack.pop_back();
    }
  }
  if (!open.empty()) throw std::runtime_error("<" + elements[open.back()].name + "> never closed");
  if (roots != 1) throw std::runtime_error("no root element");
  return elements;
}

std::vector<std::pair<double, double>> polyline_points(const Element& polyline) {
  std::vector<std::pair<double, double>> points;
  std::istringstream in(polyline.attributes.at("points"));
  for (std::string pair; in >> pair;) {
    const size_t comma = pair.find(',');
    points.emplace_back(std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
  }
  return points;
}

std::vector<const Element*> with_class(const std::vector<Element>& elements, const std::string& name,
                                       const std::string& css_class) {
  std::vector<const Element*> found;
  for (const Element& element : elements) {
    const auto it = element.attributes.find("class");
    if (element.name == name && it != element.attributes.end() && it->second == css_class) found.push_back(&element);
  }
  return found;
}

// The panel frame (the <rect> with a stroke) of a group.
struct Frame {
  double left, top, right, bottom;
};
Frame frame_of(const std::vector<Element>& elements, int group) {
  for (const Element& element : elements) {
    if (element.group == group && element.name == "rect" && element.attributes.count("stroke")) {
      const double x = std::stod(element.attributes.at("x")), y = std::stod(element.attributes.at("y"));
      return {x, y, x + std::stod(element.attributes.at("width")), y + std::stod(element.attributes.at("height"))};
    }
  }
  throw std::runtime_error("panel without a frame");
}

// Points are (step, value) mapped by an increasing affine x and a decreasing
// affine y (SVG's y grows downwards), inside the frame; coordinates are
// written with one decimal, so within 0.06 px.
void expect_plots(const std::vector<std::pair<double, double>>& points, const std::vector<double>& steps,
                  const std::vector<double>& values, const Frame& frame) {
  ASSERT_EQ(points.size(), steps.size());
  ASSERT_EQ(points.size(), values.size());
  ASSERT_GE(points.size(), 2u);
  const auto [low, high] = std::minmax_element(values.begin(), values.end());
  const size_t i_low = size_t(low - values.begin()), i_high = size_t(high - values.begin());
  const double y_scale = *high == *low ? 0 : (points[i_high].second - points[i_low].second) / (*high - *low);
  const double x_scale = (points.back().first - points.front().first) / (steps.back() - steps.front());
  EXPECT_GT(x_scale, 0);
  if (*high != *low) {
    EXPECT_LT(y_scale, 0);
  }
  for (size_t i = 0; i < points.size(); ++i) {
    EXPECT_NEAR(points[i].first, points.front().first + x_scale * (steps[i] - steps.front()), 0.1) << i;
    EXPECT_NEAR(points[i].second, points[i_low].second + y_scale * (values[i] - *low), 0.1) << i;
    EXPECT_GE(points[i].first, frame.left - 0.05);
    EXPECT_LE(points[i].first, frame.right + 0.05);
    EXPECT_GE(points[i].second, frame.top - 0.05);
    EXPECT_LE(points[i].second, frame.bottom + 0.05);
  }
}

// ---------------------------------------------------------------------------

TEST(Plot, WellFormedSvgWithOnePointPerLoggedStep) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  ScratchDir dir;
  const std::string metrics = dir.file("metrics.jsonl"), svg_path = dir.file("curves.svg");
  const int64_t n = std::uniform_int_distribution<int64_t>(20, 80)(rng), every = 7;
  std::vector<double> steps, losses, rates, lrs, eval_steps, eval_losses, accuracies;
  {
    io::MetricsWriter writer({.path = metrics, .katib = nullptr});
    for (int64_t step = 1; step <= n; ++step) {
      const io::StepRecord record{.step = step * 10,
                                  .total_steps = n * 10,
                                  .loss = 3 * unit(rng) + 0.1,
                                  .lr = 1e-3 * unit(rng),
                                  .ms_per_step = 10,
                                  .samples_per_s = 1e4 * unit(rng) + 1e3};
      writer.log_step(record);
      steps.push_back(double(record.step));
      losses.push_back(record.loss);
      rates.push_back(*record.samples_per_s);
      lrs.push_back(record.lr);
      if (step % every == 0) {
        const io::EvalRecord eval{step * 10, 3 * unit(rng), unit(rng), std::nullopt};
        writer.log_eval(eval);
        eval_steps.push_back(double(eval.step));
        eval_losses.push_back(eval.eval_loss);
        accuracies.push_back(*eval.eval_accuracy);
      }
    }
  }
  const io::PlotSummary summary = io::plot_metrics(metrics, svg_path);
  EXPECT_EQ(summary.steps, size_t(n));
  EXPECT_EQ(summary.evals, eval_steps.size());
  EXPECT_FALSE(std::filesystem::exists(svg_path + ".tmp"));

  const std::string svg = read_text(svg_path);
  std::vector<Element> elements;
  ASSERT_NO_THROW(elements = parse_xml(svg)) << svg.substr(0, 2000);
  EXPECT_EQ(elements.front().name, "svg");
  EXPECT_EQ(elements.front().attributes.at("xmlns"), "http://www.w3.org/2000/svg");

  struct Expected {
    std::string css_class;
    const std::vector<double>* steps;
    const std::vector<double>* values;
    bool markers;
  };
  const std::vector<Expected> curves{{"series train", &steps, &losses, false},
                                     {"series eval", &eval_steps, &eval_losses, true},
                                     {"series samples/s", &steps, &rates, false},
                                     {"series lr", &steps, &lrs, false},
                                     {"series eval_accuracy", &eval_steps, &accuracies, true}};
  for (const Expected& curve : curves) {
    SCOPED_TRACE(curve.css_class);
    const auto polylines = with_class(elements, "polyline", curve.css_class);
    ASSERT_EQ(polylines.size(), 1u);
    const auto points = polyline_points(*polylines[0]);
    expect_plots(points, *curve.steps, *curve.values, frame_of(elements, polylines[0]->group));
    EXPECT_EQ(with_class(elements, "circle", curve.css_class).size(), curve.markers ? curve.steps->size() : 0u);
  }
  // Train and eval loss share the first panel, and so its axes.
  EXPECT_EQ(with_class(elements, "polyline", "series train")[0]->group, 0);
  EXPECT_EQ(with_class(elements, "polyline", "series eval")[0]->group, 0);

  // The title names the file; the panels have titles and axis labels.
  std::string all_text;
  for (const Element& element : elements) all_text += element.text + "\n";
  EXPECT_NE(all_text.find("Training metrics: metrics.jsonl"), std::string::npos);
  for (const char* label : {"Loss", "Throughput", "samples/s", "Learning rate", "Eval accuracy", "step"})
    EXPECT_NE(all_text.find(label), std::string::npos) << label;
  // Value tick labels (right-aligned) on every panel: at least three each.
  const size_t panels = 4;
  size_t ticks = 0;
  for (const Element& element : elements)
    if (element.name == "text" && element.group >= 0 && element.attributes.count("text-anchor") &&
        element.attributes.at("text-anchor") != "middle")
      ++ticks;
  EXPECT_GE(ticks, 3 * panels);
}

TEST(Plot, NonFiniteValuesLeaveAGap) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const int64_t n = 30, bad = std::uniform_int_distribution<int64_t>(3, n - 2)(rng);
  io::MetricsLog log;
  for (int64_t step = 1; step <= n; ++step)
    log.steps.push_back({.step = step, .loss = step == bad ? std::nan("") : 1.0 + double(step % 5), .lr = 0.1});
  const auto elements = parse_xml(io::render_metrics_svg(log));
  const auto train = with_class(elements, "polyline", "series train");
  ASSERT_EQ(train.size(), 2u);
  EXPECT_EQ(polyline_points(*train[0]).size(), size_t(bad - 1));
  EXPECT_EQ(polyline_points(*train[1]).size(), size_t(n - bad));
  EXPECT_TRUE(with_class(elements, "polyline", "series samples/s").empty());  // none logged: no panel
}

TEST(Plot, LongRunsAreThinnedButKeepTheirSpikes) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int64_t n = 10000, spike = std::uniform_int_distribution<int64_t>(100, n - 100)(rng);
  io::MetricsLog log;
  for (int64_t step = 0; step < n; ++step)
    log.steps.push_back({.step = step, .loss = step == spike ? 50.0 : 1.0 + unit(rng), .lr = 0.1});
  const auto elements = parse_xml(io::render_metrics_svg(log, {.max_points = 1000}));
  const auto train = with_class(elements, "polyline", "series train");
  ASSERT_EQ(train.size(), 1u);
  const auto points = polyline_points(*train[0]);
  EXPECT_LE(points.size(), 1000u);
  EXPECT_GE(points.size(), 500u);
  const auto highest =
      std::min_element(points.begin(), points.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  const Frame frame = frame_of(elements, train[0]->group);
  // The spike is the highest point, at its step's x.
  const double x_of_spike = frame.left + (frame.right - frame.left) * double(spike) / double(n - 1);
  EXPECT_NEAR(highest->first, x_of_spike, (frame.right - frame.left) * 0.02);
  EXPECT_LT(highest->second, (frame.top + frame.bottom) / 2);
}

TEST(Plot, TheLaterLineForAStepWins) {
  ScratchDir dir;
  const std::string metrics = dir.file("resumed.jsonl");
  {
    io::MetricsWriter first({.path = metrics, .katib = nullptr});
    for (int64_t step = 1; step <= 10; ++step) first.log_step({.step = step, .loss = 1.0 + double(step), .lr = 0.1});
  }
  {
    io::MetricsWriter resumed({.path = metrics, .append = true, .katib = nullptr});
    for (int64_t step = 6; step <= 15; ++step)
      resumed.log_step({.step = step, .loss = 100.0 - double(step), .lr = 0.1});
  }
  const auto elements = parse_xml(io::render_metrics_svg(io::read_metrics(metrics)));
  const auto train = with_class(elements, "polyline", "series train");
  ASSERT_EQ(train.size(), 1u);
  std::vector<double> steps, values;
  for (int64_t step = 1; step <= 15; ++step) {
    steps.push_back(double(step));
    values.push_back(step <= 5 ? 1.0 + double(step) : 100.0 - double(step));
  }
  expect_plots(polyline_points(*train[0]), steps, values, frame_of(elements, train[0]->group));
}

TEST(Plot, TitlesAreEscaped) {
  io::MetricsLog log;
  log.steps = {{.step = 0, .loss = 2.0}, {.step = 1, .loss = 1.0}};
  const std::string title = "a <b> & \"c\" 'd'";
  const std::string svg = io::render_metrics_svg(log, {.title = title});
  std::vector<Element> elements;
  ASSERT_NO_THROW(elements = parse_xml(svg));
  bool found = false;
  for (const Element& element : elements) found = found || element.text == title;
  EXPECT_TRUE(found);
}

TEST(Plot, NiceTicksCoverTheRangeEvenly) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-8, 8), target(2, 10);
  for (int trial = 0; trial < 2000; ++trial) {
    const double scale = std::pow(10.0, exponent(rng));
    const double a = unit(rng) * scale, b = trial % 10 == 0 ? a : unit(rng) * scale;
    const int wanted = target(rng);
    const auto ticks = io::nice_ticks(a, b, wanted);
    SCOPED_TRACE(std::to_string(a) + " " + std::to_string(b) + " target " + std::to_string(wanted));
    ASSERT_GE(ticks.size(), 2u);
    EXPECT_LE(ticks.front(), std::min(a, b));
    EXPECT_GE(ticks.back(), std::max(a, b));
    const double spacing = ticks[1] - ticks[0];
    // 1, 2 or 5 times a power of ten.
    const double mantissa = spacing / std::pow(10.0, std::floor(std::log10(spacing) + 1e-9));
    EXPECT_TRUE(std::abs(mantissa - 1) < 1e-6 || std::abs(mantissa - 2) < 1e-6 || std::abs(mantissa - 5) < 1e-6 ||
                std::abs(mantissa - 10) < 1e-6)
        << spacing;
    for (size_t i = 1; i < ticks.size(); ++i) EXPECT_NEAR(ticks[i] - ticks[i - 1], spacing, 1e-9 * spacing);
    EXPECT_LE(ticks.size(), size_t(2 * wanted + 3));
  }
}

TEST(Plot, DownsamplingKeepsExtremesInOrder) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::normal_distribution<double> noise;
  for (int trial = 0; trial < 50; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(1, 5000)(rng);
    const size_t limit = std::uniform_int_distribution<size_t>(2, 1200)(rng);
    std::vector<std::pair<double, double>> points;
    for (size_t i = 0; i < n; ++i) points.emplace_back(double(i) * 1.5, noise(rng));
    const auto kept = io::downsample_min_max(points, limit);
    ASSERT_LE(kept.size(), std::max(limit, n <= limit ? n : limit));
    if (n <= limit) {
      EXPECT_EQ(kept, points);
      continue;
    }
    for (size_t i = 1; i < kept.size(); ++i) EXPECT_LT(kept[i - 1].first, kept[i].first);
    for (const auto& point : kept) EXPECT_NE(std::find(points.begin(), points.end(), point), points.end());
    const auto by_value = [](const auto& a, const auto& b) { return a.second < b.second; };
    EXPECT_NE(std::find(kept.begin(), kept.end(), *std::min_element(points.begin(), points.end(), by_value)),
              kept.end());
    EXPECT_NE(std::find(kept.begin(), kept.end(), *std::max_element(points.begin(), points.end(), by_value)),
              kept.end());
  }
}

TEST(Plot, ErrorsNameTheFileTheLineOrTheSvgName) {
  ScratchDir dir;
  const std::string missing = dir.file("missing.jsonl");
  try {
    io::plot_metrics(missing, dir.file("out.svg"));
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find(missing), std::string::npos) << error.what();
  }

  const std::string corrupt = dir.file("corrupt.jsonl");
  std::ofstream(corrupt) << R"({"kind":"train","step":1,"loss":1})"
                         << "\n"
                         << R"({"kind":"train","step":2,"loss":1})"
                         << "\n"
                         << R"({"kind":"train","step":3,"loss":1 "lr":2})"
                         << "\n";
  try {
    io::plot_metrics(corrupt, dir.file("out.svg"));
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find(corrupt + " line 3"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("out.svg")));

  const std::string empty = dir.file("empty.jsonl");
  std::ofstream(empty) << "\n";
  try {
    io::plot_metrics(empty, dir.file("out.svg"));
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find(empty), std::string::npos) << error.what();
  }

  // A metrics file that happens to end in .svg is never overwritten by its own plot.
  const std::string odd_name = dir.file("odd.svg");
  std::ofstream(odd_name) << R"({"kind":"train","step":1,"loss":1})"
                          << "\n";
  EXPECT_THROW(io::plot_metrics(odd_name, odd_name), Error);
  EXPECT_EQ(io::read_metrics(odd_name).steps.size(), 1u);

  const auto png = io::plot_output_problem("runs/curves.png");
  ASSERT_TRUE(png.has_value());
  EXPECT_NE(png->find("only SVG"), std::string::npos) << *png;
  EXPECT_NE(png->find("'runs/curves.svg'"), std::string::npos) << *png;
  EXPECT_TRUE(io::plot_output_problem("curves").has_value());
  EXPECT_FALSE(io::plot_output_problem("curves.svg").has_value());
  EXPECT_FALSE(io::plot_output_problem("CURVES.SVG").has_value());
  try {
    io::plot_metrics(missing, dir.file("out.png"));  // the output name is checked first
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("out.svg"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera::testing
