// The built-in accelerators and links with their sources, and the parser of
// --cluster SPECs (plan/cluster.h).
#include "plan/cluster.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <sstream>

#include "core/error.h"

namespace tessera::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Peaks: NVIDIA's datasheets (dense, no sparsity). GEMM efficiency: the
// maximum achievable matmul FLOP/s over peak, bf16, measured by mamf-finder
// (stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable
// Matmul FLOPS comparison table", and its H200/B200 comparison): A100 SXM
// 267.9/312, H100 SXM 792.1/989, H100/H200 SXM 794.5/989, B200 1745/2250.
// Fused attention: FlashAttention-2's share of peak, forward and backward
// (Dao 2023: up to 72% on A100; Shah et al. 2024, FlashAttention-3: "only
// 35% utilization on H100"; H200 and B200 assumed as H100).
// Memory-bound kernels: 0.8 of peak bandwidth (an assumption: copies reach
// ~0.9, framework elementwise kernels less). Memory: what CUDA reports as
// usable on each card.
Accelerator gpu(std::string name, double peak16, double peak32, double memory_gib, double bandwidth, int sms,
                double gemm_efficiency, double attention_efficiency, std::string source) {
  Accelerator a;
  a.name = std::move(name);
  a.peak_flops_16 = peak16;
  a.peak_flops_32 = peak32;
  a.memory_bytes = int64_t(memory_gib * kGiB);
  a.memory_bandwidth = bandwidth;
  a.compute_units = sms;
  a.tile_m = 128;
  a.tile_n = 256;
  a.gemm_efficiency = gemm_efficiency;
  a.attention_efficiency = attention_efficiency;
  a.memory_efficiency = 0.8;
  a.launch_seconds = 4e-6;
  a.source = std::move(source);
  return a;
}

std::vector<Accelerator> catalog() {
  std::vector<Accelerator> list;
  const std::string mamf =
      "; GEMM efficiency: mamf-finder's maximum achievable bf16 matmul FLOP/s (stas00/ml-engineering)";
  list.push_back(gpu("A100-40GB", 312e12, 19.5e12, 39.4, 1.555e12, 108, 267.9 / 312, 0.72,
                     "NVIDIA A100 datasheet (312 TFLOP/s bf16, 19.5 fp32, 1555 GB/s)" + mamf +
                         " 267.9/312; attention 0.72 (FlashAttention-2)"));
  list.push_back(gpu("A100-80GB", 312e12, 19.5e12, 79.2, 2.039e12, 108, 267.9 / 312, 0.72,
                     "NVIDIA A100 datasheet (312 TFLOP/s bf16, 19.5 fp32, 2039 GB/s)" + mamf +
                         " 267.9/312; attention 0.72 (FlashAttention-2)"));
  list.push_back(gpu("H100-SXM", 989e12, 67e12, 79.1, 3.35e12, 132, 792.1 / 989, 0.35,
                     "NVIDIA H100 SXM datasheet (989 TFLOP/s bf16 dense, 67 fp32, 3.35 TB/s)" + mamf +
                         " 792.1/989; attention 0.35 (FlashAttention-2 on H100)"));
  list.push_back(gpu("H200", 989e12, 67e12, 139.8, 4.8e12, 132, 794.5 / 989, 0.35,
                     "NVIDIA H200 SXM datasheet (989 TFLOP/s bf16 dense, 67 fp32, 4.8 TB/s)" + mamf + " 794.5/989"));
  list.push_back(gpu("B200", 2250e12, 75e12, 178.8, 8.0e12, 148, 1745.0 / 2250, 0.35,
                     "NVIDIA HGX B200 (2250 TFLOP/s bf16 dense, 75 fp32, 8 TB/s, 180 GB)" + mamf + " 1745/2250"));
  Accelerator cpu;
  cpu.name = "cpu";
  cpu.peak_flops_16 = 50e9;
  cpu.peak_flops_32 = 50e9;
  cpu.memory_bytes = int64_t(8 * kGiB);
  cpu.memory_bandwidth = 20e9;
  cpu.compute_units = 1;
  cpu.tile_m = 1;
  cpu.tile_n = 1;
  cpu.gemm_efficiency = 1.0;
  cpu.attention_efficiency = 0.5;
  cpu.memory_efficiency = 1.0;
  cpu.launch_seconds = 2e-6;
  cpu.source = "placeholder figures for one CPU rank; `tessera selfcheck --cluster` measures this machine's";
  list.push_back(cpu);
  return list;
}

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return out;
}

