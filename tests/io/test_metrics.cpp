// Metrics JSONL and Katib lines (io/metrics.h) and the progress line
// (io/progress.h): records read back exactly (through the reader and through a
// test-local extraction with strtod), non-finite values as null, string
// escaping, every line written as the JSON library (nlohmann, the reader's)
// writes it, Katib's own regex over the stdout lines, line-by-line flushing,
// errors naming file and line; progress formatting parsed back, the ETA
// average against a step-by-step reference, terminal and plain output.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/metrics.h"
#include "io/progress.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using io::EvalRecord;
using io::StepRecord;

// Katib's StdOut metrics collector's default filter (katib/pkg/metricscollector).
const std::regex kKatibFilter(R"(([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?))");

class ScratchDir {
 public:
  ScratchDir() {
    std::random_device device;
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_metrics_test_" + std::to_string(getpid()) + "_" + std::to_string(device()));
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

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// A double over many magnitudes, signs and mantissas.
double random_double(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-300, 300);
  return std::ldexp(mantissa(rng), exponent(rng));
}

StepRecord random_step(std::mt19937_64& rng, int64_t step) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  StepRecord record;
  record.step = step;
  record.total_steps = step + std::uniform_int_distribution<int64_t>(0, 1000000)(rng);
  record.loss = random_double(rng);
  record.lr = unit(rng) * 1e-2;
  record.ms_per_step = unit(rng) * 100;
  if (unit(rng) < 0.7) record.samples_per_s = unit(rng) * 1e5;
  if (unit(rng) < 0.5) record.tokens_per_s = unit(rng) * 1e7;
  if (unit(rng) < 0.5) record.grad_norm = random_double(rng);
  if (unit(rng) < 0.5) record.loss_scale = std::ldexp(1.0, std::uniform_int_distribution<int>(0, 24)(rng));
  record.skipped = unit(rng) < 0.3;
  record.epoch = std::uniform_int_distribution<int64_t>(0, 90)(rng);
  if (unit(rng) < 0.5) record.extra = {{"aux_loss", random_double(rng)}, {"z-loss", random_double(rng)}};
  return record;
}

void expect_same_step(const StepRecord& actual, const StepRecord& expected) {
  EXPECT_EQ(actual.step, expected.step);
  EXPECT_EQ(actual.total_steps, expected.total_steps);
  EXPECT_EQ(actual.loss, expected.loss);
  EXPECT_EQ(actual.lr, expected.lr);
  EXPECT_EQ(actual.ms_per_step, expected.ms_per_step);
  EXPECT_EQ(actual.samples_per_s, expected.samples_per_s);
  EXPECT_EQ(actual.tokens_per_s, expected.tokens_per_s);
  EXPECT_EQ(actual.grad_norm, expected.grad_norm);
  EXPECT_EQ(actual.loss_scale, expected.loss_scale);
  EXPECT_EQ(actual.skipped, expected.skipped);
  EXPECT_EQ(actual.epoch, expected.epoch);
  EXPECT_EQ(actual.extra, expected.extra);
}

// The text after "key": in a JSON line, up to the next ',' or '}' (numbers, null, true, false).
std::string raw_value(const std::string& line, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  const size_t at = line.find(needle);
  if (at == std::string::npos) return "<absent>";
  const size_t begin = at + needle.size();
  return line.substr(begin, line.find_first_of(",}", begin) - begin);
}

// All name=value pairs Katib would collect from one line.
std::map<std::string, std::string> katib_parse(const std::string& line) {
  std::map<std::string, std::string> metrics;
  for (auto it = std::sregex_iterator(line.begin(), line.end(), kKatibFilter); it != std::sregex_iterator(); ++it)
    metrics[(*it)[1]] = (*it)[2];
  return metrics;
}

// ---------------------------------------------------------------------------

