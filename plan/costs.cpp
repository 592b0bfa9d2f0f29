// Unit costs of GEMMs, memory-bound kernels and ring collectives (plan/costs.h).
#include "plan/costs.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tessera::plan {

namespace {

// The rate of [m×k]·[k×n] from a measured grid: trilinear in log(m), log(n),
// log(k) over the grid's sizes (clamped at its edges), of log(rate).
double interpolated_rate(const std::vector<GemmRate>& rates, int64_t m, int64_t n, int64_t k) {
  std::vector<int64_t> ms, ns, ks;
  for (const GemmRate& r : rates) {
    ms.push_back(r.m);
    ns.push_back(r.n);
    ks.push_back(r.k);
  }
  for (auto* v : {&ms, &ns, &ks}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  // The grid cell around x and the weight of its upper end.
  const auto locate = [](const std::vector<int64_t>& sizes, int64_t x, size_t& lo, double& w) {
    lo = 0;
    w = 0;
    if (sizes.size() == 1 || x <= sizes.front()) return;
    if (x >= sizes.back()) {
      lo = sizes.size() - 2;
      w = 1;
      return;
    }
    while (sizes[lo + 1] < x) ++lo;
    w = std::log(double(x) / double(sizes[lo])) / std::log(double(sizes[lo + 1]) / double(sizes[lo]));
  };
  size_t im = 0, in = 0, ik = 0;
  double wm = 0, wn = 0, wk = 0;
  locate(ms, m, im, wm);
  locate(ns, n, in, wn);
  locate(ks, k, ik, wk);
  const auto rate_at = [&](size_t a, size_t b, size_t c) {
    const int64_t gm = ms[std::min(a, ms.size() - 1)], gn = ns[std::min(b, ns.size() - 1)],
                  gk = ks[std::min(c, ks.size() - 1)];
    for (const GemmRate& r : rates)
      if (r.m == gm && r.n == gn && r.k == gk) return std::log(r.flops);
    TESSERA_THROW("plan: the measured GEMM grid has no ", gm, "x", gn, "x", gk, " (measure it again)");
  };
  double log_rate = 0;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < 2; ++c) {
        const double w = (a ? wm : 1 - wm) * (b ? wn : 1 - wn) * (c ? wk : 1 - wk);
        if (w > 0) log_rate += w * rate_at(im + size_t(a), in + size_t(b), ik + size_t(c));
      }
  return std::exp(log_rate);
}

}  // namespace

double gemm_seconds(const Accelerator& a, DType dtype, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0.0;
  const std::vector<GemmRate>& measured = dtype == DType::f32 ? a.gemm_rates_32 : a.gemm_rates_16;
  if (!measured.empty())
    return 2.0 * double(m) * double(n) * double(k) / interpolated_rate(measured, m, n, k) + a.launch_seconds;
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
  const double ring = 2.0 * (n - 1) / n * bytes / g.bandwidth + 2.0 * (n - 1) * g.latency;
  const double tree = 2.0 * bytes / g.bandwidth + 2.0 * std::ceil(std::log2(n)) * g.latency;
  return std::min(ring, tree);
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