std::string accelerator_names() {
  std::string names;
  for (const Accelerator& a : accelerators()) names += (names.empty() ? "" : ", ") + a.name;
  return names;
}

bool parse_count(std::string_view text, int& out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && out >= 1;
}

// "IB-NDR400x8" -> ("ib-ndr400", 8); no "xN": count 0.
std::pair<std::string, int> split_count(std::string_view name) {
  const size_t x = name.rfind('x');
  int count = 0;
  if (x != std::string_view::npos && x + 1 < name.size() && parse_count(name.substr(x + 1), count))
    return {lower(name.substr(0, x)), count};
  return {lower(name), 0};
}

constexpr const char* kLinkNames =
    "NVLink3, NVLink4, NVLink5, PCIe4, PCIe5, shm (inside a node); IB-HDR200, IB-NDR400, IB-XDR800, RoCE-<Gb/s>, "
    "Ethernet-<Gb/s>G (between nodes; xN: N NICs per node, default one per GPU)";

// Nominal bandwidth per direction (bytes/s) of one link or NIC, and the share
// a NCCL ring reaches: 0.8 on NVLink/PCIe, 0.9 on RDMA NICs, 0.7 on TCP
// Ethernet (assumptions; `tessera selfcheck --cluster` measures the real ones).
struct LinkClass {
  double bandwidth, efficiency, latency;
  bool per_node_nics;  // a NIC: shared by the GPUs of a node
};

bool link_class(const std::string& base, LinkClass& out) {
  if (base == "nvlink3")
    out = {300e9, 0.8, 2e-6, false};
  else if (base == "nvlink4")
    out = {450e9, 0.8, 2e-6, false};
  else if (base == "nvlink5")
    out = {900e9, 0.8, 2e-6, false};
  else if (base == "pcie4")
    out = {32e9, 0.8, 3e-6, false};
  else if (base == "pcie5")
    out = {64e9, 0.8, 3e-6, false};
  else if (base == "shm")
    out = {8e9, 1.0, 1e-6, false};
  else if (base == "ib-hdr200")
    out = {25e9, 0.9, 5e-6, true};
  else if (base == "ib-ndr400")
    out = {50e9, 0.9, 5e-6, true};
  else if (base == "ib-xdr800")
    out = {100e9, 0.9, 5e-6, true};
  else {
    int gbits = 0;
    std::string_view rest;
    if (base.rfind("roce-", 0) == 0)
      rest = std::string_view(base).substr(5);
    else if (base.rfind("ethernet-", 0) == 0)
      rest = std::string_view(base).substr(9);
    else
      return false;
    if (!rest.empty() && rest.back() == 'g') rest.remove_suffix(1);
    if (!parse_count(rest, gbits)) return false;
    const bool rdma = base.rfind("roce-", 0) == 0;
    out = {gbits * 1e9 / 8, rdma ? 0.9 : 0.7, rdma ? 6e-6 : 25e-6, true};
  }
  return true;
}

}  // namespace

const std::vector<Accelerator>& accelerators() {
  static const std::vector<Accelerator> list = catalog();
  return list;
}

const Accelerator& accelerator_named(std::string_view name) {
  std::string wanted = lower(name);
  if (wanted == "h100") wanted = "h100-sxm";
  if (wanted == "a100") wanted = "a100-80gb";
  for (const Accelerator& a : accelerators())
    if (lower(a.name) == wanted) return a;
  TESSERA_THROW("--cluster: unknown accelerator '", name, "'; built in: ", accelerator_names(),
                " (or give a TOML file with its figures)");
}

