// Fault injection: parsing TESSERA_FAULT and matching faults to (kind, step,
// rank). See fault.h.
#include "core/fault.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <mutex>

#include "core/emulated_runtime.h"
#include "core/error.h"

namespace tessera {
namespace {

std::string_view trim(std::string_view text) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && space(text.front())) text.remove_prefix(1);
  while (!text.empty() && space(text.back())) text.remove_suffix(1);
  return text;
}

template <typename T>
std::optional<T> parse_number(std::string_view text) {
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < 0) return std::nullopt;
  return value;
}

std::string known_kinds() {
  std::string out;
  for (std::string_view kind : fault_kinds()) out += (out.empty() ? "" : ", ") + std::string(kind);
  return out;
}

}  // namespace

const std::vector<std::string_view>& fault_kinds() {
  static const std::vector<std::string_view> kinds = {
      "checkpoint_crash", "crash",          "hang",           "slow",
      "nan_grad",         "truncated_data", "device_fault",   "slow_checkpoint",
      "checkpoint_hang",  "startup_hang",   "selfcheck_gemm", "selfcheck_payload"};
  return kinds;
}

FaultPlan FaultPlan::parse(std::string_view text, std::string_view source) {
  FaultPlan plan;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view entry = trim(text.substr(start, comma - start));
    start = comma + 1;
    if (entry.empty()) continue;
    const auto bad = [&](std::string_view why) {
      TESSERA_THROW(
          source, "='", text, "': entry '", entry, "' ", why,
          "; the syntax is kind[@step][:rank], comma-separated (e.g. checkpoint_crash@20:0), kinds: ", known_kinds());
    };
    FaultPoint point;
    std::string_view rest = entry;
    if (const size_t colon = rest.find(':'); colon != std::string_view::npos) {
      point.rank = parse_number<int>(trim(rest.substr(colon + 1)));
      if (!point.rank) bad("has a rank that is not a non-negative integer");
      rest = rest.substr(0, colon);
    }
    if (const size_t at = rest.find('@'); at != std::string_view::npos) {
      point.step = parse_number<int64_t>(trim(rest.substr(at + 1)));
      if (!point.step) bad("has a step that is not a non-negative integer");
      rest = rest.substr(0, at);
    }
    point.kind = std::string(trim(rest));
    const auto& kinds = fault_kinds();
    if (std::find(kinds.begin(), kinds.end(), point.kind) == kinds.end()) bad("has an unknown kind");
    plan.points_.push_back(std::move(point));
    if (comma == text.size()) break;
  }
  return plan;
}

bool FaultPlan::due(std::string_view kind, int64_t step, int rank) const {
  return std::any_of(points_.begin(), points_.end(), [&](const FaultPoint& point) {
    return point.kind == kind && (!point.step || *point.step == step) && (!point.rank || *point.rank == rank);
  });
}

bool fault_due(std::string_view kind, int64_t step, int rank) {
  const char* value = std::getenv(kFaultVariable);
  if (value == nullptr || *value == '\0') return false;
  // The plan of the last value seen; re-parsed when the value changes.
  static std::mutex mutex;
  static std::string cached_text;
  static FaultPlan cached_plan;
  std::lock_guard lock(mutex);
  if (cached_text != value) {
    cached_plan = FaultPlan::parse(value);  // throws on a bad value, leaving the cache as it was
    cached_text = value;
  }
  return cached_plan.due(kind, step, rank);
}

void provoke_device_fault(Device device) {
  if (device.is_emulated()) {
    emulated::inject_fault(device.index, "an illegal memory access was encountered (TESSERA_FAULT=device_fault)");
    return;
  }
  TESSERA_CHECK(device.is_cuda(), "TESSERA_FAULT=device_fault needs a device (--device cuda or emu), not ",
                device.to_string());
  detail::cuda_provoke_illegal_address(device.index);
}

}  // namespace tessera