TEST(MetricsWriter, StepsAndEvalsReadBackExactly) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  ScratchDir dir;
  const std::string path = dir.file("run/metrics.jsonl");  // the parent directory is created
  std::vector<std::string> katib;
  std::vector<StepRecord> steps;
  std::vector<EvalRecord> evals;
  const double before = double(std::time(nullptr)) - 1;
  {
    io::MetricsWriter writer({.path = path, .katib = [&](std::string_view line) { katib.emplace_back(line); }});
    for (int64_t step = 1; step <= 40; ++step) {
      steps.push_back(random_step(rng, step));
      writer.log_step(steps.back());
      if (step % 10 == 0) {
        EvalRecord eval{step, random_double(rng), std::nullopt, std::nullopt};
        if (step % 20 == 0) eval.eval_accuracy = std::uniform_real_distribution<double>(0, 1)(rng);
        if (step == 30) eval.eval_bits_per_byte = random_double(rng);
        evals.push_back(eval);
        writer.log_eval(eval);
      }
    }
  }
  const double after = double(std::time(nullptr)) + 1;

  const io::MetricsLog log = io::read_metrics(path);
  ASSERT_EQ(log.steps.size(), steps.size());
  ASSERT_EQ(log.evals.size(), evals.size());
  EXPECT_TRUE(log.warnings.empty());
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(steps[i].step));
    expect_same_step(log.steps[i], steps[i]);
  }
  for (size_t i = 0; i < evals.size(); ++i) {
    EXPECT_EQ(log.evals[i].step, evals[i].step);
    EXPECT_EQ(log.evals[i].eval_loss, evals[i].eval_loss);
    EXPECT_EQ(log.evals[i].eval_accuracy, evals[i].eval_accuracy);
    EXPECT_EQ(log.evals[i].eval_bits_per_byte, evals[i].eval_bits_per_byte);
  }

  // Independently of the reader: the file's lines, each value's text through strtod.
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), steps.size() + evals.size());
  size_t step_index = 0, eval_index = 0;
  for (const std::string& line : lines) {
    ASSERT_EQ(line.front(), '{');
    ASSERT_EQ(line.back(), '}');
    const double wall_time = std::strtod(raw_value(line, "wall_time").c_str(), nullptr);
    EXPECT_GE(wall_time, before) << line;
    EXPECT_LE(wall_time, after) << line;
    if (line.find("\"eval_loss\"") != std::string::npos) {
      const EvalRecord& eval = evals[eval_index++];
      EXPECT_EQ(raw_value(line, "kind"), "\"eval\"");
      EXPECT_EQ(raw_value(line, "step"), std::to_string(eval.step));
      EXPECT_EQ(std::strtod(raw_value(line, "eval_loss").c_str(), nullptr), eval.eval_loss) << line;
      if (eval.eval_accuracy) {
        EXPECT_EQ(std::strtod(raw_value(line, "eval_accuracy").c_str(), nullptr), *eval.eval_accuracy) << line;
      } else {
        EXPECT_EQ(raw_value(line, "eval_accuracy"), "<absent>") << line;
      }
    } else {
      const StepRecord& step = steps[step_index++];
      EXPECT_EQ(raw_value(line, "kind"), "\"train\"");
      EXPECT_EQ(raw_value(line, "step"), std::to_string(step.step));
      EXPECT_EQ(std::strtod(raw_value(line, "loss").c_str(), nullptr), step.loss) << line;
      EXPECT_EQ(std::strtod(raw_value(line, "lr").c_str(), nullptr), step.lr) << line;
      EXPECT_EQ(std::strtod(raw_value(line, "ms_per_step").c_str(), nullptr), step.ms_per_step) << line;
      EXPECT_EQ(raw_value(line, "skipped"), step.skipped ? "true" : "false") << line;
      if (step.samples_per_s) {
        EXPECT_EQ(std::strtod(raw_value(line, "samples_per_s").c_str(), nullptr), *step.samples_per_s) << line;
      } else {
        EXPECT_EQ(raw_value(line, "samples_per_s"), "<absent>") << line;
      }
      EXPECT_EQ(raw_value(line, "non_finite"), "<absent>") << line;
    }
  }
  // One Katib line per record, in the same order.
  ASSERT_EQ(katib.size(), lines.size());
}

