// plan::measure_compute (plan/calibration.h): this machine's GEMM rates by
// shape and precision, memory-bound bandwidth, fused attention's FLOP/s and a
// kernel call's cost, timed with Tessera's own operators (the ones training
// runs) on every rank at once; the figures are the ranks' means.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "kernels/ops.h"
#include "plan/calibration.h"

namespace tessera::plan {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The median seconds of `repeats` calls after one warm-up. No barrier
// between measurements: every rank runs the whole series at once, so ranks
// that share cores are measured sharing them (a barrier before each
// measurement would let ranks that leave it first run alone). The ranks'
// means are taken once, at the end (mean_over_ranks).
double timed(Context& ctx, int repeats, const std::function<void()>& run) {
  run();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const double start = now();
    run();
    ctx.synchronize(Device::cpu());
    times.push_back(now() - start);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Each value averaged over the ranks, in one collective.
std::vector<double> mean_over_ranks(Context& ctx, parallel::Communicator& world, const std::vector<double>& values) {
  std::vector<float> narrow(values.begin(), values.end());
  Tensor t = ctx.from_vector(Shape{int64_t(narrow.size())}, narrow);
  world.all_reduce(t, parallel::ReduceOp::avg)->wait();
  const std::vector<float> mean = t.to_vector<float>();
  return std::vector<double>(mean.begin(), mean.end());
}

Tensor random(Context& ctx, const Shape& shape, DType dtype, uint64_t stream) {
  Generator generator(1234);
  Tensor t = ctx.empty(shape, dtype);
  t.uniform_(generator, -1.0f, 1.0f, stream);
  return t;
}

std::vector<GemmRate> gemm_grid(Context& ctx, DType dtype, bool quick) {
  const std::vector<int64_t> ms = quick ? std::vector<int64_t>{64, 512} : std::vector<int64_t>{32, 128, 512, 2048};
  const std::vector<int64_t> nk = quick ? std::vector<int64_t>{64, 512} : std::vector<int64_t>{32, 128, 512, 2048};
  std::vector<GemmRate> rates;
  for (const int64_t m : ms)
    for (const int64_t n : nk)
      for (const int64_t k : nk) {
        const Tensor a = random(ctx, Shape{m, k}, dtype, 1), b = random(ctx, Shape{k, n}, dtype, 2);
        Tensor c = ctx.empty(Shape{m, n}, dtype);
        const double flops = 2.0 * double(m) * double(n) * double(k);
        // Enough calls for ~50 ms a repeat (many of the scheduler's time slices
        // when ranks share cores), so neither the timer nor the slicing is noise.
        const int calls = int(std::clamp((quick ? 5e7 : 5e8) / flops, 1.0, 20000.0));
        const double seconds = timed(ctx, quick ? 2 : 5, [&] {
          for (int i = 0; i < calls; ++i) ops::matmul(a, b, c);
        });
        rates.push_back({m, n, k, flops * calls / seconds});
      }
  return rates;
}

double peak_of(const std::vector<GemmRate>& rates) {
  double peak = 0;
  for (const GemmRate& r : rates) peak = std::max(peak, r.flops);
  return peak;
}

}  // namespace

Accelerator measure_compute(Context& ctx, parallel::Communicator& world, bool quick) {
  Accelerator a = accelerator_named("cpu");
  world.barrier();  // start together; from here every rank keeps busy until the end
  a.gemm_rates_32 = gemm_grid(ctx, DType::f32, quick);
  a.gemm_rates_16 = gemm_grid(ctx, DType::bf16, quick);
  // Memory-bound: out = x + y over tensors far larger than the caches (3 × 4 bytes an element).
  const int64_t elements = quick ? (int64_t(1) << 22) : (int64_t(1) << 24);
  const Tensor x = random(ctx, Shape{elements}, DType::f32, 3), y = random(ctx, Shape{elements}, DType::f32, 4);
  Tensor sum = ctx.empty(Shape{elements}, DType::f32);
  const double add_seconds = timed(ctx, quick ? 2 : 5, [&] { ops::add(x, y, sum); });
  // One call on a few elements: what every kernel costs besides its work.
  const Tensor tiny = random(ctx, Shape{16}, DType::f32, 5);
  Tensor tiny_out = ctx.empty(Shape{16}, DType::f32);
  const double call_seconds = timed(ctx, 3,
                                    [&] {
                                      for (int i = 0; i < 1000; ++i) ops::add(tiny, tiny, tiny_out);
                                    }) /
                              1000;
  // The fused attention, forward and backward, causal: 4·B·T²·H·Dh/2 FLOPs forward, 2.5× that backward.
  const int64_t b = 2, t = quick ? 128 : 256, h = 4, dh = 32;
  const Tensor qkv = random(ctx, Shape{b, t, 3, h, dh}, DType::f32, 6);
  Tensor out = ctx.empty(Shape{b, t, h, dh}, DType::f32), lse = ctx.empty(Shape{b, h, t}, DType::f32);
  Tensor grad_qkv = ctx.empty(qkv.shape(), DType::f32);
  const Tensor grad_out = random(ctx, out.shape(), DType::f32, 7);
  const double attention_flops = 3.5 * 4.0 * double(b * t * t * h * dh) / 2;
  const double attention_seconds = timed(ctx, quick ? 2 : 3, [&] {
    ops::attention_forward(qkv, out, lse);
    ops::attention_backward(grad_out, qkv, out, lse, grad_qkv);
  });
  // The ranks' means, all at once.
  std::vector<double> values;
  for (const auto* rates : {&a.gemm_rates_32, &a.gemm_rates_16})
    for (const GemmRate& r : *rates) values.push_back(r.flops);
  values.insert(values.end(), {add_seconds, call_seconds, attention_seconds});
  values = mean_over_ranks(ctx, world, values);
  size_t i = 0;
  for (auto* rates : {&a.gemm_rates_32, &a.gemm_rates_16})
    for (GemmRate& r : *rates) r.flops = values[i++];
  a.peak_flops_32 = peak_of(a.gemm_rates_32);
  a.peak_flops_16 = peak_of(a.gemm_rates_16);
  a.gemm_efficiency = 1.0;
  a.memory_bandwidth = 12.0 * double(elements) / values[i];
  a.memory_efficiency = 1.0;
  a.launch_seconds = values[i + 1];
  a.attention_efficiency = attention_flops / values[i + 2] / a.peak_flops_32;
  char source[256];
  std::snprintf(source, sizeof source,
                "measured by tessera selfcheck --cluster on %d rank(s) at once: GEMM grid %zu shapes per precision, "
                "add bandwidth, fused attention B%lld T%lld H%lld Dh%lld",
                world.size(), a.gemm_rates_32.size(), static_cast<long long>(b), static_cast<long long>(t),
                static_cast<long long>(h), static_cast<long long>(dh));
  a.source = source;
  return a;
}

}  // namespace tessera::plan
