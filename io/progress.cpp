// The progress line: pure formatting helpers, the ETA average, and the
// terminal / plain-line display.
#include "io/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <cmath>

#include "core/error.h"

namespace tessera::io {
namespace {

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, value);
  return buffer;
}

// The terminal's width in columns, or 0 when unknown.
int terminal_columns(std::FILE* stream) {
  winsize size{};
  if (ioctl(fileno(stream), TIOCGWINSZ, &size) == 0) return size.ws_col;
  return 0;
}

constexpr auto kMinRedrawInterval = std::chrono::milliseconds(100);
constexpr std::string_view kEraseToEndOfLine = "\x1b[K";

}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto total = static_cast<int64_t>(std::llround(seconds));
  const int64_t days = total / 86400, hours = total / 3600 % 24, minutes = total / 60 % 60, secs = total % 60;
  char buffer[64];
  if (days > 0) {
    std::snprintf(buffer, sizeof(buffer), "%lldd %02lld:%02lld:%02lld", (long long)days, (long long)hours,
                  (long long)minutes, (long long)secs);
  } else if (hours > 0) {
    std::snprintf(buffer, sizeof(buffer), "%lld:%02lld:%02lld", (long long)hours, (long long)minutes, (long long)secs);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%lld:%02lld", (long long)minutes, (long long)secs);
  }
  return buffer;
}

std::string format_rate(double per_second) {
  if (!std::isfinite(per_second)) return std::isnan(per_second) ? "nan" : "inf";
  const double magnitude = std::abs(per_second);
  if (magnitude < 10) return printf_string("%.2f", per_second);
  if (magnitude < 1e4) return printf_string("%.0f", per_second);
  struct Unit {
    double scale;
    const char* suffix;
  };
  for (const Unit unit : {Unit{1e3, "k"}, Unit{1e6, "M"}, Unit{1e9, "G"}}) {
    const double scaled = per_second / unit.scale;
    if (std::abs(scaled) < 999.5 || unit.suffix[0] == 'G') {
      const char* format = std::abs(scaled) < 9.995 ? "%.2f" : std::abs(scaled) < 99.95 ? "%.1f" : "%.0f";
      return printf_string(format, scaled) + unit.suffix;
    }
  }
  return "?";  // unreachable: the last unit takes everything
}

std::string format_lr(double lr) {
  return printf_string("%.1e", lr);
}

std::string format_loss(double loss) {
  if (std::isnan(loss)) return "nan";
  if (std::isinf(loss)) return loss > 0 ? "inf" : "-inf";
  return printf_string("%.4f", loss);
}

std::string format_step_time(double ms_per_step) {
  if (ms_per_step >= 10000) return printf_string("%.1f", ms_per_step / 1000) + " s/step";
  return printf_string("%.1f", ms_per_step) + " ms/step";
}

namespace {

std::optional<double> extra_value(const StepRecord& record, std::string_view name) {
  for (const auto& [key, value] : record.extra)
    if (key == name) return value;
  return std::nullopt;
}

// A mixture of experts' figures (apps/expert_load.h): the load-balancing
// loss, the worst layer's imbalance and the share of choices dropped.
std::string format_experts(const StepRecord& record) {
  const std::optional<double> aux = extra_value(record, "moe_aux_loss"), imbalance = extra_value(record, "moe_imbalance");
  if (!aux || !imbalance) return "";
  std::string text = printf_string(" | moe aux %.3g", *aux) + printf_string(" imb %.2f", *imbalance);
  if (const auto dropped = extra_value(record, "moe_dropped_fraction"); dropped && *dropped > 0)
    text += printf_string(" drop %.1f%%", 100.0 * *dropped);
  return text;
}

}  // namespace

std::string format_progress(const StepRecord& record, std::optional<double> eta_seconds) {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, falsely) on "literal" + std::string temporaries.
  std::string text = "step ";
  text.append(std::to_string(record.step));
  if (record.total_steps > 0) text.append("/").append(std::to_string(record.total_steps));
  text.append(" | loss ").append(format_loss(record.loss));
  text.append(" | lr ").append(format_lr(record.lr));
  if (record.samples_per_s) {
    text.append(" | ").append(format_rate(*record.samples_per_s)).append(" samples/s");
  } else if (record.tokens_per_s) {
    text.append(" | ").append(format_rate(*record.tokens_per_s)).append(" tokens/s");
  }
  text.append(" | ").append(format_step_time(record.ms_per_step));
  text.append(format_experts(record));
  if (eta_seconds) text.append(" | ETA ").append(format_duration(*eta_seconds));
  if (record.skipped) text += " | skipped";
  return text;
}

