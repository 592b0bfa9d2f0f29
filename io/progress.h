// Rank 0's live progress line. On a terminal one line is rewritten in place:
//   step 120/1000 | loss 0.4213 | lr 1.0e-03 | 5423 samples/s | 23.6 ms/step | ETA 0:20
// elsewhere (a log file, kubectl logs) the same text is printed as a plain
// line every `interval` steps. The ETA comes from an exponential moving
// average of the wall time per step. The formatting is pure and tested apart.
//
//   io::ProgressLine progress({.enabled = rank == 0, .interval = 50});
//   for (...) progress.update(record);
//   progress.finish();
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

#include "io/metrics.h"

namespace tessera::io {

// "0:20", "12:05", "1:02:03", "3d 04:05:06" (seconds rounded to the nearest);
// "?" for a negative or non-finite value.
std::string format_duration(double seconds);
// A rate with three or four significant digits: "7.25", "5423", "54.2k", "1.23M", "4.50G".
std::string format_rate(double per_second);
// A learning rate: "1.0e-03".
std::string format_lr(double lr);
// A loss: "0.4213", "12.3457", "nan", "inf".
std::string format_loss(double loss);
// "23.6 ms/step" below 10 s per step, otherwise "12.3 s/step".
std::string format_step_time(double ms_per_step);

// The progress text of one step (no newline, no carriage return):
// "step 120/1000 | loss 0.4213 | lr 1.0e-03 | 5423 samples/s | 23.6 ms/step | ETA 0:20".
// Tokens/s is shown when the record has it and no samples/s; "skipped" is
// appended for a skipped step; the ETA part is left out when unknown.
std::string format_progress(const StepRecord& record, std::optional<double> eta_seconds);

// Remaining time from an exponential moving average of seconds per step.
// Time is passed in, so it is testable without a clock.
class EtaEstimator {
 public:
  // smoothing: the weight of one new step in the average (0 < smoothing <= 1).
  explicit EtaEstimator(double smoothing = 0.05);
  // The run reached `step` at time `seconds` (any fixed origin). The first
  // call only sets the origin; later calls with a larger step update the average.
  void observe(int64_t step, double seconds);
  std::optional<double> seconds_per_step() const { return seconds_per_step_; }
  // Seconds until `total_steps` from the last observed step; nullopt before two observations.
  std::optional<double> eta(int64_t total_steps) const;

 private:
  double smoothing_;
  std::optional<int64_t> last_step_;
  double last_seconds_ = 0.0;
  std::optional<double> seconds_per_step_;
};

struct ProgressOptions {
  bool enabled = true;     // false on ranks other than 0: update() does nothing
  int64_t interval = 100;  // not a terminal: a plain line every `interval` steps
  std::FILE* stream = stdout;
  std::optional<bool> terminal{};  // default: whether `stream` is a terminal
};

class ProgressLine {
 public:
  explicit ProgressLine(ProgressOptions options = {});
  ~ProgressLine();  // finish()
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Shows the step (on a terminal at most ten redraws a second, plus the last step).
  void update(const StepRecord& record);
  // Prints a whole line (Katib metrics, a message) above the live line without
  // breaking it; prints even when the progress display is disabled. Use it as
  // MetricsOptions::katib: [&](std::string_view line) { progress.print_above(line); }.
  void print_above(std::string_view line);
  // Ends the live line (terminal) or prints the last step if its line is due
  // (not a terminal). Idempotent; update() afterwards starts a new line.
  void finish();

  bool terminal() const { return terminal_; }

 private:
  void draw();
  void write(std::string_view text);

  ProgressOptions options_;
  bool terminal_;
  EtaEstimator eta_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  std::optional<StepRecord> last_;  // the latest step given to update()
  bool last_shown_ = true;          // `last_` is on screen (or there is none)
  bool line_open_ = false;          // a terminal line without its newline
};

}  // namespace tessera::io
