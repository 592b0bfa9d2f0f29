// predict_memory: the per-rank model-state formula of memory_plan.h, term by term.
#include "parallel/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "core/error.h"

namespace tessera::parallel {
namespace {

// The units alive beside unit i when it runs backward (parameter order,
// backward going from the last unit to the first): its values and those of
// the N units before it, gathered ahead; its gradient and those of the N
// units after it, whose reductions may still be in flight. The most at any i.
struct Window {
  int64_t values = 0, gradients = 0;  // elements
};

Window busiest_window(const std::vector<int64_t>& units, const std::vector<bool>& held, int n, int64_t value_bytes,
                      bool count_values) {
  Window best;
  int64_t best_bytes = -1;
  const int64_t count = int64_t(units.size());
  for (int64_t i = 0; i < count; ++i) {
    Window w;
    for (int64_t j = std::max<int64_t>(0, i - n); j <= i; ++j) w.values += units[size_t(j)];
    for (int64_t j = i; j <= std::min(count - 1, i + n); ++j)
      if (held.empty() || !held[size_t(j)]) w.gradients += units[size_t(j)];
    const int64_t bytes = (count_values ? value_bytes * w.values : 0) + 4 * w.gradients;
    if (bytes > best_bytes) {
      best = w;
      best_bytes = bytes;
    }
  }
  if (!count_values) best.values = 0;
  return best;
}

}  // namespace

MemoryPlan predict_memory(const MemoryPlanInput& in) {
  TESSERA_CHECK(in.data_parallel >= 1 && in.zero_stage >= 0 && in.zero_stage <= 3 && in.prefetch >= 0,
                "predict_memory: data parallel ", in.data_parallel, ", zero ", in.zero_stage, ", prefetch ",
                in.prefetch, " is not a configuration");
  const int64_t p = std::accumulate(in.unit_elements.begin(), in.unit_elements.end(), int64_t(0));
  const int64_t d = in.data_parallel, b = in.value_bytes, s = in.optimizer_bytes;
  TESSERA_CHECK(in.unit_held.empty() || in.unit_held.size() == in.unit_elements.size(),
                "predict_memory: ", in.unit_held.size(), " held flags for ", in.unit_elements.size(), " units");
  int64_t h = 0;  // H
  for (size_t i = 0; i < in.unit_held.size(); ++i)
    if (in.unit_held[i]) h += in.unit_elements[i];
  const Window w =
      busiest_window(in.unit_elements, in.unit_held, in.prefetch, in.value_bytes, /*count_values=*/in.zero_stage == 3);
  MemoryPlan plan;
  std::ostringstream f;
  f << "P=" << p << " D=" << d << " b=" << b << " S=" << s;
  if (in.zero_stage == 3) f << " U=" << w.values;
  if (in.zero_stage >= 2) f << " G=" << w.gradients << " H=" << h << " (N=" << in.prefetch << ")";
  f << ": values ";
  switch (in.zero_stage) {
    case 0:
      plan.parameters = b * p;
      plan.gradients = 4 * p;
      plan.optimizer = s * p;
      f << "bP, gradients 4P, optimizer SP";
      break;
    case 1:
      plan.parameters = b * p;
      plan.gradients = 4 * p + 4 * p / d;
      plan.optimizer = s * p / d;
      f << "bP, gradients 4P + 4P/D, optimizer SP/D";
      break;
    case 2:
      plan.parameters = b * p;
      plan.gradients = 4 * p / d + 4 * w.gradients + 4 * h + (in.accumulates ? 4 * w.gradients / d : 0);
      plan.optimizer = s * p / d;
      f << "bP, gradients 4P/D + 4G + 4H" << (in.accumulates ? " + 4G/D" : "") << ", optimizer SP/D";
      break;
    default:
      plan.parameters = b * p / d + b * w.values;
      plan.gradients = 4 * p / d + 4 * w.gradients + 4 * h + (in.accumulates ? 4 * w.gradients / d : 0);
      plan.optimizer = s * p / d;
      f << "bP/D + bU, gradients 4P/D + 4G + 4H" << (in.accumulates ? " + 4G/D" : "") << ", optimizer SP/D";
      break;
  }
  f << " = " << plan.parameters << " + " << plan.gradients << " + " << plan.optimizer << " = " << plan.model_state()
    << " bytes";
  plan.formula = f.str();
  return plan;
}

int64_t optimizer_bytes_per_element(const nn::OptimizerConfig& config, DType dtype) {
  int64_t bytes = 0;
  if (config.kind == nn::OptimizerKind::adamw)
    bytes = 8;
  else if (config.momentum > 0.0f)
    bytes = 4;
  return bytes + (dtype == DType::f32 ? 0 : 4);
}

std::string byte_text(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t(1) << 30))
    std::snprintf(text, sizeof text, "%.2f GiB", double(bytes) / double(int64_t(1) << 30));
  else if (bytes >= (int64_t(1) << 20))
    std::snprintf(text, sizeof text, "%.2f MiB", double(bytes) / double(int64_t(1) << 20));
  else if (bytes >= 1024)
    std::snprintf(text, sizeof text, "%.1f KiB", double(bytes) / 1024.0);
  else
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(bytes));
  return text;
}

}  // namespace tessera::parallel
