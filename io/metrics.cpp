// MetricsWriter (JSONL file + Katib stdout lines), the number and string
// formatting they share, and the reader behind read_metrics(): JSON written
// and read by nlohmann::json.
#include "io/metrics.h"

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/number_text.h"

namespace tessera::io {
namespace {

// Keys of the standard fields; extra metrics may not reuse them.
const std::set<std::string_view> kReservedKeys{
    "kind",          "step",          "total_steps",       "epoch",      "loss",    "lr",         "ms_per_step",
    "samples_per_s", "tokens_per_s",  "grad_norm",         "loss_scale", "skipped", "non_finite", "wall_time",
    "eval_loss",     "eval_accuracy", "eval_bits_per_byte"};

// One line of JSON: UTF-8 as it is, invalid UTF-8 (a path, a hostname) as
// U+FFFD rather than a line no JSON reader accepts.
std::string dump_json(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

bool is_metric_name(std::string_view name) {
  if (name.empty()) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// Builds one flat JSON object in nlohmann::json (keys in the order added, as
// the reader's parser reads them back); non-finite numbers become null and
// set "non_finite":true at the end.
class JsonLine {
 public:
  JsonLine& string(std::string_view key, std::string_view value) { return add(key, std::string(value)); }
  JsonLine& integer(std::string_view key, int64_t value) { return add(key, value); }
  JsonLine& boolean(std::string_view key, bool value) { return add(key, value); }
  JsonLine& number(std::string_view key, double value) {
    if (std::isfinite(value)) return add(key, value);
    non_finite_ = true;
    return add(key, nullptr);
  }
  std::string finish() {
    if (non_finite_) add("non_finite", true);
    return dump_json(object_);
  }

 private:
  JsonLine& add(std::string_view key, nlohmann::ordered_json value) {
    const std::string name(key);
    TESSERA_CHECK(!object_.contains(name), "metrics: '", name,
                  "' is given twice in one record; give each metric or run field once");
    object_[name] = std::move(value);
    return *this;
  }
  nlohmann::ordered_json object_ = nlohmann::ordered_json::object();
  bool non_finite_ = false;
};

// Builds one Katib line: "name=value" pairs separated by spaces.
class KatibLine {
 public:
  KatibLine& integer(std::string_view key, int64_t value) { return raw(key, std::to_string(value)); }
  KatibLine& number(std::string_view key, double value) {
    if (std::isfinite(value)) return raw(key, katib_number(value));
    non_finite_ = true;
    return *this;
  }
  std::string finish() {
    if (non_finite_) raw("non_finite", "1");
    return std::move(text_);
  }

 private:
  KatibLine& raw(std::string_view key, std::string_view value) {
    if (!text_.empty()) text_ += ' ';
    text_.append(key).append("=").append(value);
    return *this;
  }
  std::string text_;
  bool non_finite_ = false;
};

void check_extra(const StepRecord& record) {
  for (const auto& [key, value] : record.extra) {
    TESSERA_CHECK(is_metric_name(key), "metrics: extra metric name '", key,
                  "' must be letters, digits, '_' or '-' (Katib's parser reads no other names)");
    TESSERA_CHECK(!kReservedKeys.contains(key), "metrics: extra metric name '", key,
                  "' is a standard field; set the StepRecord/EvalRecord member instead or choose another name");
  }
}

// --- the flat JSON parser (nlohmann::json, then the shape metrics lines have) ---

struct ParseError {
  size_t column;  // 1-based
  std::string what;
};

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1, column 5: " prefix.
std::string parse_error_text(const nlohmann::json::parse_error& error) {
  const std::string what = error.what();
  const size_t colon = what.find(": ", what.find("column"));
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

JsonScalar scalar_of(const std::string& key, const nlohmann::ordered_json& value) {
  if (value.is_null()) return nullptr;
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number()) return value.get<double>();
  if (value.is_string()) return value.get<std::string>();
  throw ParseError{1,
                   "a number, string, true, false or null for \"" + key + "\" (metrics lines hold no nested values)"};
}

// One flat JSON object: {"key": number | string | true | false | null, ...},
// keys once each (in file order; nlohmann keeps one of repeated keys, a callback sees them all).
std::vector<JsonField> parse_object(std::string_view text) {
  std::set<std::string> keys;
  std::string repeated;
  const auto note_keys = [&](int depth, nlohmann::ordered_json::parse_event_t event, nlohmann::ordered_json& parsed) {
    if (event == nlohmann::ordered_json::parse_event_t::key && depth == 1 &&
        !keys.insert(parsed.get<std::string>()).second && repeated.empty())
      repeated = parsed.get<std::string>();
    return true;
  };
  nlohmann::ordered_json object;
  try {
    object = nlohmann::ordered_json::parse(text.begin(), text.end(), note_keys);
  } catch (const nlohmann::json::parse_error& error) {
    throw ParseError{error.byte == 0 ? 1 : error.byte, parse_error_text(error)};
  } catch (const nlohmann::json::exception& error) {  // a number too large for a double (out_of_range.406)
    const std::string what = error.what();
    throw ParseError{1, "a number a double can hold (" + what.substr(what.find(']') + 2) + ")"};
  }
  if (!object.is_object())
    throw ParseError{text.find_first_not_of(" \t\r\n") + 1, "'{' (a metrics line is one JSON object)"};
  if (!repeated.empty())
    throw ParseError{text.find("\"" + repeated + "\"") + 1, "a new key, not a second \"" + repeated + "\""};
  std::vector<JsonField> fields;
  for (const auto& [key, value] : object.items()) fields.push_back({key, scalar_of(key, value)});
  return fields;
}

// --- reading records out of parsed lines ---------------------------------------

struct LineError {
  std::string what;
};

const JsonScalar* find(const std::vector<JsonField>& fields, std::string_view key) {
  for (const auto& field : fields)
    if (field.key == key) return &field.value;
  return nullptr;
}

// A number or null (NaN); absent: nullopt.
std::optional<double> get_number(const std::vector<JsonField>& fields, std::string_view key) {
  const JsonScalar* value = find(fields, key);
  if (value == nullptr) return std::nullopt;
  if (std::holds_alternative<std::nullptr_t>(*value)) return std::nan("");
  if (const double* number = std::get_if<double>(value)) return *number;
  throw LineError{"\"" + std::string(key) + "\" is not a number"};
}

double require_number(const std::vector<JsonField>& fields, std::string_view key, std::string_view kind) {
  const auto value = get_number(fields, key);
  if (!value) throw LineError{"a " + std::string(kind) + " line needs \"" + std::string(key) + "\""};
  return *value;
}

std::optional<int64_t> get_integer(const std::vector<JsonField>& fields, std::string_view key) {
  const auto value = get_number(fields, key);
  if (!value) return std::nullopt;
  if (!(std::nearbyint(*value) == *value && std::abs(*value) < 9.0e15))
    throw LineError{"\"" + std::string(key) + "\" must be a whole number"};
  return int64_t(*value);
}

StepRecord step_from(const std::vector<JsonField>& fields) {
  StepRecord record;
  const auto step = get_integer(fields, "step");
  if (!step) throw LineError{"a train line needs \"step\""};
  record.step = *step;
  record.loss = require_number(fields, "loss", "train");
  record.lr = get_number(fields, "lr").value_or(0.0);
  record.ms_per_step = get_number(fields, "ms_per_step").value_or(0.0);
  record.total_steps = get_integer(fields, "total_steps").value_or(0);
  record.epoch = get_integer(fields, "epoch").value_or(0);
  record.samples_per_s = get_number(fields, "samples_per_s");
  record.tokens_per_s = get_number(fields, "tokens_per_s");
  record.grad_norm = get_number(fields, "grad_norm");
  record.loss_scale = get_number(fields, "loss_scale");
  if (const JsonScalar* skipped = find(fields, "skipped")) {
    const bool* flag = std::get_if<bool>(skipped);
    if (flag == nullptr) throw LineError{"\"skipped\" must be true or false"};
    record.skipped = *flag;
  }
  for (const auto& field : fields) {
    if (kReservedKeys.contains(field.key)) continue;
    if (std::holds_alternative<double>(field.value) || std::holds_alternative<std::nullptr_t>(field.value))
      record.extra.emplace_back(field.key, *get_number(fields, field.key));
  }
  return record;
}

EvalRecord eval_from(const std::vector<JsonField>& fields) {
  EvalRecord record;
  const auto step = get_integer(fields, "step");
  if (!step) throw LineError{"an eval line needs \"step\""};
  record.step = *step;
  record.eval_loss = require_number(fields, "eval_loss", "eval");
  record.eval_accuracy = get_number(fields, "eval_accuracy");
  record.eval_bits_per_byte = get_number(fields, "eval_bits_per_byte");
  return record;
}

// Adds the record a parsed line holds; lines of other kinds are ignored.
void add_record(MetricsLog& log, const std::vector<JsonField>& fields) {
  std::string kind;
  if (const JsonScalar* value = find(fields, "kind")) {
    const std::string* text = std::get_if<std::string>(value);
    if (text == nullptr) throw LineError{"\"kind\" must be a string"};
    kind = *text;
  } else if (find(fields, "eval_loss") != nullptr) {  // lines written without "kind"
    kind = "eval";
  } else {
    kind = "train";
  }
  if (kind == "train") {
    log.steps.push_back(step_from(fields));
  } else if (kind == "eval") {
    log.evals.push_back(eval_from(fields));
  } else if (kind == "run") {
    for (const auto& field : fields) {
      if (field.key == "kind") continue;
      if (const std::string* text = std::get_if<std::string>(&field.value)) log.run.emplace_back(field.key, *text);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------

std::string json_number(double value) {
  return shortest_text(value);
}

std::string json_string(std::string_view text) {
  return dump_json(nlohmann::ordered_json(std::string(text)));
}

std::string katib_number(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::general, 6);
  return std::string(buffer, result.ptr);
}

std::string step_json_line(const StepRecord& record, std::optional<double> wall_time) {
  check_extra(record);
  JsonLine line;
  line.string("kind", "train").integer("step", record.step);
  if (record.total_steps > 0) line.integer("total_steps", record.total_steps);
  line.integer("epoch", record.epoch).number("loss", record.loss).number("lr", record.lr);
  line.number("ms_per_step", record.ms_per_step);
  if (record.samples_per_s) line.number("samples_per_s", *record.samples_per_s);
  if (record.tokens_per_s) line.number("tokens_per_s", *record.tokens_per_s);
  if (record.grad_norm) line.number("grad_norm", *record.grad_norm);
  if (record.loss_scale) line.number("loss_scale", *record.loss_scale);
  line.boolean("skipped", record.skipped);
  for (const auto& [key, value] : record.extra) line.number(key, value);
  if (wall_time) line.number("wall_time", *wall_time);
  return line.finish();
}

std::string eval_json_line(const EvalRecord& record, std::optional<double> wall_time) {
  JsonLine line;
  line.string("kind", "eval").integer("step", record.step).number("eval_loss", record.eval_loss);
  if (record.eval_accuracy) line.number("eval_accuracy", *record.eval_accuracy);
  if (record.eval_bits_per_byte) line.number("eval_bits_per_byte", *record.eval_bits_per_byte);
  if (wall_time) line.number("wall_time", *wall_time);
  return line.finish();
}

std::string step_katib_line(const StepRecord& record) {
  check_extra(record);
  KatibLine line;
  line.integer("step", record.step).integer("epoch", record.epoch);
  line.number("loss", record.loss).number("lr", record.lr).number("ms_per_step", record.ms_per_step);
  if (record.samples_per_s) line.number("samples_per_s", *record.samples_per_s);
  if (record.tokens_per_s) line.number("tokens_per_s", *record.tokens_per_s);
  if (record.grad_norm) line.number("grad_norm", *record.grad_norm);
  if (record.loss_scale) line.number("loss_scale", *record.loss_scale);
  if (record.skipped) line.integer("skipped", 1);
  for (const auto& [key, value] : record.extra) line.number(key, value);
  return line.finish();
}

std::string eval_katib_line(const EvalRecord& record) {
  KatibLine line;
  line.number("eval_loss", record.eval_loss);
  if (record.eval_accuracy) line.number("eval_accuracy", *record.eval_accuracy);
  if (record.eval_bits_per_byte) line.number("eval_bits_per_byte", *record.eval_bits_per_byte);
  return line.finish();
}

bool stdout_read_by_katib() {
  std::error_code error;
  const std::filesystem::path target = std::filesystem::read_symlink("/proc/self/fd/1", error);
  return !error && target.string().rfind("/var/log/katib/", 0) == 0;
}

LineSink stdout_line_sink() {
  return [](std::string_view line) {
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  };
}

MetricsWriter::MetricsWriter(MetricsOptions options) : options_(std::move(options)) {
  katib_ = std::move(options_.katib);
  options_.katib = nullptr;
  if (options_.path.empty()) return;
  const std::filesystem::path path(options_.path);
  if (path.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(path.parent_path(), error);
    TESSERA_CHECK(!error, "metrics: cannot create the directory '", path.parent_path().string(),
                  "' for the metrics file: ", error.message(), "; choose a writable --metrics path");
  }
  file_.reset(std::fopen(options_.path.c_str(), options_.append ? "a" : "w"));
  TESSERA_CHECK(file_ != nullptr, "metrics: cannot open '", options_.path, "' for writing: ", std::strerror(errno),
                "; choose a writable --metrics path");
}

std::optional<double> MetricsWriter::now() const {
  if (!options_.wall_time) return std::nullopt;
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  // Milliseconds are plenty, and keep the lines short.
  return double(std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count()) / 1000.0;
}

void MetricsWriter::write_line(const std::string& line) {
  if (!file_) return;
  std::string text = line;
  text += '\n';
  const bool written = std::fwrite(text.data(), 1, text.size(), file_.get()) == text.size();
  const bool flushed = std::fflush(file_.get()) == 0;
  TESSERA_CHECK(written && flushed, "metrics: writing '", options_.path, "' failed: ", std::strerror(errno),
                "; check the disk has space and the file system is still mounted");
}

void MetricsWriter::log_step(const StepRecord& record) {
  if (!enabled()) return;
  write_line(step_json_line(record, now()));
  if (katib_) katib_(step_katib_line(record));
}

void MetricsWriter::log_eval(const EvalRecord& record) {
  if (!enabled()) return;
  write_line(eval_json_line(record, now()));
  if (katib_) katib_(eval_katib_line(record));
}

void MetricsWriter::log_run(const std::vector<std::pair<std::string, std::string>>& fields) {
  if (!file_) return;
  JsonLine line;
  line.string("kind", "run");
  for (const auto& [key, value] : fields) {
    TESSERA_CHECK(key != "kind" && key != "wall_time", "metrics: run field '", key, "' is reserved; rename it");
    line.string(key, value);
  }
  if (const auto time = now()) line.number("wall_time", *time);
  write_line(line.finish());
}

std::vector<JsonField> parse_flat_json_object(std::string_view text) {
  try {
    return parse_object(text);
  } catch (const ParseError& error) {
    TESSERA_THROW("not a flat JSON object at column ", error.column, ": ", error.what);
  }
}

MetricsLog read_metrics(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.is_open(), "metrics: cannot open '", path, "': ", std::strerror(errno),
                "; pass the metrics.jsonl a training run wrote (its --metrics path)");
  MetricsLog log;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    const bool has_newline = !in.eof();
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::vector<JsonField> fields;
    try {
      fields = parse_object(line);
    } catch (const ParseError& error) {
      if (!has_newline && in.peek() == std::char_traits<char>::eof()) {
        log.warnings.push_back(path + " line " + std::to_string(number) +
                               ": skipped a cut-off last line (the run was stopped while writing it)");
        break;
      }
      TESSERA_THROW("metrics: ", path, " line ", number, " column ", error.column, ": ", error.what,
                    "; every line must be one JSON object as io/METRICS.md describes");
    }
    try {
      add_record(log, fields);
    } catch (const LineError& error) {
      TESSERA_THROW("metrics: ", path, " line ", number, ": ", error.what,
                    "; every line must be one record as io/METRICS.md describes");
    }
  }
  TESSERA_CHECK(!in.bad(), "metrics: reading '", path, "' failed: ", std::strerror(errno));
  return log;
}

}  // namespace tessera::io