TEST(MetricsWriter, NonFiniteValuesAreNullAndMarked) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  ScratchDir dir;
  const std::string path = dir.file("metrics.jsonl");
  std::vector<std::string> katib;
  StepRecord step = random_step(rng, 7);
  step.loss = std::numeric_limits<double>::quiet_NaN();
  step.grad_norm = std::numeric_limits<double>::infinity();
  step.samples_per_s = 1234.5;
  step.skipped = true;
  step.extra.clear();
  const EvalRecord eval{7, -std::numeric_limits<double>::infinity(), 0.5, std::nullopt};
  {
    io::MetricsWriter writer({.path = path, .katib = [&](std::string_view line) { katib.emplace_back(line); }});
    writer.log_step(step);
    writer.log_eval(eval);
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  for (const std::string& line : lines) {
    EXPECT_EQ(line.find("nan"), std::string::npos) << line;
    EXPECT_EQ(line.find("inf"), std::string::npos) << line;
    EXPECT_EQ(line.find("NaN"), std::string::npos) << line;
    EXPECT_EQ(line.find("Infinity"), std::string::npos) << line;
    EXPECT_EQ(raw_value(line, "non_finite"), "true") << line;
  }
  EXPECT_EQ(raw_value(lines[0], "loss"), "null");
  EXPECT_EQ(raw_value(lines[0], "grad_norm"), "null");
  EXPECT_EQ(std::strtod(raw_value(lines[0], "samples_per_s").c_str(), nullptr), 1234.5);
  EXPECT_EQ(raw_value(lines[1], "eval_loss"), "null");

  const io::MetricsLog log = io::read_metrics(path);
  ASSERT_EQ(log.steps.size(), 1u);
  EXPECT_TRUE(std::isnan(log.steps[0].loss));
  ASSERT_TRUE(log.steps[0].grad_norm.has_value());  // present, but not a number
  EXPECT_TRUE(std::isnan(*log.steps[0].grad_norm));
  EXPECT_EQ(log.steps[0].lr, step.lr);
  ASSERT_EQ(log.evals.size(), 1u);
  EXPECT_TRUE(std::isnan(log.evals[0].eval_loss));
  EXPECT_EQ(log.evals[0].eval_accuracy, 0.5);

  // Katib gets no value it cannot parse: the non-finite ones are left out.
  ASSERT_EQ(katib.size(), 2u);
  const auto step_metrics = katib_parse(katib[0]);
  EXPECT_EQ(step_metrics.count("loss"), 0u) << katib[0];
  EXPECT_EQ(step_metrics.count("grad_norm"), 0u) << katib[0];
  EXPECT_EQ(step_metrics.at("non_finite"), "1") << katib[0];
  EXPECT_EQ(step_metrics.at("skipped"), "1") << katib[0];
  const auto eval_metrics = katib_parse(katib[1]);
  EXPECT_EQ(eval_metrics.count("eval_loss"), 0u) << katib[1];
  EXPECT_EQ(eval_metrics.at("eval_accuracy"), "0.5") << katib[1];
}

TEST(MetricsWriter, KatibLinesMatchKatibsParser) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  for (int trial = 0; trial < 200; ++trial) {
    StepRecord step = random_step(rng, trial);
    const std::string line = io::step_katib_line(step);
    SCOPED_TRACE(line);
    // Every space-separated token is exactly one name=value the filter matches whole.
    std::istringstream tokens(line);
    for (std::string token; tokens >> token;) {
      std::smatch match;
      ASSERT_TRUE(std::regex_match(token, match, kKatibFilter)) << token;
      ASSERT_FALSE(match[2].str().empty()) << token;
    }
    const auto metrics = katib_parse(line);
    auto expect_value = [&](const std::string& name, double expected) {
      ASSERT_EQ(metrics.count(name), 1u) << name;
      const double value = std::strtod(metrics.at(name).c_str(), nullptr);
      // Six significant digits.
      EXPECT_LE(std::abs(value - expected), 5e-6 * std::abs(expected)) << name << "=" << metrics.at(name);
    };
    EXPECT_EQ(metrics.at("step"), std::to_string(step.step));
    expect_value("loss", step.loss);
    expect_value("lr", step.lr);
    expect_value("ms_per_step", step.ms_per_step);
    if (step.samples_per_s) expect_value("samples_per_s", *step.samples_per_s);
    if (step.tokens_per_s) expect_value("tokens_per_s", *step.tokens_per_s);
    if (step.grad_norm) expect_value("grad_norm", *step.grad_norm);
    for (const auto& [name, value] : step.extra) expect_value(name, value);
    EXPECT_EQ(metrics.count("skipped"), step.skipped ? 1u : 0u);

    const EvalRecord eval{trial, random_double(rng), std::uniform_real_distribution<double>(0, 1)(rng), std::nullopt};
    const std::string eval_line = io::eval_katib_line(eval);
    const auto eval_metrics = katib_parse(eval_line);
    ASSERT_EQ(eval_metrics.size(), 2u) << eval_line;  // eval_loss and eval_accuracy, nothing else
    EXPECT_LE(std::abs(std::strtod(eval_metrics.at("eval_loss").c_str(), nullptr) - eval.eval_loss),
              5e-6 * std::abs(eval.eval_loss))
        << eval_line;
  }
  // The form in the task's example.
  EXPECT_EQ(io::step_katib_line({.step = 100, .loss = 0.4213, .lr = 0.001, .ms_per_step = 23.6}),
            "step=100 epoch=0 loss=0.4213 lr=0.001 ms_per_step=23.6");
}

