// CudaBackend: whole-tensor reductions and their gradients (math in
// kernels/functors/reduce.h). Two passes, no atomics: a grid whose size
// depends only on n writes one partial per block into scratch (from the
// context's allocator), then a single block combines the partials in a fixed
// tree and writes out[0]. The result is the same run to run, on any GPU.
// max_backward finds the first maximum the same way (value, index pairs),
// keeps its index on the device, and writes the gradient with an index functor.
#include <algorithm>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/reduce.h"

namespace tessera {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kItemsPerThread = 16;
constexpr int64_t kMaxBlocks = 1024;

int reduce_blocks(int64_t n) {
  return int(std::clamp<int64_t>((n + kThreads * kItemsPerThread - 1) / (kThreads * kItemsPerThread), 1, kMaxBlocks));
}

__device__ __forceinline__ float shuffle_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ ArgMax shuffle_xor(const ArgMax& v, int mask) {
  return {__shfl_xor_sync(0xffffffffu, v.value, mask), __shfl_xor_sync(0xffffffffu, v.index, mask)};
}

// Combines one value per thread of a kThreads block in a fixed tree; thread 0 gets the result.
template <typename V, typename Combine>
__device__ V block_reduce(V v, const V& identity, Combine combine) {
  __shared__ V warp_results[kWarps];
  const int lane = int(threadIdx.x & 31u), warp = int(threadIdx.x >> 5);
  for (int mask = 16; mask > 0; mask >>= 1) v = combine(v, shuffle_xor(v, mask));
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? warp_results[lane] : identity;
    for (int mask = 16; mask > 0; mask >>= 1) v = combine(v, shuffle_xor(v, mask));
  }
  return v;
}

template <ReduceKind K>
struct CombineOp {
  __device__ float operator()(float a, float b) const { return ReduceOp<K>::combine(a, b); }
};
struct CombineArgMax {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const { return ArgMax::combine(a, b); }
};

template <typename T, ReduceKind K>
__global__ void __launch_bounds__(kThreads) reduce_partials_kernel(const T* x, int64_t n, float* partials) {
  using Op = ReduceOp<K>;
  float acc = Op::template identity<float>();
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    acc = Op::combine(acc, Op::template transform<float>(to_float(x[i])));
  acc = block_reduce(acc, Op::template identity<float>(), CombineOp<K>{});
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <ReduceKind K>
__global__ void __launch_bounds__(kThreads)
    reduce_final_kernel(const float* partials, int count, int64_t n, float* out) {
  using Op = ReduceOp<K>;
  float acc = Op::template identity<float>();
  for (int i = int(threadIdx.x); i < count; i += kThreads) acc = Op::combine(acc, partials[i]);
  acc = block_reduce(acc, Op::template identity<float>(), CombineOp<K>{});
  if (threadIdx.x == 0) out[0] = Op::finalize(acc, n);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    argmax_partials_kernel(const T* x, int64_t n, float* values, int64_t* indices) {
  ArgMax best = ArgMax::identity();
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    best = ArgMax::combine(best, ArgMax{to_float(x[i]), i});
  best = block_reduce(best, ArgMax::identity(), CombineArgMax{});
  if (threadIdx.x == 0) values[blockIdx.x] = best.value, indices[blockIdx.x] = best.index;
}

__global__ void __launch_bounds__(kThreads)
    argmax_final_kernel(const float* values, const int64_t* indices, int count, int64_t* result) {
  ArgMax best = ArgMax::identity();
  for (int i = int(threadIdx.x); i < count; i += kThreads) best = ArgMax::combine(best, ArgMax{values[i], indices[i]});
  best = block_reduce(best, ArgMax::identity(), CombineArgMax{});
  if (threadIdx.x == 0) result[0] = best.index;
}

}  // namespace

void CudaBackend::reduce(ReduceKind kind, const Tensor& x, Tensor& out) {
  const cudaStream_t stream = cuda::device_stream(x);
  const int64_t n = x.numel();
  const int blocks = reduce_blocks(n);
  Tensor partials = x.context().empty(Shape{blocks}, DType::f32, x.device());
  dispatch_float(x.dtype(), "reduce", [&](auto tag) {
    using T = decltype(tag);
    dispatch_reduce_kind(kind, [&](auto k) {
      constexpr ReduceKind K = decltype(k)::value;
      reduce_partials_kernel<T, K><<<blocks, kThreads, 0, stream>>>(x.data<T>(), n, partials.data<float>());
      TESSERA_CUDA_CHECK_LAUNCH();
      reduce_final_kernel<K><<<1, kThreads, 0, stream>>>(partials.data<float>(), blocks, n, out.data<float>());
      TESSERA_CUDA_CHECK_LAUNCH();
    });
  });
}

// x is undefined for sum and mean.
void CudaBackend::reduce_backward(ReduceKind kind, const Tensor& x, const Tensor& grad_out, Tensor& grad_x) {
  const cudaStream_t stream = cuda::device_stream(grad_x);
  const int64_t n = grad_x.numel();
  const float* g = grad_out.data<float>();
  dispatch_float(grad_x.dtype(), "reduce_backward", [&](auto tag) {
    using T = decltype(tag);
    T* gx = grad_x.data<T>();
    if (kind == ReduceKind::max) {
      const int blocks = reduce_blocks(n);
      Context& ctx = x.context();
      Tensor values = ctx.empty(Shape{blocks}, DType::f32, x.device());
      Tensor indices = ctx.empty(Shape{blocks + 1}, DType::i64, x.device());  // the last slot: the result
      int64_t* first_max = indices.data<int64_t>() + blocks;
      argmax_partials_kernel<T>
          <<<blocks, kThreads, 0, stream>>>(x.data<T>(), n, values.data<float>(), indices.data<int64_t>());
      TESSERA_CUDA_CHECK_LAUNCH();
      argmax_final_kernel<<<1, kThreads, 0, stream>>>(values.data<float>(), indices.data<int64_t>(), blocks, first_max);
      TESSERA_CUDA_CHECK_LAUNCH();
      cuda::for_each_index(n, MaxBackward<T>{first_max, g, gx}, stream);
      return;
    }
    const T* xs = x.defined() ? x.data<T>() : nullptr;
    dispatch_reduce_kind(kind, [&](auto k) {
      constexpr ReduceKind K = decltype(k)::value;
      if constexpr (K != ReduceKind::max) cuda::for_each_index(n, ReduceBackward<T, K>{xs, g, gx, float(n)}, stream);
    });
  });
}

}  // namespace tessera
