// Training metrics, written once and read back: MetricsWriter appends one flat
// JSON object per line (JSONL, flushed at once, so a crashed run keeps every
// line it logged) and prints Katib-style `name=value` lines, which Katib's
// StdOut metrics collector parses; read_metrics() reads such a file back (the
// plot command uses it). The schema is documented in io/METRICS.md.
//
//   io::MetricsWriter metrics({.path = "run/metrics.jsonl"});   // rank 0 only
//   metrics.log_step({.step = 100, .total_steps = 1000, .loss = 0.4213, .lr = 1e-3,
//                     .ms_per_step = 23.6, .samples_per_s = 5423.0});
//   metrics.log_eval({.step = 100, .eval_loss = 0.39, .eval_accuracy = 0.91});
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tessera::io {

// One logged training step. Throughput is per second over this step (or the
// interval the caller averaged over); a record has samples_per_s, tokens_per_s
// or both. Optional values are left out of the line when unset.
struct StepRecord {
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0.0;
  double lr = 0.0;
  double ms_per_step = 0.0;
  std::optional<double> samples_per_s{};
  std::optional<double> tokens_per_s{};
  std::optional<double> grad_norm{};   // before clipping
  std::optional<double> loss_scale{};  // dynamic loss scaling (f16)
  bool skipped = false;                // the optimizer step was skipped (non-finite gradients)
  int64_t epoch = 0;
  // More metrics ("aux_loss", ...): names of letters, digits, '_' and '-' (what
  // Katib's parser accepts), different from the standard keys.
  std::vector<std::pair<std::string, double>> extra{};
};

// One evaluation pass at `step`.
struct EvalRecord {
  int64_t step = 0;
  double eval_loss = 0.0;
  std::optional<double> eval_accuracy{};       // classification
  std::optional<double> eval_bits_per_byte{};  // language models over bytes
};

// ---------------------------------------------------------------------------
// Formatting (pure functions: the lines, and the numbers and strings of the
// other JSON writers: the trace, Prometheus, `tessera topo`)
// ---------------------------------------------------------------------------

// A finite number in JSON: the shortest text that reads back as the same
// double ("0.1", "1e-05", "12"). Non-finite values are the caller's business
// (the writer writes null).
std::string json_number(double value);
// A JSON string literal (nlohmann::json): quoted and escaped; invalid UTF-8 becomes U+FFFD.
std::string json_string(std::string_view text);
// A finite number as Katib's StdOut collector reads it: six significant digits,
// matching ([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?).
std::string katib_number(double value);

// The JSON line of a record, without the newline. `wall_time` is Unix seconds.
std::string step_json_line(const StepRecord& record, std::optional<double> wall_time = std::nullopt);
std::string eval_json_line(const EvalRecord& record, std::optional<double> wall_time = std::nullopt);
// The Katib lines: "step=100 loss=0.4213 lr=0.001 ...", "eval_loss=0.39 eval_accuracy=0.91".
// Non-finite values are left out and "non_finite=1" is added.
std::string step_katib_line(const StepRecord& record);
std::string eval_katib_line(const EvalRecord& record);

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

// Receives one whole line, without its newline.
using LineSink = std::function<void(std::string_view line)>;
// Writes the line and a newline to stdout and flushes.
LineSink stdout_line_sink();
// True when this process's stdout goes to Katib's StdOut metrics collector
// (its webhook redirects the training container's output into
// /var/log/katib/): then the Katib lines are printed without being asked.
bool stdout_read_by_katib();

struct MetricsOptions {
  std::string path{};                   // the JSONL file; empty: no file
  bool append = false;                  // keep an existing file's lines (a resumed run)
  LineSink katib = stdout_line_sink();  // Katib lines; empty: none
  bool wall_time = true;                // add "wall_time" (Unix seconds) to every line
};

class MetricsWriter {
 public:
  // Writes nothing: ranks other than 0.
  MetricsWriter() = default;
  // Opens (creating parent directories) or truncates options.path; throws
  // tessera::Error naming the path when it cannot.
  explicit MetricsWriter(MetricsOptions options);
  MetricsWriter(MetricsWriter&&) noexcept = default;
  MetricsWriter& operator=(MetricsWriter&&) noexcept = default;

  bool enabled() const { return file_ != nullptr || katib_ != nullptr; }
  const std::string& path() const { return options_.path; }

  // One line each, flushed before returning; throws tessera::Error naming the
  // file if the write fails (disk full, file system gone).
  void log_step(const StepRecord& record);
  void log_eval(const EvalRecord& record);
  // {"kind":"run", ...}: what the run is (model, config file, world size), as strings.
  void log_run(const std::vector<std::pair<std::string, std::string>>& fields);

 private:
  struct FileCloser {
    void operator()(std::FILE* file) const { std::fclose(file); }
  };
  void write_line(const std::string& line);
  std::optional<double> now() const;

  MetricsOptions options_;
  std::unique_ptr<std::FILE, FileCloser> file_;
  LineSink katib_;
};

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

// The values a flat JSON object may hold (metrics lines never nest).
using JsonScalar = std::variant<std::nullptr_t, bool, double, std::string>;
struct JsonField {
  std::string key;
  JsonScalar value;
};
// Parses a flat JSON object: {"key": number | string | true | false | null, ...}.
// Throws tessera::Error saying at which column the text stops being one.
std::vector<JsonField> parse_flat_json_object(std::string_view text);

struct MetricsLog {
  std::vector<StepRecord> steps;  // in file order; a null value reads as NaN
  std::vector<EvalRecord> evals;
  std::vector<std::pair<std::string, std::string>> run;  // the "run" lines' fields
  std::vector<std::string> warnings;                     // e.g. a cut-off last line, skipped
};

// Reads a metrics JSONL file. Throws tessera::Error naming the file (and the
// line and column) when it cannot be opened or a line is not a metrics record;
// a last line without its newline that does not parse (a run killed while
// writing it) is skipped with a warning instead.
MetricsLog read_metrics(const std::string& path);

}  // namespace tessera::io
