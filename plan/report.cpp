// Tables, name=value lines and breakdowns of `tessera plan` (plan/report.h).
#include "plan/report.h"

#include <cstdio>
#include <sstream>

#include "parallel/memory_plan.h"

namespace tessera::plan {
namespace {

std::string seconds_text(double s) {
  char text[32];
  if (s >= 1.0)
    std::snprintf(text, sizeof text, "%.3f s", s);
  else
    std::snprintf(text, sizeof text, "%.2f ms", s * 1e3);
  return text;
}

std::string share(double part, double whole) {
  char text[16];
  std::snprintf(text, sizeof text, "%5.1f%%", whole > 0 ? 100.0 * part / whole : 0.0);
  return text;
}

}  // namespace

std::string ranking_table(const SearchResult& result, size_t top) {
  std::ostringstream out;
  char line[320];
  std::snprintf(line, sizeof line, "%4s  %-58s %12s %14s %10s %6s %12s\n", "rank", "layout", "step", "tokens/s",
                "TFLOP/s", "MFU", "memory");
  out << line;
  for (size_t i = 0; i < std::min(top, result.ranked.size()); ++i) {
    const Prediction& p = result.ranked[i];
    std::snprintf(line, sizeof line, "%4zu  %-58s %12s %14.0f %10.1f %5.1f%% %12s\n", i + 1,
                  p.layout.describe().c_str(), seconds_text(p.time.step).c_str(), p.tokens_per_s, p.tflops_per_gpu,
                  100 * p.mfu, parallel::byte_text(p.memory.total()).c_str());
    out << line;
  }
  return out.str();
}

std::string name_values(const Prediction& p) {
  std::ostringstream out;
  out.precision(6);
  out << "predicted_step_s=" << p.time.step << "\n"
      << "predicted_tokens_per_s=" << p.tokens_per_s << "\n"
      << "predicted_tflops_per_gpu=" << p.tflops_per_gpu << "\n"
      << "predicted_mfu=" << p.mfu << "\n"
      << "predicted_memory_bytes=" << p.memory.total() << "\n"
      << "predicted_rank0_memory_bytes=" << (p.stages.empty() ? p.memory.total() : p.stages.front().total()) << "\n"
      << "predicted_fits=" << (p.fits ? 1 : 0) << "\n"
      << "predicted_flags=" << p.layout.flags() << "\n";
  return out.str();
}

std::map<std::string, std::string> parse_name_values(const std::string& text) {
  std::map<std::string, std::string> values;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos || eq == 0 || line.find(' ') < eq) continue;
    values[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return values;
}

std::string explain(const Prediction& p, const Cluster& cluster) {
  const StepTime& t = p.time;
  std::ostringstream out;
  out << "layout " << p.layout.describe() << " (" << p.layout.flags() << ")\n";
  out << "cluster " << cluster.describe() << "\n";
  out << "step " << seconds_text(t.step) << (p.simulated ? "" : " (pipeline by its closed form)") << ":\n";
  const auto row = [&](const char* name, double value, const char* note) {
    char line[200];
    std::snprintf(line, sizeof line, "  %-22s %12s %s  %s\n", name, seconds_text(value).c_str(),
                  share(value, t.step).c_str(), note);
    out << line;
  };
  row("compute", t.compute, "forwards and backwards of the busiest stage, all micro-batches");
  row("tensor parallel", t.tensor_parallel, "tp all-reduces / all-gathers + reduce-scatters, not overlapped");
  if (p.layout.cp > 1) row("context parallel", t.context_parallel, "K/V ring outlasting the attention");
  if (p.layout.ep > 1) row("expert parallel", t.expert_parallel, "dispatch and combine all-to-alls");
  if (p.layout.pp > 1) row("pipeline bubble", t.pipeline_bubble, "idle in the schedule's span (transfers included)");
  row("data parallel", t.data_parallel, "gradient reduction outlasting the last backward");
  if (p.layout.zero > 0) row("zero", t.zero, "value gathers not hidden");
  row("optimizer", t.optimizer, "the step through memory");
  const MemoryUse& m = p.memory;
  out << "memory of the fullest rank (stage " << m.stage << "): " << parallel::byte_text(m.total()) << " of "
      << parallel::byte_text(cluster.accelerator.memory_bytes) << (p.fits ? "" : " (does not fit)") << "\n";
  const auto bytes = [&](const char* name, int64_t value) {
    out << "  " << name << " " << parallel::byte_text(value) << "\n";
  };
  bytes("parameters ", m.parameters);
  bytes("gradients  ", m.gradients);
  bytes("optimizer  ", m.optimizer);
  bytes("activations", m.activations);
  if (m.logits > 0) bytes("logits     ", m.logits);
  char line[200];
  std::snprintf(line, sizeof line,
                "%.3g FLOPs a step (model), %.3g computed; %.0f tokens/s; %.1f TFLOP/s per GPU; MFU %.1f%%\n",
                p.model_flops, p.hardware_flops, p.tokens_per_s, p.tflops_per_gpu, 100 * p.mfu);
  out << line;
  return out.str();
}

}  // namespace tessera::plan
