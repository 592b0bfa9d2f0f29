// CpuBackend: dropout (functor in kernels/functors/dropout.h; the mask comes
// from the counter-based RNG, so the backward pass regenerates it).
#include "kernels/functors/dropout.h"

#include <algorithm>

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

// The Philox rounds make each element ~40 integer operations: a smaller grain than copies.
constexpr int64_t kDropoutGrain = int64_t(1) << 13;
// Elements per block, in three loops that each vectorise: inputs converted to
// f32, then the mask and scale (Philox), then the outputs rounded to T.
constexpr int64_t kBlock = 256;

void run_dropout(const Tensor& in, Tensor& out, float p, uint64_t seed, uint64_t offset, std::string_view what) {
  dispatch_float(in.dtype(), what, [&](auto tag) {
    using T = decltype(tag);
    const DropoutApply<T> op{in.data<T>(), out.data<T>(), p, dropout_scale(p), seed, offset};
    parallel_for(in.numel(), kDropoutGrain, [&](int64_t begin, int64_t end) {
      const DropoutApply<T> local = op;  // a private copy: its fields provably do not change in the loops
      float values[kBlock];
      for (int64_t block = begin; block < end; block += kBlock) {
        const int64_t count = std::min(kBlock, end - block);
        const T* src = local.in + block;
        T* dst = local.out + block;
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) values[j] = to_float(src[j]);
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) values[j] = local.apply(values[j], block + j);
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) dst[j] = from_float<T>(values[j]);
      }
    });
  });
}

}  // namespace

void CpuBackend::dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset) {
  run_dropout(x, y, p, seed, offset, "dropout_forward");
}

void CpuBackend::dropout_backward(const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset) {
  run_dropout(grad_y, grad_x, p, seed, offset, "dropout_backward");
}

}  // namespace tessera