TEST(MetricsWriter, StringsAreEscaped) {
  ScratchDir dir;
  const std::string path = dir.file("metrics.jsonl");
  const std::vector<std::pair<std::string, std::string>> fields{{"model", "gpt \"small\""},
                                                                {"config", "C:\\runs\\a.toml"},
                                                                {"note", "two\nlines\tand a \x01 control, caf\xc3\xa9"},
                                                                {"weird \"key\"", "/slash/"}};
  {
    io::MetricsWriter writer({.path = path, .katib = nullptr});
    writer.log_run(fields);
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 1u);  // the newline inside a value is escaped
  EXPECT_NE(lines[0].find(R"("model":"gpt \"small\"")"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(R"(\u0001)"), std::string::npos) << lines[0];
  const io::MetricsLog log = io::read_metrics(path);
  EXPECT_EQ(log.run, fields);

  // The parser's own escapes, including a surrogate pair.
  const auto parsed = io::parse_flat_json_object(R"({"a":"\u00e9\/\ud83d\ude00\b\f\r", "b" : -0.5e+2 , "c":null})");
  ASSERT_EQ(parsed.size(), 3u);
  EXPECT_EQ(std::get<std::string>(parsed[0].value), "\xc3\xa9/\xf0\x9f\x98\x80\b\f\r");
  EXPECT_EQ(std::get<double>(parsed[1].value), -50.0);
  EXPECT_TRUE(std::holds_alternative<std::nullptr_t>(parsed[2].value));
}

TEST(MetricsWriter, EveryLineIsOnDiskWhenLogged) {
  ScratchDir dir;
  const std::string path = dir.file("metrics.jsonl");
  io::MetricsWriter writer({.path = path, .katib = nullptr});
  for (int64_t step = 1; step <= 3; ++step) {
    writer.log_step({.step = step, .loss = 1.0 / double(step), .lr = 0.1, .ms_per_step = 2});
    // Read through another handle while the writer is still open.
    const auto lines = read_lines(path);
    ASSERT_EQ(lines.size(), size_t(step));
    EXPECT_EQ(raw_value(lines.back(), "step"), std::to_string(step));
  }
}

TEST(MetricsWriter, AppendKeepsEarlierLines) {
  ScratchDir dir;
  const std::string path = dir.file("metrics.jsonl");
  { io::MetricsWriter({.path = path, .katib = nullptr}).log_step({.step = 1, .loss = 3.0}); }
  { io::MetricsWriter({.path = path, .append = true, .katib = nullptr}).log_step({.step = 2, .loss = 2.0}); }
  EXPECT_EQ(io::read_metrics(path).steps.size(), 2u);
  { io::MetricsWriter({.path = path, .katib = nullptr}).log_step({.step = 3, .loss = 1.0}); }
  const auto log = io::read_metrics(path);
  ASSERT_EQ(log.steps.size(), 1u);
  EXPECT_EQ(log.steps[0].step, 3);
}

TEST(MetricsWriter, DisabledAndStdoutOnlyWriters) {
  io::MetricsWriter off;
  EXPECT_FALSE(off.enabled());
  off.log_step({.step = 1, .loss = 1.0});  // nothing, no error

  std::vector<std::string> katib;
  io::MetricsWriter katib_only({.katib = [&](std::string_view line) { katib.emplace_back(line); }});
  EXPECT_TRUE(katib_only.enabled());
  katib_only.log_step({.step = 5, .loss = 0.25, .lr = 0.5, .ms_per_step = 4});
  katib_only.log_eval({.step = 5, .eval_loss = 0.125, .eval_accuracy = 0.75});
  ASSERT_EQ(katib.size(), 2u);
  EXPECT_EQ(katib_parse(katib[0]).at("loss"), "0.25");
  EXPECT_EQ(katib[1], "eval_loss=0.125 eval_accuracy=0.75");
}

TEST(MetricsWriter, ExtraMetricNamesAreChecked) {
  StepRecord step{.step = 1, .loss = 1.0};
  step.extra = {{"has space", 1.0}};
  EXPECT_THROW(io::step_json_line(step), Error);
  step.extra = {{"loss", 1.0}};
  EXPECT_THROW(io::step_json_line(step), Error);
  step.extra = {{"aux-loss_2", 1.0}};
  EXPECT_NO_THROW(io::step_json_line(step));
  step.extra = {{"aux", 1.0}, {"aux", 2.0}};  // a line the reader would refuse ("a second key")
  EXPECT_THROW(io::step_json_line(step), Error);
}

// The writer writes JSON as the reader's library (nlohmann::json) does: each
// line of tricky values (NaN, infinities, -0, the largest and smallest
// doubles, strings with quotes, backslashes, control characters, UTF-8 and
// invalid UTF-8) parses and dumps back to the same bytes, with the record's
// values in the documented order; a line of strings only is byte for byte
// what escaping each key and value alone (io::json_string) and joining them
// by hand gives, as the writer did before it used the library.
TEST(MetricsWriter, LinesAreWhatTheJsonLibraryWrites) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const double tiny = std::numeric_limits<double>::denorm_min(), huge = std::numeric_limits<double>::max();
  const StepRecord step{.step = 3,
                        .total_steps = 10,
                        .loss = nan,
                        .lr = 3e-4,
                        .ms_per_step = 12.0,
                        .samples_per_s = -0.0,
                        .tokens_per_s = 1e16,
                        .grad_norm = -inf,
                        .loss_scale = 65536.0,
                        .skipped = true,
                        .epoch = 2,
                        .extra = {{"tiny", tiny}, {"huge", huge}, {"third", 1.0 / 3.0}, {"small", 1e-5}}};
  const EvalRecord eval{.step = 3, .eval_loss = inf, .eval_accuracy = 0.0, .eval_bits_per_byte = 0.1};
  const std::vector<std::pair<std::string, std::string>> run{
      {"model", "gpt \"small\""},
      {"config", "C:\\runs\\a.toml"},
      {"note", "two\nlines\tand \x01 \x1f \x7f caf\xc3\xa9 \xf0\x9f\x98\x80"},
      {"host", "bad\xff\xfe utf-8"},
      {"k\"ey/", "/"}};
  ScratchDir dir;
  const std::string path = dir.file("metrics.jsonl");
  {
    io::MetricsWriter writer({.path = path, .katib = nullptr, .wall_time = false});
    writer.log_step(step);
    writer.log_eval(eval);
    writer.log_run(run);
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  std::vector<nlohmann::ordered_json> parsed;
  for (const std::string& line : lines) {
    parsed.push_back(nlohmann::ordered_json::parse(line));
    EXPECT_EQ(parsed.back().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), line);
  }

  const auto keys = [](const nlohmann::ordered_json& object) {
    std::vector<std::string> out;
    for (const auto& item : object.items()) out.push_back(item.key());
    return out;
  };
  const auto same_double = [](const nlohmann::ordered_json& value, double expected) {
    const double actual = value.get<double>();
    return std::memcmp(&actual, &expected, sizeof actual) == 0;
  };
  const nlohmann::ordered_json& train = parsed[0];
  EXPECT_EQ(keys(train), (std::vector<std::string>{"kind", "step", "total_steps", "epoch", "loss", "lr", "ms_per_step",
                                                   "samples_per_s", "tokens_per_s", "grad_norm", "loss_scale",
                                                   "skipped", "tiny", "huge", "third", "small", "non_finite"}));
  EXPECT_EQ(train["kind"], "train");
  EXPECT_EQ(train["step"], 3);
  EXPECT_EQ(train["total_steps"], 10);
  EXPECT_EQ(train["epoch"], 2);
  EXPECT_TRUE(train["loss"].is_null());
  EXPECT_TRUE(train["grad_norm"].is_null());
  EXPECT_EQ(train["skipped"], true);
  EXPECT_EQ(train["non_finite"], true);
  EXPECT_TRUE(same_double(train["lr"], step.lr)) << train["lr"];
  EXPECT_TRUE(same_double(train["ms_per_step"], step.ms_per_step)) << train["ms_per_step"];
  EXPECT_TRUE(same_double(train["samples_per_s"], *step.samples_per_s)) << train["samples_per_s"];  // -0
  EXPECT_TRUE(same_double(train["tokens_per_s"], *step.tokens_per_s)) << train["tokens_per_s"];
  EXPECT_TRUE(same_double(train["loss_scale"], *step.loss_scale)) << train["loss_scale"];
  for (const auto& [name, value] : step.extra) EXPECT_TRUE(same_double(train[name], value)) << name << train[name];

  const nlohmann::ordered_json& evaluation = parsed[1];
  EXPECT_EQ(keys(evaluation), (std::vector<std::string>{"kind", "step", "eval_loss", "eval_accuracy",
                                                        "eval_bits_per_byte", "non_finite"}));
  EXPECT_TRUE(evaluation["eval_loss"].is_null());
  EXPECT_TRUE(same_double(evaluation["eval_accuracy"], 0.0));
  EXPECT_TRUE(same_double(evaluation["eval_bits_per_byte"], 0.1));

  std::string by_hand = "{" + io::json_string("kind") + ":" + io::json_string("run");
  for (const auto& [key, value] : run) by_hand += "," + io::json_string(key) + ":" + io::json_string(value);
  EXPECT_EQ(lines[2], by_hand + "}");
  for (size_t i = 0; i < run.size(); ++i) {
    const std::string& value = run[i].second;
    if (run[i].first == "host")
      EXPECT_EQ(parsed[2]["host"], "bad\xef\xbf\xbd\xef\xbf\xbd utf-8");  // each invalid byte as U+FFFD
    else
      EXPECT_EQ(parsed[2][run[i].first], value);
  }
  EXPECT_EQ(io::read_metrics(path).run.size(), run.size());
}

