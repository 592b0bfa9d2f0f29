// Reads a cluster's TOML description (apps/cluster_file.h) with toml++, and
// writes one (`tessera selfcheck --cluster`'s calibration) that reads back
// to the same Cluster.
#include "apps/cluster_file.h"

#include <toml++/toml.h>

#include <filesystem>
#include <fstream>
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

// [[accelerator.gemm_rates_32]] tables of m, n, k and flops (a measured grid), if present.
void read_gemm_rates(const toml::table& t, const std::string& path, const char* key, std::vector<plan::GemmRate>& out) {
  const toml::node* node = t.get(key);
  if (node == nullptr) return;
  const toml::array* rates = node->as_array();
  TESSERA_CHECK(rates != nullptr, path, ":", node->source().begin.line, ": ", key,
                " must be an array of tables with m, n, k and flops");
  out.clear();
  for (const toml::node& entry : *rates) {
    const toml::table* rate = entry.as_table();
    TESSERA_CHECK(rate != nullptr, path, ":", entry.source().begin.line, ": ", key, " holds tables of m, n, k, flops");
    refuse_unknown(*rate, path, {"m", "n", "k", "flops"}, std::string(" in ") + key);
    double m = 0, n = 0, k = 0, flops = 0;
    TESSERA_CHECK(number(*rate, path, "m", m) && number(*rate, path, "n", n) && number(*rate, path, "k", k) &&
                      number(*rate, path, "flops", flops),
                  path, ":", entry.source().begin.line, ": a ", key, " entry needs m, n, k and flops");
    out.push_back({int64_t(m), int64_t(n), int64_t(k), flops});
  }
}

plan::Accelerator read_accelerator(const toml::table& t, const std::string& path) {
  refuse_unknown(t, path,
                 {"base", "name", "peak_flops_16", "peak_flops_32", "memory_gib", "memory_bandwidth", "compute_units",
                  "gemm_efficiency", "memory_efficiency", "launch_seconds", "source", "attention_efficiency", "tile_m",
                  "tile_n", "gemm_rates_32", "gemm_rates_16"},
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
  if (number(t, path, "tile_m", value)) a.tile_m = int64_t(value);
  if (number(t, path, "tile_n", value)) a.tile_n = int64_t(value);
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
  refuse_unknown(*table, path, {"name", "bandwidth", "latency", "source"}, std::string(" in [") + key + "]");
  plan::Link link;
  link.name = (*table)["name"].value_or(std::string(key));
  TESSERA_CHECK(number(*table, path, "bandwidth", link.bandwidth) && number(*table, path, "latency", link.latency),
                path, ": [", key, "] needs bandwidth (bytes/s per GPU) and latency (seconds per ring step)");
  link.source = (*table)["source"].value_or(path);
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
  // [selfcheck] and [[link_samples]]: what `tessera selfcheck --cluster` noted, for people.
  refuse_unknown(file, path, {"per_node", "nodes", "accelerator", "intra", "inter", "selfcheck", "link_samples"}, "");
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

namespace {

toml::array gemm_rates_array(const std::vector<plan::GemmRate>& rates) {
  toml::array out;
  for (const plan::GemmRate& r : rates)
    out.push_back(toml::table{{"m", r.m}, {"n", r.n}, {"k", r.k}, {"flops", r.flops}});
  return out;
}

toml::table accelerator_table(const plan::Accelerator& a) {
  toml::table t{{"name", a.name},
                {"peak_flops_16", a.peak_flops_16},
                {"peak_flops_32", a.peak_flops_32},
                // Exact: a byte count below 2^53 divided by 2^30 and multiplied back.
                {"memory_gib", double(a.memory_bytes) / (1024.0 * 1024.0 * 1024.0)},
                {"memory_bandwidth", a.memory_bandwidth},
                {"compute_units", a.compute_units},
                {"tile_m", a.tile_m},
                {"tile_n", a.tile_n},
                {"gemm_efficiency", a.gemm_efficiency},
                {"attention_efficiency", a.attention_efficiency},
                {"memory_efficiency", a.memory_efficiency},
                {"launch_seconds", a.launch_seconds},
                {"source", a.source}};
  if (!a.gemm_rates_32.empty()) t.insert("gemm_rates_32", gemm_rates_array(a.gemm_rates_32));
  if (!a.gemm_rates_16.empty()) t.insert("gemm_rates_16", gemm_rates_array(a.gemm_rates_16));
  return t;
}

toml::table link_table(const plan::Link& link) {
  return toml::table{
      {"name", link.name}, {"bandwidth", link.bandwidth}, {"latency", link.latency}, {"source", link.source}};
}

toml::array samples_array(const std::vector<plan::LinkSample>& samples) {
  toml::array out;
  for (const plan::LinkSample& s : samples)
    out.push_back(toml::table{{"collective", s.collective},
                              {"link", s.link},
                              {"ranks", s.ranks},
                              {"bytes", s.bytes},
                              {"seconds", s.seconds},
                              {"bus_bandwidth", s.bus_bandwidth}});
  return out;
}

}  // namespace

void write_cluster_file(const std::string& path, const plan::Cluster& cluster, const std::vector<std::string>& notes,
                        const std::vector<plan::LinkSample>& samples) {
  toml::array results;
  for (const std::string& note : notes) results.push_back(note);
  toml::table file{{"per_node", cluster.per_node},
                   {"nodes", cluster.nodes},
                   {"accelerator", accelerator_table(cluster.accelerator)},
                   {"intra", link_table(cluster.intra)},
                   {"inter", link_table(cluster.inter)},
                   {"selfcheck", toml::table{{"results", results}}}};
  if (!samples.empty()) file.insert("link_samples", samples_array(samples));
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial);
    TESSERA_CHECK(out.good(), "cannot write the cluster file ", partial,
                  ": is its directory there and writable? (choose another with --output)");
    out << "# Written by `tessera selfcheck --cluster`; read by `tessera plan --cluster " << path << "`.\n"
        << file << "\n";
    out.flush();
    TESSERA_CHECK(out.good(), "writing the cluster file ", partial, " failed (disk full?)");
  }
  std::error_code error;
  std::filesystem::rename(partial, path, error);
  TESSERA_CHECK(!error, "cannot rename ", partial, " to ", path, ": ", error.message());
}

}  // namespace tessera::app
