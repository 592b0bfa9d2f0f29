// TraceWriter: buffered Chrome-trace events, appended to the rank's file so
// that it ends in a complete JSON document after every flush.
#include "io/trace.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "io/metrics.h"

namespace tessera::io {
namespace {

// What ends the file after every flush; the next flush writes over it.
constexpr std::string_view kTail = "\n]}\n";

int64_t floor_div_1000(int64_t ns) {
  return ns >= 0 ? ns / 1000 : -((-ns + 999) / 1000);
}

}  // namespace

std::string trace_path_for_rank(const std::string& path, int rank, int world_size) {
  if (world_size <= 1 || path.empty()) return path;
  const std::filesystem::path original(path);
  const std::string tag = ".rank" + std::to_string(rank);
  if (!original.has_extension()) return path + tag;
  std::filesystem::path renamed = original;
  renamed.replace_filename(original.stem().string() + tag + original.extension().string());
  return renamed.string();
}

TraceWriter::TraceWriter(TraceOptions options) : options_(std::move(options)) {
  if (options_.path.empty()) return;
  TESSERA_CHECK(options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size, "trace: rank ",
                options_.rank, " is not within a world of ", options_.world_size, " ranks");
  TESSERA_CHECK(options_.flush_every > 0, "trace: flush_every must be positive");
  path_ = trace_path_for_rank(options_.path, options_.rank, options_.world_size);
  const std::filesystem::path path(path_);
  if (path.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(path.parent_path(), error);
    TESSERA_CHECK(!error, "trace: cannot create the directory '", path.parent_path().string(),
                  "' for the trace: ", error.message(), "; choose a writable --trace path");
  }
  wall_origin_ns_ =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  steady_origin_ = std::chrono::steady_clock::now();

  file_.reset(std::fopen(path_.c_str(), "w"));
  TESSERA_CHECK(file_ != nullptr, "trace: cannot open '", path_, "' for writing: ", std::strerror(errno),
                "; choose a writable --trace path");
  const std::string header = "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" + std::to_string(options_.rank) +
                             ",\"world_size\":" + std::to_string(options_.world_size) + "},\"traceEvents\":[\n";
  const bool written = std::fwrite(header.data(), 1, header.size(), file_.get()) == header.size() &&
                       std::fwrite(kTail.data(), 1, kTail.size(), file_.get()) == kTail.size() &&
                       std::fflush(file_.get()) == 0;
  TESSERA_CHECK(written, "trace: writing '", path_, "' failed: ", std::strerror(errno));

  std::lock_guard lock(mutex_);
  threads_.push_back(std::this_thread::get_id());  // tid 0: the thread that opened the trace
  buffer_.push_back(Event{'M', "process_name", {}, 0, 0, 0, {}, "rank " + std::to_string(options_.rank)});
  buffer_.push_back(Event{'M', "process_sort_index", {}, 0, 0, 0, {{"sort_index", double(options_.rank)}}, {}});
  buffer_.push_back(Event{'M', "thread_name", {}, 0, 0, 0, {}, "main"});
}

TraceWriter::~TraceWriter() {
  try {
    close();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tessera: the trace '%s' may be incomplete: %s\n", path_.c_str(), error.what());
  }
}

int64_t TraceWriter::now_ns() const {
  if (!file_) return 0;
  if (options_.clock) return options_.clock();
  const auto since_open = std::chrono::steady_clock::now() - steady_origin_;
  return wall_origin_ns_ + std::chrono::duration_cast<std::chrono::nanoseconds>(since_open).count();
}

TraceWriter::Scope TraceWriter::scope(std::string_view name, std::string_view category) {
  Scope scope;
  if (!file_) return scope;
  scope.writer_ = this;
  scope.name_ = name;
  scope.category_ = category;
  scope.start_ns_ = now_ns();
  return scope;
}

TraceWriter::Scope& TraceWriter::Scope::operator=(Scope&& other) noexcept {
  if (this != &other) {
    end();
    writer_ = std::exchange(other.writer_, nullptr);
    start_ns_ = other.start_ns_;
    name_ = std::move(other.name_);
    category_ = std::move(other.category_);
    args_ = std::move(other.args_);
  }
  return *this;
}

TraceWriter::Scope& TraceWriter::Scope::arg(std::string_view key, double value) {
  if (writer_ != nullptr) args_.emplace_back(std::string(key), value);
  return *this;
}

void TraceWriter::Scope::end() {
  if (writer_ == nullptr) return;
  TraceWriter* writer = std::exchange(writer_, nullptr);
  writer->record(
      Event{'X', std::move(name_), std::move(category_), start_ns_, writer->now_ns(), 0, std::move(args_), {}});
}

void TraceWriter::complete(std::string_view name, std::string_view category, int64_t start_ns, int64_t end_ns) {
  if (!file_) return;
  record(Event{'X', std::string(name), std::string(category), start_ns, std::max(start_ns, end_ns), 0, {}, {}});
}

void TraceWriter::counter(std::string_view name, double value) {
  if (!file_ || !std::isfinite(value)) return;  // a counter track has no place for NaN
  const int64_t now = now_ns();
  record(Event{'C', std::string(name), {}, now, now, 0, {{std::string(name), value}}, {}});
}

void TraceWriter::set_thread_name(std::string_view name) {
  if (!file_) return;
  record(Event{'M', "thread_name", {}, 0, 0, 0, {}, std::string(name)});
}

int TraceWriter::thread_index() {
  const auto id = std::this_thread::get_id();
  const auto found = std::find(threads_.begin(), threads_.end(), id);
  if (found != threads_.end()) return int(found - threads_.begin());
  threads_.push_back(id);
  return int(threads_.size() - 1);
}

void TraceWriter::record(Event event) {
  std::lock_guard lock(mutex_);
  if (!file_) return;  // closed meanwhile
  event.tid = thread_index();
  buffer_.push_back(std::move(event));
  if (buffer_.size() >= options_.flush_every) {
    // Called from scope destructors, so it must not throw: a failure is kept
    // and reported by the next flush() or close().
    try {
      write_buffered();
    } catch (const std::exception& error) {
      if (deferred_error_.empty()) deferred_error_ = error.what();
      buffer_.clear();
    }
  }
}

std::string TraceWriter::event_json(const Event& event) const {
  std::string json = "{\"name\":" + json_string(event.name) + ",\"ph\":\"" + std::string(1, event.phase) + "\"";
  if (event.phase != 'M') {
    if (!event.category.empty()) json += ",\"cat\":" + json_string(event.category);
    const int64_t start_us = floor_div_1000(event.start_ns);
    json += ",\"ts\":" + std::to_string(start_us);
    // Both ends rounded down the same way, so a nested event stays inside its parent.
    if (event.phase == 'X') json += ",\"dur\":" + std::to_string(floor_div_1000(event.end_ns) - start_us);
  }
  json += ",\"pid\":" + std::to_string(options_.rank) + ",\"tid\":" + std::to_string(event.tid);
  if (event.phase == 'M' && event.args.empty()) {
    json += ",\"args\":{\"name\":" + json_string(event.label) + "}";
  } else if (!event.args.empty()) {
    json += ",\"args\":{";
    for (size_t i = 0; i < event.args.size(); ++i) {
      if (i > 0) json += ',';
      const double value = event.args[i].second;
      json += json_string(event.args[i].first) + ":" + (std::isfinite(value) ? json_number(value) : "null");
    }
    json += '}';
  }
  json += '}';
  return json;
}

void TraceWriter::write_buffered() {
  if (!file_ || buffer_.empty()) return;
  // Metadata first, then by start time, a parent before the children that start with it.
  std::stable_sort(buffer_.begin(), buffer_.end(), [](const Event& a, const Event& b) {
    if ((a.phase == 'M') != (b.phase == 'M')) return a.phase == 'M';
    if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
    return a.end_ns > b.end_ns;
  });
  std::string text;
  for (const Event& event : buffer_) {
    text += wrote_event_ ? ",\n" : "";
    text += event_json(event);
    wrote_event_ = true;
  }
  buffer_.clear();
  text += kTail;
  const bool written = std::fseek(file_.get(), -long(kTail.size()), SEEK_END) == 0 &&
                       std::fwrite(text.data(), 1, text.size(), file_.get()) == text.size() &&
                       std::fflush(file_.get()) == 0;
  TESSERA_CHECK(written, "trace: writing '", path_, "' failed: ", std::strerror(errno),
                "; check the disk has space and the file system is still mounted");
}

void TraceWriter::flush() {
  std::lock_guard lock(mutex_);
  TESSERA_CHECK(deferred_error_.empty(), "trace: an earlier write failed: ", deferred_error_);
  write_buffered();
}

void TraceWriter::close() {
  std::lock_guard lock(mutex_);
  if (!file_) return;
  std::string error = std::exchange(deferred_error_, {});
  try {
    write_buffered();
  } catch (const std::exception& write_error) {
    if (error.empty()) error = write_error.what();
  }
  const bool closed = std::fclose(file_.release()) == 0;
  if (!closed && error.empty()) error = "closing '" + path_ + "' failed: " + std::strerror(errno);
  TESSERA_CHECK(error.empty(), "trace: ", error);
}

}  // namespace tessera::io