TEST(MetricsWriter, UnwritablePathNamesTheFile) {
  ScratchDir dir;
  const std::string blocker = dir.file("not_a_directory");
  write_text(blocker, "x");
  const std::string path = blocker + "/metrics.jsonl";
  try {
    io::MetricsWriter writer({.path = path});
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("not_a_directory"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("--metrics"), std::string::npos) << error.what();
  }
}

TEST(ReadMetrics, ErrorsNameTheFileAndLine) {
  ScratchDir dir;
  const std::string missing = dir.file("missing.jsonl");
  try {
    io::read_metrics(missing);
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find(missing), std::string::npos) << error.what();
  }

  const std::string good = R"({"kind":"train","step":1,"loss":2.5,"lr":0.1,"ms_per_step":3})";
  struct Case {
    std::string bad_line;
    std::string expected;  // part of the message
  };
  const std::vector<Case> cases{
      {R"({"kind":"train","step":2,"loss":2.5,)", "line 3 column 37"},
      {R"({"kind":"train","step":2,"loss":nan})", "line 3 column 34"},  // where the reader gave up
      {R"({"kind":"train","step":2,"loss":01})", "line 3 column 34"},
      {R"({"kind":"train","step":2,"loss":1e999})", "a number a double can hold"},  // a fuzzer's find
      {R"({"kind":"train","step":2,"loss":{"a":1}})", "no nested values"},
      {R"({"kind":"train","step":2})", "needs \"loss\""},
      {R"({"kind":"train","step":2.5,"loss":1})", "\"step\" must be a whole number"},
      {R"({"kind":"train","step":2,"loss":"low"})", "\"loss\" is not a number"},
      {R"({"kind":"train","step":2,"step":3,"loss":1})", "second \"step\""},
      {R"({"kind":"eval","step":2})", "needs \"eval_loss\""},
      {R"([1,2])", "line 3 column 1"},
      {R"({"kind":"train","step":2,"loss":1} trailing)", "line 3 column 38"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.file("bad.jsonl");
    write_text(path, good + "\n\n" + c.bad_line + "\n" + good + "\n");  // line 2 is blank
    try {
      io::read_metrics(path);
      ADD_FAILURE() << "no throw for " << c.bad_line;
    } catch (const Error& error) {
      const std::string message = error.message();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find("line 3"), std::string::npos) << message;
      EXPECT_NE(message.find(c.expected), std::string::npos) << c.bad_line << "\n" << message;
    }
  }
}