EtaEstimator::EtaEstimator(double smoothing) : smoothing_(smoothing) {
  TESSERA_CHECK(smoothing > 0 && smoothing <= 1, "EtaEstimator: smoothing must be in (0, 1], got ", smoothing);
}

void EtaEstimator::observe(int64_t step, double seconds) {
  if (last_step_ && step > *last_step_) {
    const auto steps = double(step - *last_step_);
    const double per_step = (seconds - last_seconds_) / steps;
    if (!seconds_per_step_) {
      seconds_per_step_ = per_step;
    } else {
      // `steps` steps at once weigh as much as `steps` single-step updates.
      const double weight = 1.0 - std::pow(1.0 - smoothing_, steps);
      *seconds_per_step_ += weight * (per_step - *seconds_per_step_);
    }
  } else if (last_step_ && step <= *last_step_) {
    return;  // not forward (a repeated or restarted step): keep the origin
  }
  last_step_ = step;
  last_seconds_ = seconds;
}

std::optional<double> EtaEstimator::eta(int64_t total_steps) const {
  if (!seconds_per_step_ || !last_step_) return std::nullopt;
  return std::max(0.0, double(total_steps - *last_step_) * *seconds_per_step_);
}

ProgressLine::ProgressLine(ProgressOptions options)
    : options_(options),
      terminal_(options.terminal.value_or(options.stream != nullptr && isatty(fileno(options.stream)) == 1)),
      start_(std::chrono::steady_clock::now()) {
  TESSERA_CHECK(options_.stream != nullptr, "ProgressLine: the output stream is null");
  TESSERA_CHECK(options_.interval > 0, "ProgressLine: interval must be positive, got ", options_.interval,
                "; check --log-interval");
}

ProgressLine::~ProgressLine() {
  finish();
}

void ProgressLine::write(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), options_.stream);
  std::fflush(options_.stream);
}

void ProgressLine::update(const StepRecord& record) {
  if (!options_.enabled) return;
  const auto now = std::chrono::steady_clock::now();
  eta_.observe(record.step, std::chrono::duration<double>(now - start_).count());
  last_ = record;
  last_shown_ = false;
  const bool final_step = record.total_steps > 0 && record.step >= record.total_steps;
  if (terminal_) {
    if (!line_open_ || final_step || now - last_draw_ >= kMinRedrawInterval) {
      last_draw_ = now;
      draw();
    }
  } else if (record.step % options_.interval == 0 || final_step) {
    draw();
  }
}

void ProgressLine::draw() {
  if (!last_) return;
  std::string text = format_progress(*last_, last_->total_steps > 0 ? eta_.eta(last_->total_steps) : std::nullopt);
  if (terminal_) {
    // Longer than the terminal is wide would wrap, and \r would then rewrite only the last row.
    if (const int columns = terminal_columns(options_.stream); columns > 1 && int(text.size()) > columns - 1)
      text.resize(size_t(columns - 1));
    write(std::string("\r").append(text).append(kEraseToEndOfLine));
    line_open_ = true;
  } else {
    write(text + "\n");
  }
  last_shown_ = true;
}

void ProgressLine::print_above(std::string_view line) {
  if (terminal_ && line_open_) {
    write(std::string("\r").append(kEraseToEndOfLine).append(line).append("\n"));
    line_open_ = false;
    draw();  // the live line again, below
  } else {
    write(std::string(line) + "\n");
  }
}

void ProgressLine::finish() {
  if (!options_.enabled) return;
  if (terminal_) {
    if (last_ && !last_shown_) draw();
    if (line_open_) write("\n");
  } else if (last_ && !last_shown_) {
    draw();
  }
  line_open_ = false;
  last_.reset();
  last_shown_ = true;
}

}  // namespace tessera::io
