// Unit costs of GEMMs, memory-bound kernels and ring collectives (plan/costs.h).
#include "plan/costs.h"

#include <algorithm>
#include <cmath>

namespace tessera::plan {

double gemm_seconds(const Accelerator& a, DType dtype, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0.0;
  const double flops = 2.0 * double(m) * double(n) * double(k);
  const double tiles = std::ceil(double(m) / double(a.tile_m)) * std::ceil(double(n) / double(a.tile_n));
  const double waves = std::ceil(tiles / a.compute_units);
  const double quantisation = waves * a.compute_units / tiles;  // >= 1: the last wave's idle units
  const double compute = flops * quantisation / (a.peak_flops(dtype) * a.gemm_efficiency);
  const double bytes =
      double(dtype_size(dtype)) * (double(m) * double(k) + double(k) * double(n) + double(m) * double(n));
  return std::max(compute, bytes / (a.memory_bandwidth * a.memory_efficiency)) + a.launch_seconds;
}

double memory_seconds(const Accelerator& a, double bytes, int kernels) {
  return bytes / (a.memory_bandwidth * a.memory_efficiency) + kernels * a.launch_seconds;
}

GroupLink group_link(const Cluster& cluster, int size, int stride) {
  GroupLink g;
  g.size = size;
  if (size <= 1) return g;
  const int per_node = cluster.per_node;
  g.crosses_nodes = int64_t(size) * stride > per_node;
  if (!g.crosses_nodes) {
    g.bandwidth = cluster.intra.bandwidth;
    g.latency = cluster.intra.latency;
    return g;
  }
  const int members_per_node = std::max(1, per_node / std::max(1, stride));
  g.bandwidth = members_per_node > 1 ? std::min(cluster.intra.bandwidth, members_per_node * cluster.inter.bandwidth)
                                     : cluster.inter.bandwidth;
  g.latency = cluster.inter.latency;
  return g;
}

double all_reduce_seconds(const GroupLink& g, double bytes) {
  if (g.size <= 1) return 0.0;
  const double n = g.size;
  return 2.0 * (n - 1) / n * bytes / g.bandwidth + 2.0 * (n - 1) * g.latency;
}

double reduce_scatter_seconds(const GroupLink& g, double bytes) {
  if (g.size <= 1) return 0.0;
  const double n = g.size;
  return (n - 1) / n * bytes / g.bandwidth + (n - 1) * g.latency;
}

double all_to_all_seconds(const GroupLink& g, double bytes) {
  return reduce_scatter_seconds(g, bytes);
}

double send_seconds(const GroupLink& g, double bytes) {
  if (g.size <= 1) return 0.0;
  return bytes / g.bandwidth + g.latency;
}

}  // namespace tessera::plan