TEST(ReadMetrics, CutOffLastLineIsSkippedWithAWarning) {
  ScratchDir dir;
  const std::string path = dir.file("crashed.jsonl");
  const std::string good = R"({"kind":"train","step":1,"loss":2.5,"lr":0.1,"ms_per_step":3})";
  write_text(path, good + "\n" + good.substr(0, 30));  // killed while writing line 2
  const io::MetricsLog log = io::read_metrics(path);
  EXPECT_EQ(log.steps.size(), 1u);
  ASSERT_EQ(log.warnings.size(), 1u);
  EXPECT_NE(log.warnings[0].find("line 2"), std::string::npos) << log.warnings[0];

  // The same text with its newline is a corrupt line, not a cut-off one.
  write_text(path, good + "\n" + good.substr(0, 30) + "\n");
  EXPECT_THROW(io::read_metrics(path), Error);
}

// ---------------------------------------------------------------------------
// Progress line
// ---------------------------------------------------------------------------

// Parses "M:SS", "H:MM:SS" or "Nd HH:MM:SS" back to seconds.
int64_t parse_duration(const std::string& text) {
  int64_t days = 0;
  std::string clock = text;
  if (const size_t d = text.find("d "); d != std::string::npos) {
    days = std::stoll(text.substr(0, d));
    clock = text.substr(d + 2);
  }
  std::vector<int64_t> parts;
  std::istringstream in(clock);
  for (std::string part; std::getline(in, part, ':');) parts.push_back(std::stoll(part));
  int64_t seconds = 0;
  for (const int64_t part : parts) seconds = seconds * 60 + part;
  return days * 86400 + seconds;
}

