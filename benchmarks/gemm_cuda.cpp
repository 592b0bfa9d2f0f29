// GPU GEMM benchmark: square matrix products on one CUDA device through the
// tensor API (ops::matmul, which calls cuBLASLt) against cuBLAS called
// directly (cublasGemmEx) on the same device buffers and the same stream.
//   f32:  both with CUBLAS_COMPUTE_32F (FMA, no TF32), as ops::matmul computes
//         f32; cuBLAS with CUBLAS_COMPUTE_32F_FAST_TF32 is printed beside them
//         as the ceiling that TF32 would give (Tessera does not use TF32).
//   bf16: bf16 A, B and C, f32 accumulation, for both.
// A timed sample is --calls back-to-back products between two CUDA events on
// the compute stream (so the host's per-call cost counts if it outruns the
// GPU); each figure is the median of --repeats samples after a warm-up, the two
// implementations interleaved (alternating which goes first) so clock and
// temperature drift hit both alike. Tessera's C is also compared with
// cuBLAS's (the relative Frobenius norm of the difference), so a fast wrong
// product cannot pass for a fast one. Small products (decode, small models)
// are bound by the host's cost per call more than by the GPU: for them read
// us_per_call (between the events) and host_us_per_call (the host's time to
// queue one call, the stream drained before and after; cuBLAS's is the floor,
// Tessera's adds its checks, descriptors and algorithm look-up). Prints
// machine-readable lines:
//   gemm_cuda device="NVIDIA H100 80GB HBM3" sm=90 sms=132 runtime=13000 driver=13000 cublas=130100
//   gemm_cuda n=8192 dtype=bf16 impl=tessera tflops=650.2
//   gemm_cuda n=8192 dtype=bf16 impl=cublas tflops=655.0
//   gemm_cuda n=8192 dtype=bf16 tessera_over_cublas=0.993
//   gemm_cuda n=8192 dtype=bf16 rel_diff=0
//   gemm_cuda n=64 dtype=bf16 impl=tessera us_per_call=6.1 host_us_per_call=5.8
//   gemm_cuda n=64 dtype=bf16 impl=cublas us_per_call=4.2 host_us_per_call=3.9
//   gemm_cuda n=8192 dtype=f32 impl=cublas_tf32 tflops=380.1
// Exits 1 with a message when there is no CUDA device.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_libraries.h"
#include "core/stream.h"
#include "kernels/ops.h"

