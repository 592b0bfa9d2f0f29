// plan::measure_links (plan/calibration.h): the links as `tessera plan` sees
// them, measured on the allocation. Times all-reduce, all-gather and
// reduce-scatter over the ranks of one node and over one rank per node, and
// send/recv between ring neighbours, on f32 tensors of 4 KiB to 64 MiB; the
// figure of a size is the median over repeats of the slowest rank's time.
// Bus bandwidths as nccl-tests report them; α (seconds per ring step) and β
// (bus bandwidth) fitted per link class on t = steps·α + traffic/β.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/error.h"
#include "plan/calibration.h"

namespace tessera::plan {
namespace {

using parallel::Communicator;
using parallel::ReduceOp;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The slowest rank's seconds for `run` over `group`, the median of
// `repeats` after one warm-up (of an even count: the mean of the middle two).
double slowest_median(Context& ctx, Communicator& group, int repeats, const std::function<void()>& run) {
  run();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    group.barrier();
    const double start = now();
    run();
    Tensor elapsed = ctx.from_vector(Shape{1}, std::vector<float>{float(now() - start)});
    group.all_reduce(elapsed, ReduceOp::max)->wait();
    times.push_back(double(elapsed.to_vector<float>()[0]));
  }
  std::sort(times.begin(), times.end());
  const size_t middle = times.size() / 2;
  return times.size() % 2 == 1 ? times[middle] : (times[middle - 1] + times[middle]) / 2;
}

// The ring steps and bytes each rank sends per byte of the tensor, as a ring
// runs the collective over `n` ranks (nccl-tests' bus bandwidth factor).
struct RingCost {
  double steps = 0, traffic = 0;
};
RingCost ring_cost(const std::string& collective, int n) {
  if (collective == "all_reduce") return {2.0 * (n - 1), 2.0 * (n - 1) / n};
  if (collective == "send_recv") return {1.0, 1.0};
  return {double(n - 1), double(n - 1) / n};  // all_gather, reduce_scatter
}

// One collective of `bytes` (the whole tensor) over `group`, timed.
LinkSample time_one(Context& ctx, Communicator& group, const std::string& collective, const std::string& link,
                    int64_t bytes, int repeats) {
  const int n = group.size();
  const int64_t block = std::max<int64_t>(1, bytes / 4 / n), elements = block * n;
  Tensor whole = ctx.zeros(Shape{elements}, DType::f32), part = ctx.zeros(Shape{block}, DType::f32);
  Tensor message = ctx.zeros(Shape{elements}, DType::f32), received = ctx.zeros(Shape{elements}, DType::f32);
  const int next = (group.rank() + 1) % n, previous = (group.rank() + n - 1) % n;
  const std::function<void()> run = [&] {
    if (collective == "all_reduce") group.all_reduce(whole, ReduceOp::sum)->wait();
    if (collective == "all_gather") group.all_gather(part, whole)->wait();
    if (collective == "reduce_scatter") group.reduce_scatter(whole, part, ReduceOp::sum)->wait();
    if (collective == "send_recv")
      group
          .send_recv({{parallel::P2POp::Kind::send, message, next}, {parallel::P2POp::Kind::recv, received, previous}})
          ->wait();
  };
  LinkSample sample;
  sample.collective = collective;
  sample.link = link;
  sample.ranks = n;
  sample.bytes = double(elements) * 4;
  sample.seconds = slowest_median(ctx, group, repeats, run);
  sample.bus_bandwidth = sample.bytes / sample.seconds * ring_cost(collective, n).traffic;
  return sample;
}

std::vector<int64_t> sizes(bool quick) {
  std::vector<int64_t> out;
  for (int64_t bytes = 4096; bytes <= (quick ? (int64_t(1) << 20) : (int64_t(64) << 20)); bytes *= 4)
    out.push_back(bytes);
  return out;
}

// Every collective at every size over `group` (of link class `link`).
std::vector<LinkSample> measure_group(Context& ctx, Communicator& group, const std::string& link, bool quick) {
  std::vector<LinkSample> samples;
  for (const char* collective : {"all_reduce", "all_gather", "reduce_scatter", "send_recv"})
    for (const int64_t bytes : sizes(quick))
      samples.push_back(time_one(ctx, group, collective, link, bytes, quick ? 2 : 5));
  return samples;
}

// α and β by least squares on t = steps·α + traffic·B/β over the collectives
// (not send/recv), each equation divided by its t (relative errors, so that
// small sizes fix α as large ones fix β); clamped to positive values.
Link fit(const std::vector<LinkSample>& samples, const std::string& link, int world_size) {
  double saa = 0, sab = 0, sbb = 0, sa = 0, sb = 0;  // normal equations of the weighted fit
  std::vector<double> sizes_used;
  for (const LinkSample& s : samples) {
    if (s.link != link || s.collective == "send_recv") continue;
    const RingCost cost = ring_cost(s.collective, s.ranks);
    const double a = cost.steps / s.seconds, b = cost.traffic * s.bytes / s.seconds;
    saa += a * a, sab += a * b, sbb += b * b, sa += a, sb += b;
    if (std::find(sizes_used.begin(), sizes_used.end(), s.bytes) == sizes_used.end()) sizes_used.push_back(s.bytes);
  }
  const double det = saa * sbb - sab * sab;
  double alpha = det != 0 ? (sa * sbb - sb * sab) / det : 0, inverse_beta = det != 0 ? (saa * sb - sab * sa) / det : 0;
  if (alpha <= 0) alpha = 1e-9, inverse_beta = sbb > 0 ? (sb - alpha * sab) / sbb : 0;  // bandwidth alone
  if (inverse_beta <= 0) inverse_beta = 1e-12, alpha = saa > 0 ? (sa - inverse_beta * sab) / saa : 0;  // latency alone
  alpha = std::max(alpha, 1e-9);
  Link out;
  out.name = "measured-" + link;
  out.latency = alpha;
  out.bandwidth = 1.0 / std::max(inverse_beta, 1e-12);
  std::sort(sizes_used.begin(), sizes_used.end());
  char text[200];
  std::snprintf(text, sizeof text, "tessera selfcheck --cluster: %d ranks, fitted on sizes %.0f KiB to %.0f KiB",
                world_size, sizes_used.empty() ? 0.0 : sizes_used.front() / 1024,
                sizes_used.empty() ? 0.0 : sizes_used.back() / 1024);
  out.source = text;
  return out;
}

// Every rank holds the same samples: each sample's slowest group's time
// (concurrent groups of one class may differ).
void agree(Context& ctx, Communicator& world, std::vector<LinkSample>& samples) {
  if (samples.empty()) return;  // the same on every rank: the classes measured depend on the layout only
  std::vector<float> seconds;   // f32: the communicators' dtypes have no f64
  for (const LinkSample& s : samples) seconds.push_back(float(s.seconds));
  Tensor t = ctx.from_vector(Shape{int64_t(seconds.size())}, seconds);
  world.all_reduce(t, ReduceOp::max)->wait();
  const std::vector<float> slowest = t.to_vector<float>();
  for (size_t i = 0; i < samples.size(); ++i) {
    samples[i].bus_bandwidth *= samples[i].seconds / double(slowest[i]);
    samples[i].seconds = double(slowest[i]);
  }
}

}  // namespace