TEST(Progress, DurationsReadBack) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_int_distribution<int> exponent(0, 7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 2000; ++trial) {
    const double seconds = unit(rng) * std::pow(10.0, exponent(rng));
    const std::string text = io::format_duration(seconds);
    EXPECT_EQ(parse_duration(text), std::llround(seconds)) << seconds << " -> " << text;
    // Minutes and seconds always have two digits after the first field.
    const std::regex form(R"(((\d+d \d\d:\d\d)|(\d+:\d\d)|(\d+)):\d\d)");
    EXPECT_TRUE(std::regex_match(text, form)) << text;
  }
  EXPECT_EQ(io::format_duration(20), "0:20");
  EXPECT_EQ(io::format_duration(3723), "1:02:03");
  EXPECT_EQ(io::format_duration(-1), "?");
  EXPECT_EQ(io::format_duration(std::nan("")), "?");
}

TEST(Progress, RatesReadBackWithinTheirDigits) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 2000; ++trial) {
    const double rate = std::pow(10.0, unit(rng) * 11 - 1);  // 0.1 to 1e10
    const std::string text = io::format_rate(rate);
    double scale = 1;
    std::string number = text;
    if (const char suffix = text.back(); suffix == 'k' || suffix == 'M' || suffix == 'G') {
      scale = suffix == 'k' ? 1e3 : suffix == 'M' ? 1e6 : 1e9;
      number.pop_back();
    }
    EXPECT_LE(number.size(), 5u) << text;
    const double value = std::stod(number) * scale;
    // Two decimals below 10, whole numbers below 1e4, three significant digits above.
    const double allowed = rate < 10 ? 0.005 : rate < 1e4 ? 0.5 : 0.005 * rate;
    EXPECT_LE(std::abs(value - rate), allowed) << rate << " -> " << text;
  }
  EXPECT_EQ(io::format_rate(5423.2), "5423");
  EXPECT_EQ(io::format_rate(54230), "54.2k");
}

TEST(Progress, LineHasEveryField) {
  StepRecord record{
      .step = 120, .total_steps = 1000, .loss = 0.4213, .lr = 1e-3, .ms_per_step = 23.6, .samples_per_s = 5423.0};
  EXPECT_EQ(io::format_progress(record, 20.0),
            "step 120/1000 | loss 0.4213 | lr 1.0e-03 | 5423 samples/s | 23.6 ms/step | ETA 0:20");
  record.samples_per_s.reset();
  record.tokens_per_s = 1.5e6;
  record.skipped = true;
  record.loss = std::nan("");
  EXPECT_EQ(io::format_progress(record, std::nullopt),
            "step 120/1000 | loss nan | lr 1.0e-03 | 1.50M tokens/s | 23.6 ms/step | skipped");
  record.ms_per_step = 12345;
  record.total_steps = 0;
  EXPECT_EQ(io::format_progress(record, 3.0 * 86400 + 5),
            "step 120 | loss nan | lr 1.0e-03 | 1.50M tokens/s | 12.3 s/step | ETA 3d 00:00:05 | skipped");
  // A mixture of experts' figures (apps/expert_load.h): the dropped share only when some were dropped.
  record.skipped = false;
  record.extra = {{"moe_aux_loss", 0.020078}, {"moe_imbalance", 1.1636}, {"moe_dropped_fraction", 0.0}};
  EXPECT_EQ(io::format_progress(record, std::nullopt),
            "step 120 | loss nan | lr 1.0e-03 | 1.50M tokens/s | 12.3 s/step | moe aux 0.0201 imb 1.16");
  record.extra.back().second = 0.1171875;
  EXPECT_EQ(io::format_progress(record, std::nullopt),
            "step 120 | loss nan | lr 1.0e-03 | 1.50M tokens/s | 12.3 s/step | moe aux 0.0201 imb 1.16 drop 11.7%");
}