namespace {

using namespace tessera;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

double tflops(int64_t n, double seconds_per_product) {
  return 2.0 * double(n) * double(n) * double(n) / seconds_per_product * 1e-12;
}

// Seconds per product: `calls` products between two events on `stream`.
template <typename Fn>
double seconds_per_call(const Stream& stream, int calls, Fn&& fn) {
  Event start(stream.device(), /*timing=*/true), stop(stream.device(), /*timing=*/true);
  start.record(stream);
  for (int i = 0; i < calls; ++i) fn();
  stop.record(stream);
  stop.synchronize();
  return double(start.elapsed_ms(stop)) * 1e-3 / calls;
}

// Host seconds to queue one call: `calls` calls between two host clock
// readings, the stream drained before (so the queue has room) and after.
template <typename Fn>
double host_seconds_per_call(const Stream& stream, int calls, Fn&& fn) {
  stream.synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  const auto stop = std::chrono::steady_clock::now();
  stream.synchronize();
  return std::chrono::duration<double>(stop - start).count() / calls;
}

// ‖x − reference‖ / ‖reference‖ over all elements, in double on the host.
double relative_difference(const Tensor& x, const Tensor& reference) {
  const std::vector<double> a = x.to_doubles(), b = reference.to_doubles();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

struct Case {
  DType dtype;
  const char* name;
  cudaDataType_t cuda_type;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPU GEMM: tensor API (ops::matmul, cuBLASLt) vs cublasGemmEx on the same buffers, f32 and bf16"};
  std::vector<int64_t> sizes{4096, 8192};
  std::vector<std::string> dtypes{"f32", "bf16"};
  int repeats = 9, calls = 5, device_index = 0;
  app.add_option("--sizes", sizes, "matrix sizes M = N = K")->delimiter(',');
  app.add_option("--dtypes", dtypes, "f32 and/or bf16")->delimiter(',')->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--repeats", repeats, "timed samples per measurement (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--calls", calls, "back-to-back products per timed sample")->check(CLI::PositiveNumber);
  app.add_option("--device", device_index, "CUDA device index")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  int device_count = 0;
  const cudaError_t count_status = cudaGetDeviceCount(&device_count);
  if (count_status != cudaSuccess || device_count <= device_index) {
    std::fprintf(stderr, "gemm_cuda: no CUDA device %d here (%d device(s); cudaGetDeviceCount: %s)\n", device_index,
                 device_count, cudaGetErrorString(count_status));
    return 1;
  }

  try {
    Context ctx;
    const Device device = Device::cuda(device_index);
    cudaDeviceProp properties{};
    TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&properties, device_index));
    int runtime_version = 0, driver_version = 0, cublas_version = 0;
    TESSERA_CUDA_CHECK(cudaRuntimeGetVersion(&runtime_version));
    TESSERA_CUDA_CHECK(cudaDriverGetVersion(&driver_version));
    cublasHandle_t cublas = ctx.cuda_libraries(device_index).cublas();  // bound to the compute stream
    TESSERA_CUBLAS_CHECK(cublasGetVersion(cublas, &cublas_version));
    std::printf("gemm_cuda device=\"%s\" sm=%d%d sms=%d runtime=%d driver=%d cublas=%d\n", properties.name,
                properties.major, properties.minor, properties.multiProcessorCount, runtime_version, driver_version,
                cublas_version);
    std::fflush(stdout);
    const Stream& stream = ctx.compute_stream(device);

    for (const int64_t n : sizes) {
      for (const std::string& dtype_text : dtypes) {
        const Case c =
            dtype_text == "f32" ? Case{DType::f32, "f32", CUDA_R_32F} : Case{DType::bf16, "bf16", CUDA_R_16BF};
        const Shape shape{n, n};
        Generator generator{1234};
        Tensor a = ctx.empty(shape, c.dtype, device), b = ctx.empty(shape, c.dtype, device);
        Tensor c_tessera = ctx.empty(shape, c.dtype, device), c_cublas = ctx.empty(shape, c.dtype, device);
        a.uniform_(generator, -1.0f, 1.0f, 1);
        b.uniform_(generator, -1.0f, 1.0f, 2);
        const float alpha = 1.0f, beta = 0.0f;
        const int dim = int(n);
        // Row-major C = A·B is the column-major product Cᵀ = Bᵀ·Aᵀ on the same buffers.
        const auto run_cublas = [&](cublasComputeType_t compute) {
          return [&, compute] {
            TESSERA_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &alpha, b.data_ptr(),
                                              c.cuda_type, dim, a.data_ptr(), c.cuda_type, dim, &beta,
                                              c_cublas.data_ptr(), c.cuda_type, dim, compute, CUBLAS_GEMM_DEFAULT));
          };
        };
        const auto run_tessera = [&] { ops::matmul(a, b, c_tessera); };
        const auto run_reference = run_cublas(CUBLAS_COMPUTE_32F);
        for (int i = 0; i < 3; ++i) {  // warm-up: heuristics, workspaces, clocks
          run_tessera();
          run_reference();
        }
        ctx.synchronize(device);
        std::vector<double> t_tessera, t_cublas, pair_ratios;
        for (int r = 0; r < repeats; ++r) {
          if (r % 2 == 0) {
            t_tessera.push_back(seconds_per_call(stream, calls, run_tessera));
            t_cublas.push_back(seconds_per_call(stream, calls, run_reference));
          } else {
            t_cublas.push_back(seconds_per_call(stream, calls, run_reference));
            t_tessera.push_back(seconds_per_call(stream, calls, run_tessera));
          }
          pair_ratios.push_back(t_cublas.back() / t_tessera.back());  // throughput ratio of one A/B pair
        }
        std::printf("gemm_cuda n=%lld dtype=%s impl=tessera tflops=%.1f\n", (long long)n, c.name,
                    tflops(n, median(t_tessera)));
        std::printf("gemm_cuda n=%lld dtype=%s impl=cublas tflops=%.1f\n", (long long)n, c.name,
                    tflops(n, median(t_cublas)));
        std::printf("gemm_cuda n=%lld dtype=%s tessera_over_cublas=%.3f\n", (long long)n, c.name, median(pair_ratios));
        std::vector<double> host_tessera, host_cublas;
        for (int r = 0; r < repeats; ++r) {
          host_tessera.push_back(host_seconds_per_call(stream, calls, run_tessera));
          host_cublas.push_back(host_seconds_per_call(stream, calls, run_reference));
        }
        std::printf("gemm_cuda n=%lld dtype=%s impl=tessera us_per_call=%.2f host_us_per_call=%.2f\n", (long long)n,
                    c.name, 1e6 * median(t_tessera), 1e6 * median(host_tessera));
        std::printf("gemm_cuda n=%lld dtype=%s impl=cublas us_per_call=%.2f host_us_per_call=%.2f\n", (long long)n,
                    c.name, 1e6 * median(t_cublas), 1e6 * median(host_cublas));
        // Both products are now in place (the last call of each wrote its C).
        std::printf("gemm_cuda n=%lld dtype=%s rel_diff=%.3g\n", (long long)n, c.name,
                    relative_difference(c_tessera, c_cublas));
        std::fflush(stdout);
        if (c.dtype == DType::f32) {
          const auto run_tf32 = run_cublas(CUBLAS_COMPUTE_32F_FAST_TF32);
          run_tf32();
          std::vector<double> t_tf32;
          for (int r = 0; r < repeats; ++r) t_tf32.push_back(seconds_per_call(stream, calls, run_tf32));
          std::printf("gemm_cuda n=%lld dtype=f32 impl=cublas_tf32 tflops=%.1f\n", (long long)n,
                      tflops(n, median(t_tf32)));
          std::fflush(stdout);
        }
      }
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "gemm_cuda: %s\n", error.what());
    return 1;
  }
  return 0;
}