LinkCalibration measure_links(Communicator& world, int ranks_per_node, bool quick) {
  TESSERA_CHECK(ranks_per_node >= 1 && world.size() % ranks_per_node == 0, "measure_links: ", world.size(),
                " ranks are not whole nodes of ", ranks_per_node, " ranks (the launcher's ranks per node)");
  LinkCalibration out;
  Context ctx;
  const int nodes = world.size() / ranks_per_node;
  // Block placement: ranks [k·per_node, (k+1)·per_node) on node k.
  const auto intra = world.split(world.rank() / ranks_per_node, world.rank(), "calibration-intra");
  const auto inter = world.split(world.rank() % ranks_per_node, world.rank(), "calibration-inter");
  out.intra_measured = intra->size() > 1;
  out.inter_measured = nodes > 1;
  if (out.intra_measured) out.samples = measure_group(ctx, *intra, "intra", quick);
  if (out.inter_measured) {
    const std::vector<LinkSample> across = measure_group(ctx, *inter, "inter", quick);
    out.samples.insert(out.samples.end(), across.begin(), across.end());
  }
  agree(ctx, world, out.samples);
  if (out.intra_measured) out.intra = fit(out.samples, "intra", world.size());
  if (out.inter_measured) out.inter = fit(out.samples, "inter", world.size());
  return out;
}

}  // namespace tessera::plan