Link link_named(std::string_view name, int per_node) {
  const auto [base, count] = split_count(name);
  LinkClass c{};
  TESSERA_CHECK(link_class(base, c), "--cluster: unknown link '", name, "'; known: ", kLinkNames);
  Link link;
  link.name = std::string(name);
  link.latency = c.latency;
  const double nics = c.per_node_nics ? (count > 0 ? count : per_node) : 1;
  link.bandwidth = c.bandwidth * c.efficiency * nics / (c.per_node_nics ? per_node : 1);
  char text[200];
  std::snprintf(
      text, sizeof text, "%s: %.0f GB/s nominal per %s x %.0f%% a ring reaches%s", link.name.c_str(), c.bandwidth / 1e9,
      c.per_node_nics ? "NIC" : "GPU", c.efficiency * 100,
      c.per_node_nics
          ? (", " + std::to_string(int(nics)) + " NICs shared by " + std::to_string(per_node) + " GPUs").c_str()
          : "");
  link.source = text;
  return link;
}

namespace {

std::pair<std::string, std::string> default_links(const Accelerator& a) {
  const std::string name = lower(a.name);
  if (name.rfind("a100", 0) == 0) return {"NVLink3", "IB-HDR200"};
  if (name == "b200") return {"NVLink5", "IB-NDR400"};
  if (name == "cpu") return {"shm", "Ethernet-100G"};
  return {"NVLink4", "IB-NDR400"};
}

std::vector<std::string_view> split(std::string_view text, char by) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i)
    if (i == text.size() || text[i] == by) {
      parts.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  return parts;
}

}  // namespace

Cluster parse_cluster(std::string_view spec) {
  TESSERA_CHECK(!spec.empty(), "--cluster: empty; e.g. 8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64");
  const std::vector<std::string_view> parts = split(spec, ':');
  Cluster cluster;
  cluster.spec = std::string(spec);
  std::string_view head = parts[0];
  const size_t x = head.find('x');
  if (x != std::string_view::npos && x > 0 && std::isdigit(static_cast<unsigned char>(head[0]))) {
    TESSERA_CHECK(parse_count(head.substr(0, x), cluster.per_node), "--cluster ", spec, ": '", head.substr(0, x),
                  "' is not a number of accelerators per node (write 8xH100-SXM)");
    head = head.substr(x + 1);
  }
  cluster.accelerator = accelerator_named(head);
  auto [intra, inter] = default_links(cluster.accelerator);
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string_view part = parts[i];
    if (part.rfind("nodes=", 0) == 0) {
      TESSERA_CHECK(parse_count(part.substr(6), cluster.nodes), "--cluster ", spec, ": nodes='", part.substr(6),
                    "' is not a positive number of nodes");
      continue;
    }
    TESSERA_CHECK(part.find('=') == std::string_view::npos, "--cluster ", spec, ": unknown setting '", part,
                  "' (known: nodes=K)");
    const std::vector<std::string_view> links = split(part, ',');
    TESSERA_CHECK(links.size() <= 2 && !links[0].empty(), "--cluster ", spec, ": '", part,
                  "' must be INTRA or INTRA,INTER (e.g. NVLink4,IB-NDR400x8)");
    intra = std::string(links[0]);
    if (links.size() == 2) inter = std::string(links[1]);
  }
  cluster.intra = link_named(intra, cluster.per_node);
  cluster.inter = link_named(inter, cluster.per_node);
  return cluster;
}

std::string Cluster::describe() const {
  std::ostringstream out;
  out << nodes << " node" << (nodes == 1 ? "" : "s") << " x " << per_node << " " << accelerator.name << " ("
      << accelerator.peak_flops_16 / 1e12 << " TFLOP/s 16-bit, " << accelerator.memory_bytes / kGiB << " GiB, "
      << accelerator.memory_bandwidth / 1e12 << " TB/s); inside a node " << intra.name << " " << intra.bandwidth / 1e9
      << " GB/s per GPU; between nodes " << inter.name << " " << inter.bandwidth / 1e9 << " GB/s per GPU";
  return out.str();
}

}  // namespace tessera::plan
