// Reads a cluster's TOML description (apps/cluster_file.h) with toml++.
#include "apps/cluster_file.h"

#include <toml++/toml.h>

#include <filesystem>
#include <set>

#include "core/error.h"

namespace tessera::app {
namespace {

// The value of `key` in `table` as a positive number, if present.
bool number(const toml::table& table, const std::string& path, const char* key, double& out) {
  const toml::node* node = table.get(key);
  if (node == nullptr) return false;
  const std::optional<double> value = node->value<double>();
  TESSERA_CHECK(value && *value > 0, path, ":", node->source().begin.line, ": ", key, " must be a positive number");
  out = *value;
  return true;
}

void refuse_unknown(const toml::table& table, const std::string& path, const std::set<std::string>& known,
                    const std::string& where) {
  for (const auto& [key, node] : table) {
    if (known.count(std::string(key.str())) > 0) continue;
    std::string names;
    for (const std::string& name : known) names += (names.empty() ? "" : ", ") + name;
    TESSERA_THROW(path, ":", node.source().begin.line, ": unknown key '", key.str(), "'", where, "; known: ", names);
  }
}

// gemm_rates_32 = [[m, n, k, flops], ...]: measured GEMM rates (a full grid of m, n and k).
void read_gemm_rates(const toml::table& t, const std::string& path, const char* key, std::vector<plan::GemmRate>& out) {
  const toml::node* node = t.get(key);
  if (node == nullptr) return;
  const toml::array* rows = node->as_array();
  TESSERA_CHECK(rows != nullptr, path, ":", node->source().begin.line, ": ", key, " must be [[m, n, k, flops], ...]");
  for (const toml::node& row : *rows) {
    const toml::array* r = row.as_array();
    const auto at = [&](size_t i) { return r != nullptr && r->size() == 4 ? (*r)[i].value<double>() : std::nullopt; };
    TESSERA_CHECK(at(0) && at(1) && at(2) && at(3) && *at(3) > 0, path, ":", row.source().begin.line, ": each of ", key,
                  " is [m, n, k, flops] with flops > 0");
    out.push_back({int64_t(*at(0)), int64_t(*at(1)), int64_t(*at(2)), *at(3)});
  }
}

plan::Accelerator read_accelerator(const toml::table& t, const std::string& path) {
  refuse_unknown(t, path,
                 {"base", "name", "peak_flops_16", "peak_flops_32", "memory_gib", "memory_bandwidth", "compute_units",
                  "gemm_efficiency", "attention_efficiency", "memory_efficiency", "launch_seconds", "source",
                  "gemm_rates_32", "gemm_rates_16"},
                 " in [accelerator]");
  plan::Accelerator a;
  if (const auto base = t["base"].value<std::string>()) a = plan::accelerator_named(*base);
  if (const auto name = t["name"].value<std::string>()) a.name = *name;
  if (const auto source = t["source"].value<std::string>()) a.source = *source;
  double value = 0;
  if (number(t, path, "peak_flops_16", value)) a.peak_flops_16 = value;
  if (number(t, path, "peak_flops_32", value)) a.peak_flops_32 = value;
  if (number(t, path, "memory_gib", value)) a.memory_bytes = int64_t(value * 1024 * 1024 * 1024);
  if (number(t, path, "memory_bandwidth", value)) a.memory_bandwidth = value;
  if (number(t, path, "compute_units", value)) a.compute_units = int(value);
  if (number(t, path, "gemm_efficiency", value)) a.gemm_efficiency = value;
  if (number(t, path, "memory_efficiency", value)) a.memory_efficiency = value;
  if (number(t, path, "launch_seconds", value)) a.launch_seconds = value;
  if (number(t, path, "attention_efficiency", value)) a.attention_efficiency = value;
  read_gemm_rates(t, path, "gemm_rates_32", a.gemm_rates_32);
  read_gemm_rates(t, path, "gemm_rates_16", a.gemm_rates_16);
  TESSERA_CHECK(a.peak_flops_16 > 0 && a.peak_flops_32 > 0 && a.memory_bytes > 0 && a.memory_bandwidth > 0, path,
                ": [accelerator] needs peak_flops_16, peak_flops_32, memory_gib and memory_bandwidth (or base = a "
                "built-in accelerator)");
  TESSERA_CHECK(a.gemm_efficiency <= 1 && a.memory_efficiency <= 1, path,
                ": gemm_efficiency and memory_efficiency are shares of the peak, at most 1");
  return a;
}

plan::Link read_link(const toml::table& file, const std::string& path, const char* key, int per_node,
                     const std::string& fallback) {
  const toml::node* node = file.get(key);
  if (node == nullptr) return plan::link_named(fallback, per_node);
  if (const auto name = node->value<std::string>()) return plan::link_named(*name, per_node);
  const toml::table* table = node->as_table();
  TESSERA_CHECK(table != nullptr, path, ":", node->source().begin.line, ": ", key,
                " must be a link's name or a table with bandwidth and latency");
  refuse_unknown(*table, path, {"name", "bandwidth", "latency"}, std::string(" in [") + key + "]");
  plan::Link link;
  link.name = (*table)["name"].value_or(std::string(key));
  TESSERA_CHECK(number(*table, path, "bandwidth", link.bandwidth) && number(*table, path, "latency", link.latency),
                path, ": [", key, "] needs bandwidth (bytes/s per GPU) and latency (seconds per ring step)");
  link.source = path;
  return link;
}

}  // namespace

bool names_cluster_file(const std::string& text) {
  return (text.size() > 5 && text.substr(text.size() - 5) == ".toml") || std::filesystem::is_regular_file(text);
}

plan::Cluster read_cluster_file(const std::string& path) {
  toml::table file;
  try {
    file = toml::parse_file(path);
  } catch (const toml::parse_error& error) {
    TESSERA_THROW("--cluster ", path, ":", error.source().begin.line, ": ", error.description());
  }
  refuse_unknown(file, path, {"per_node", "nodes", "accelerator", "intra", "inter"}, "");
  plan::Cluster cluster;
  cluster.spec = path;
  double count = 1;
  if (number(file, path, "per_node", count)) cluster.per_node = int(count);
  if (number(file, path, "nodes", count)) cluster.nodes = int(count);
  const toml::table* accelerator = file["accelerator"].as_table();
  TESSERA_CHECK(accelerator != nullptr, path, ": needs an [accelerator] table (e.g. base = \"H100-SXM\")");
  cluster.accelerator = read_accelerator(*accelerator, path);
  cluster.intra = read_link(file, path, "intra", cluster.per_node, "NVLink4");
  cluster.inter = read_link(file, path, "inter", cluster.per_node, "IB-NDR400");
  return cluster;
}

}  // namespace tessera::app
