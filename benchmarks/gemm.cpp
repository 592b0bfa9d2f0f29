// GEMM benchmark: square f32 matrix products through the tensor API
// (ops::matmul) against OpenBLAS's cblas_sgemm called directly on the same
// buffers, and bf16 products through the tensor API (oneDNN), square and of
// the shapes given by --bf16-shapes (benchmarks/gemm_compare.py passes the
// GPT and Llama layers' and sets them beside PyTorch). Runs of the two f32
// paths are interleaved (alternating which goes first) so drifting clocks and
// neighbours hit both alike; each figure is the median of at least --repeats
// timed runs (and of at least --min-seconds of them) after a warm-up. Prints
// machine-readable lines:
//   gemm openblas_core=SkylakeX openblas_threads=2 omp_threads=2
//   gemm n=1024 impl=tessera sgemm_gflops=372.1
//   gemm n=1024 impl=openblas sgemm_gflops=375.0
//   gemm n=1024 tessera_over_openblas=0.99
//   gemm n=1024 impl=tessera bf16_gflops=2150.3
//   gemm shape=4096x1024x256:nt impl=tessera bf16_gflops=1830.2
// A shape is MxNxK, C [M, N] = op(A) [M, K] · op(B) [K, N], with :nn, :nt
// or :tn saying which operand is stored transposed (as ops::matmul's
// transpose_a / transpose_b; a linear layer's forward is :nt).
#include <cblas.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/context.h"
#include "kernels/ops.h"

// Not declared by every cblas.h; part of OpenBLAS's API.
extern "C" char* openblas_get_corename(void);
extern "C" int openblas_get_num_threads(void);

namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double seconds(Fn&& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

double gflops(int64_t n, double secs) {
  return 2.0 * double(n) * double(n) * double(n) / secs * 1e-9;
}

// The median of timed runs of `fn` after one warm-up: at least `repeats`
// runs, and more until they add up to `min_seconds`.
template <typename Fn>
double median_seconds(Fn&& fn, int repeats, double min_seconds) {
  fn();
  std::vector<double> times;
  double total = 0.0;
  while (int(times.size()) < repeats || total < min_seconds) {
    times.push_back(seconds(fn));
    total += times.back();
  }
  return median(times);
}

// One product C [M, N] = op(A) [M, K] · op(B) [K, N], written MxNxK[:nn|:nt|:tn|:tt].
struct GemmShape {
  std::string text;
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
};

GemmShape parse_shape(const std::string& text) {
  GemmShape shape{text};
  char layout[3] = "nn";
  int dims_end = 0, layout_end = 0;
  std::sscanf(text.c_str(), "%ldx%ldx%ld%n:%2[nt]%n", &shape.m, &shape.n, &shape.k, &dims_end, layout, &layout_end);
  const size_t end = size_t(layout_end > 0 ? layout_end : dims_end);
  if (end != text.size() || (layout_end > 0 && layout_end != dims_end + 3) || shape.m <= 0 || shape.n <= 0 ||
      shape.k <= 0)
    throw std::invalid_argument("--bf16-shapes: '" + text + "' is not MxNxK[:nn|:nt|:tn|:tt] (e.g. 4096x1024x256:nt)");
  shape.transpose_a = layout[0] == 't';
  shape.transpose_b = layout[1] == 't';
  return shape;
}

// bf16 operands of `shape` (stored as op() says), uniform in [-1, 1].
double bf16_gflops(tessera::Context& ctx, const GemmShape& shape, int repeats, double min_seconds) {
  using namespace tessera;
  Generator generator{1234};
  Tensor a = ctx.empty(shape.transpose_a ? Shape{shape.k, shape.m} : Shape{shape.m, shape.k}, DType::bf16);
  Tensor b = ctx.empty(shape.transpose_b ? Shape{shape.n, shape.k} : Shape{shape.k, shape.n}, DType::bf16);
  Tensor c = ctx.empty(Shape{shape.m, shape.n}, DType::bf16);
  a.uniform_(generator, -1.0f, 1.0f, 3);
  b.uniform_(generator, -1.0f, 1.0f, 4);
  ops::MatmulOptions options;
  options.transpose_a = shape.transpose_a;
  options.transpose_b = shape.transpose_b;
  const double secs = median_seconds([&] { ops::matmul(a, b, c, options); }, repeats, min_seconds);
  return 2.0 * double(shape.m) * double(shape.n) * double(shape.k) / secs * 1e-9;
}

// f32 n×n×n through ops::matmul against cblas_sgemm on the same buffers, interleaved.
void measure_f32(tessera::Context& ctx, int64_t n, int repeats) {
  using namespace tessera;
  const Shape shape{n, n};
  Generator generator{1234};
  Tensor a = ctx.empty(shape, DType::f32), b = ctx.empty(shape, DType::f32), c = ctx.empty(shape, DType::f32);
  a.uniform_(generator, -1.0f, 1.0f, 1);
  b.uniform_(generator, -1.0f, 1.0f, 2);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* pc = c.data<float>();
  const auto run_tessera = [&] { ops::matmul(a, b, c); };
  const auto run_openblas = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(n), int(n), 1.0f, pa, int(n), pb, int(n), 0.0f,
                pc, int(n));
  };
  run_tessera();  // warm-up: page faults, oneDNN/OpenBLAS buffers, caches
  run_openblas();
  std::vector<double> t_tessera, t_openblas, pair_ratios;
  for (int r = 0; r < repeats; ++r) {
    if (r % 2 == 0) {
      t_tessera.push_back(seconds(run_tessera));
      t_openblas.push_back(seconds(run_openblas));
    } else {
      t_openblas.push_back(seconds(run_openblas));
      t_tessera.push_back(seconds(run_tessera));
    }
    pair_ratios.push_back(t_openblas.back() / t_tessera.back());  // throughput ratio of one A/B pair
  }
  const double tessera_gflops = gflops(n, median(t_tessera)), openblas_gflops = gflops(n, median(t_openblas));
  std::printf("gemm n=%lld impl=tessera sgemm_gflops=%.1f\n", (long long)n, tessera_gflops);
  std::printf("gemm n=%lld impl=openblas sgemm_gflops=%.1f\n", (long long)n, openblas_gflops);
  // The median of per-pair ratios: robust to the machine's speed drifting between pairs.
  std::printf("gemm n=%lld tessera_over_openblas=%.3f\n", (long long)n, median(pair_ratios));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GEMM: tensor API (ops::matmul) vs OpenBLAS cblas_sgemm, and bf16 through the tensor API"};
  std::vector<int64_t> sizes{1024, 2048, 4096};
  std::vector<std::string> shape_texts;
  int repeats = 9;
  double min_seconds = 0.0;
  bool bf16_only = false;
  app.add_option("--sizes", sizes, "matrix sizes M = N = K (default 1024,2048,4096 without --bf16-shapes)")
      ->delimiter(',');
  app.add_option("--bf16-shapes", shape_texts, "more bf16 products, MxNxK[:nn|:nt|:tn] (e.g. 4096x1024x256:nt)")
      ->delimiter(',');
  app.add_flag("--bf16-only", bf16_only, "only the bf16 products (no f32 against OpenBLAS)");
  app.add_option("--repeats", repeats, "timed runs per measurement (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--min-seconds", min_seconds, "time each bf16 product for at least this long (more runs)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (app.count("--sizes") == 0 && !shape_texts.empty()) sizes.clear();  // only the shapes asked for
  std::vector<GemmShape> shapes;
  try {
    for (const std::string& text : shape_texts) shapes.push_back(parse_shape(text));
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "gemm: %s\n", error.what());
    return 2;
  }

  using namespace tessera;
  Context ctx;
  std::printf("gemm openblas_core=%s openblas_threads=%d omp_threads=%d\n", openblas_get_corename(),
              openblas_get_num_threads(), omp_get_max_threads());
  std::fflush(stdout);

  for (const int64_t n : sizes) {
    if (!bf16_only) measure_f32(ctx, n, repeats);
    const GemmShape square{std::to_string(n), n, n, n};
    std::printf("gemm n=%lld impl=tessera bf16_gflops=%.1f\n", (long long)n,
                bf16_gflops(ctx, square, repeats, min_seconds));
    std::fflush(stdout);
  }
  for (const GemmShape& shape : shapes) {
    std::printf("gemm shape=%s impl=tessera bf16_gflops=%.1f\n", shape.text.c_str(),
                bf16_gflops(ctx, shape, repeats, min_seconds));
    std::fflush(stdout);
  }
  return 0;
}