TEST(Progress, EtaIsAMovingAverageOfTimePerStep) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::uniform_real_distribution<double> duration(0.01, 0.5);
  std::uniform_int_distribution<int64_t> jump(1, 5);
  const double smoothing = 0.1;
  io::EtaEstimator estimator(smoothing);
  EXPECT_FALSE(estimator.eta(100).has_value());
  estimator.observe(0, 3.0);
  EXPECT_FALSE(estimator.eta(100).has_value());  // one point: no rate yet

  // Reference: the same average, one step at a time (a jump of k steps of equal
  // length weighs as k single steps).
  std::optional<double> reference;
  double now = 3.0;
  int64_t step = 0;
  for (int i = 0; i < 200; ++i) {
    const int64_t k = jump(rng);
    const double per_step = duration(rng);
    for (int64_t j = 0; j < k; ++j) reference = reference ? *reference + smoothing * (per_step - *reference) : per_step;
    now += per_step * double(k);
    step += k;
    estimator.observe(step, now);
    ASSERT_TRUE(estimator.seconds_per_step().has_value());
    EXPECT_NEAR(*estimator.seconds_per_step(), *reference, 1e-9 * *reference);
    const int64_t total = step + 100;
    EXPECT_NEAR(*estimator.eta(total), 100 * *reference, 1e-7 * *reference);
  }
  EXPECT_EQ(*estimator.eta(step - 3), 0.0);  // past the end: nothing left
  // A repeated or earlier step changes nothing.
  const double before = *estimator.seconds_per_step();
  estimator.observe(step, now + 100);
  estimator.observe(step - 2, now + 200);
  EXPECT_EQ(*estimator.seconds_per_step(), before);
}

std::string read_stream(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text += char(c);
  return text;
}

TEST(Progress, PlainLinesEveryInterval) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    io::ProgressLine progress({.interval = 10, .stream = file, .terminal = false});
    EXPECT_FALSE(progress.terminal());
    for (int64_t step = 1; step <= 35; ++step)
      progress.update({.step = step, .total_steps = 35, .loss = 1.0 / double(step), .lr = 0.1, .ms_per_step = 1});
    progress.print_above("eval_loss=0.5");
    progress.finish();
    progress.finish();
  }
  std::istringstream text(read_stream(file));
  std::vector<std::string> lines;
  for (std::string line; std::getline(text, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 5u);
  const int64_t expected_steps[] = {10, 20, 30, 35};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(lines[size_t(i)].rfind("step " + std::to_string(expected_steps[i]) + "/35 | loss ", 0), 0u)
        << lines[size_t(i)];
    EXPECT_EQ(lines[size_t(i)].find('\r'), std::string::npos);
  }
  EXPECT_EQ(lines[4], "eval_loss=0.5");
  std::fclose(file);

  // Stopped early: finish() prints the last step.
  file = std::tmpfile();
  {
    io::ProgressLine progress({.interval = 10, .stream = file, .terminal = false});
    for (int64_t step = 1; step <= 13; ++step) progress.update({.step = step, .total_steps = 100, .loss = 1.0});
  }
  const std::string stopped = read_stream(file);
  EXPECT_NE(stopped.find("step 10/100"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("step 13/100"), std::string::npos) << stopped;
  std::fclose(file);
}

TEST(Progress, TerminalRewritesOneLine) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    io::ProgressLine progress({.stream = file, .terminal = true});
    for (int64_t step = 1; step <= 50; ++step)
      progress.update({.step = step, .total_steps = 50, .loss = 0.5, .lr = 0.1, .ms_per_step = 1});
    progress.print_above("step=50 loss=0.5");
    progress.finish();
  }
  const std::string text = read_stream(file);
  // The first step is drawn at once, the last always; between them at most ten redraws a second.
  EXPECT_EQ(text.rfind("\rstep 1/50 | ", 0), 0u) << text;
  EXPECT_NE(text.find("\rstep 50/50 | "), std::string::npos) << text;
  EXPECT_NE(text.find("\x1b[K"), std::string::npos);
  // The Katib line replaces the live line, which is drawn again below it; finish() ends it.
  EXPECT_NE(text.find("\r\x1b[Kstep=50 loss=0.5\n\rstep 50/50 | "), std::string::npos) << text;
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2);
  std::fclose(file);
}

TEST(Progress, DisabledShowsNothingButPrintsWholeLines) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    io::ProgressLine progress({.enabled = false, .interval = 1, .stream = file, .terminal = false});
    for (int64_t step = 1; step <= 5; ++step) progress.update({.step = step, .total_steps = 5, .loss = 1.0});
    progress.print_above("eval_loss=1");
  }
  EXPECT_EQ(read_stream(file), "eval_loss=1\n");
  std::fclose(file);
}

}  // namespace
}  // namespace tessera::testing
