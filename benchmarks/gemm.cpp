// GEMM benchmark: square f32 matrix products through the tensor API
// (ops::matmul) against OpenBLAS's cblas_sgemm called directly on the same
// buffers, and bf16 products through the tensor API (oneDNN). Runs of the two
// f32 paths are interleaved (alternating which goes first) so drifting clocks
// and neighbours hit both alike; each figure is the median of --repeats timed
// runs after a warm-up. Prints machine-readable lines:
//   gemm openblas_core=SkylakeX openblas_threads=2 omp_threads=2
//   gemm n=1024 impl=tessera sgemm_gflops=372.1
//   gemm n=1024 impl=openblas sgemm_gflops=375.0
//   gemm n=1024 tessera_over_openblas=0.99
//   gemm n=1024 impl=tessera bf16_gflops=2150.3
#include <cblas.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GEMM: tensor API (ops::matmul) vs OpenBLAS cblas_sgemm, and bf16 through the tensor API"};
  std::vector<int64_t> sizes{1024, 2048, 4096};
  int repeats = 9;
  app.add_option("--sizes", sizes, "matrix sizes M = N = K")->delimiter(',');
  app.add_option("--repeats", repeats, "timed runs per measurement (median reported)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  using namespace tessera;
  Context ctx;
  std::printf("gemm openblas_core=%s openblas_threads=%d omp_threads=%d\n", openblas_get_corename(),
              openblas_get_num_threads(), omp_get_max_threads());
  std::fflush(stdout);

  for (const int64_t n : sizes) {
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

    Tensor a16 = ctx.empty(shape, DType::bf16), b16 = ctx.empty(shape, DType::bf16),
           c16 = ctx.empty(shape, DType::bf16);
    a16.uniform_(generator, -1.0f, 1.0f, 3);
    b16.uniform_(generator, -1.0f, 1.0f, 4);
    const auto run_bf16 = [&] { ops::matmul(a16, b16, c16); };
    run_bf16();
    std::vector<double> t_bf16;
    for (int r = 0; r < repeats; ++r) t_bf16.push_back(seconds(run_bf16));
    std::printf("gemm n=%lld impl=tessera bf16_gflops=%.1f\n", (long long)n, gflops(n, median(t_bf16)));
    std::fflush(stdout);
  }
  return 0;
}
