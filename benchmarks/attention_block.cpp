// Blockwise attention benchmark: ops::attention_block_forward/backward (context
// parallelism's ring, one block holding every key of the sequence at
// positions 0..T−1, so the work equals causal attention's) against
// ops::grouped_attention_forward/backward (the training attention) on the
// same shapes, on the CPU: B = 1, G = 4 key/value heads of R = 2 query heads,
// Dh = 64, for each --seq-lens and --dtypes. Each figure is the median of
// --repeats timed runs after one warm-up. Prints the machine (lscpu's model
// name and widest vector ISA) and machine-readable lines:
//   attention_block cpu_model="..." isa=avx512 omp_threads=2
//   attention_block t=2048 dtype=f32 op=block_forward seconds=0.091
//   attention_block t=2048 dtype=f32 op=grouped_forward seconds=0.087
//   attention_block t=2048 dtype=f32 block_over_grouped_forward=1.05
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "kernels/ops.h"

namespace tessera {
namespace {

constexpr int64_t kGroups = 4, kPerGroup = 2, kHeadDim = 64;

using Clock = std::chrono::steady_clock;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// The median of `repeats` timed runs of fn after one warm-up.
template <typename Fn>
double median_seconds(int repeats, Fn&& fn) {
  fn();
  std::vector<double> runs;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    runs.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return median(runs);
}

// lscpu's "Model name" and the widest of avx512f / avx2 / sse4_2 in its flags.
void print_machine() {
  std::string model = "unknown", isa = "baseline", line;
  if (FILE* pipe = popen("lscpu 2>/dev/null", "r")) {
    char buffer[8192];
    while (fgets(buffer, sizeof buffer, pipe)) {
      line = buffer;
      if (line.rfind("Model name:", 0) == 0) model = line.substr(line.find_first_not_of(" ", 11));
      if (line.rfind("Flags:", 0) == 0)
        for (const char* flag : {"sse4_2", "avx2", "avx512f"})
          if (line.find(std::string(" ") + flag) != std::string::npos) isa = flag;
    }
    pclose(pipe);
  }
  model.erase(model.find_last_not_of(" \n") + 1);
  std::printf("attention_block cpu_model=\"%s\" isa=%s omp_threads=%d\n", model.c_str(), isa.c_str(),
              omp_get_max_threads());
}

Tensor random(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::vector<double> values(size_t(shape.numel()));
  for (double& v : values) v = unit(rng);
  return ctx.from_doubles(shape, dtype, values);
}

void print(int64_t t, DType dtype, const char* what, double value) {
  std::printf("attention_block t=%lld dtype=%s %s=%.4f\n", static_cast<long long>(t),
              std::string(dtype_name(dtype)).c_str(), what, value);
}

void bench(Context& ctx, int64_t t, DType dtype, int repeats) {
  std::mt19937_64 rng(7);
  const int64_t heads = kGroups * kPerGroup;
  // Training attention: qkv [1, T, G, R + 2, Dh].
  const Tensor qkv = random(ctx, Shape{1, t, kGroups, kPerGroup + 2, kHeadDim}, dtype, rng);
  Tensor out = ctx.empty(Shape{1, t, heads, kHeadDim}, dtype), lse = ctx.empty(Shape{1, heads, t}, DType::f32);
  Tensor grad_qkv = ctx.empty(qkv.shape(), dtype);
  const Tensor grad_out = random(ctx, out.shape(), dtype, rng);
  // Blockwise: q [1, T, H, Dh], kv [1, T, G, 2, Dh], every key in the block.
  const Tensor q = random(ctx, Shape{1, t, heads, kHeadDim}, dtype, rng);
  const Tensor kv = random(ctx, Shape{1, t, kGroups, 2, kHeadDim}, dtype, rng);
  std::vector<int64_t> positions(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) positions[size_t(i)] = i;
  const Tensor pos = ctx.from_vector(Shape{t}, positions);
  Tensor block_out = ctx.empty(q.shape(), DType::f32), block_lse = ctx.empty(Shape{1, heads, t}, DType::f32);
  Tensor block_out_cast = ctx.empty(q.shape(), dtype);
  Tensor grad_q = ctx.zeros(q.shape(), DType::f32), grad_kv = ctx.zeros(kv.shape(), DType::f32);

  const double grouped_forward = median_seconds(repeats, [&] { ops::grouped_attention_forward(qkv, out, lse); });
  const double block_forward =
      median_seconds(repeats, [&] { ops::attention_block_forward(q, kv, pos, pos, block_out, block_lse); });
  ops::cast(block_out, block_out_cast);
  const double grouped_backward =
      median_seconds(repeats, [&] { ops::grouped_attention_backward(grad_out, qkv, out, lse, grad_qkv); });
  const double block_backward = median_seconds(repeats, [&] {
    ops::attention_block_backward(grad_out, q, kv, block_out_cast, block_lse, pos, pos, grad_q, grad_kv);
  });
  print(t, dtype, "op=block_forward seconds", block_forward);
  print(t, dtype, "op=grouped_forward seconds", grouped_forward);
  print(t, dtype, "op=block_backward seconds", block_backward);
  print(t, dtype, "op=grouped_backward seconds", grouped_backward);
  print(t, dtype, "block_over_grouped_forward", block_forward / grouped_forward);
  print(t, dtype, "block_over_grouped_backward", block_backward / grouped_backward);
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  CLI::App app{"blockwise vs training attention on the CPU"};
  std::vector<int64_t> seq_lens{1024, 2048, 4096};
  std::vector<std::string> dtypes{"f32", "bf16"};
  int repeats = 5;
  app.add_option("--seq-lens", seq_lens, "sequence lengths T");
  app.add_option("--dtypes", dtypes, "input dtypes (f32, bf16, f16)");
  app.add_option("--repeats", repeats, "timed runs per figure (the median is printed)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  tessera::print_machine();
  tessera::Context ctx;
  for (const std::string& name : dtypes)
    for (const int64_t t : seq_lens) tessera::bench(ctx, t, tessera::parse_dtype(name), repeats);
  return 0;
}
