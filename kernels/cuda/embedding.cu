// CudaBackend: embedding lookup and its gradient (row functors in
// kernels/functors/embedding.h, one warp per row). Ids are not checked on the
// device: an id outside [0, V) gives a NaN row in the forward pass (so it
// surfaces in the loss) and is skipped by the backward pass.
// Backward: cub::DeviceRadixSort::SortPairs (stable, deterministic) sorts the
// (id, token position) pairs, giving the runs of equal ids in token order;
// then the same row functor as the CPU adds each run to its table row. No
// float atomics: the result is bit-identical to the CPU's and run to run.
// Scratch (sorted ids, positions, CUB's temporary storage) comes from the
// context's allocator on the compute stream.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/embedding.h"

namespace tessera {
namespace {

// Columns per lane per sweep of the backward functor: 32 lanes × 4 = 128 columns, 4 f32 accumulators.
constexpr int kCudaColumns = 4;

// positions[i] = i: the values sorted along with the ids.
struct TokenPositions {
  int64_t* positions;
  __device__ void operator()(int64_t i) const { positions[i] = i; }
};

}  // namespace

void CudaBackend::embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin,
                                    int64_t vocab_size) {
  const cudaStream_t stream = cuda::device_stream(ids);
  const int64_t tokens = ids.numel(), vocab = table.size(0), dim = table.size(1);
  if (dim == 0) return;
  dispatch_index(ids.dtype(), "embedding_forward", [&](auto index_tag) {
    using I = decltype(index_tag);
    dispatch_float(table.dtype(), "embedding_forward", [&](auto tag) {
      using T = decltype(tag);
      cuda::for_each_row(
          tokens,
          EmbeddingForward<T, I>{ids.data<I>(), table.data<T>(), out.data<T>(), vocab, dim, vocab_begin, vocab_size},
          stream);
    });
  });
}

void CudaBackend::embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin,
                                     int64_t /*vocab_size: ids are not checked on the device*/) {
  const cudaStream_t stream = cuda::device_stream(ids);
  const int64_t tokens = ids.numel(), vocab = grad_table.size(0), dim = grad_table.size(1);
  if (tokens == 0 || dim == 0) return;
  Context& ctx = ids.context();
  const Device device = ids.device();
  Tensor positions = ctx.empty(Shape{tokens}, DType::i64, device);
  Tensor order = ctx.empty(Shape{tokens}, DType::i64, device);
  Tensor sorted_ids = ctx.empty(Shape{tokens}, ids.dtype(), device);
  cuda::for_each_index(tokens, TokenPositions{positions.data<int64_t>()}, stream);
  dispatch_index(ids.dtype(), "embedding_backward", [&](auto index_tag) {
    using I = decltype(index_tag);
    size_t temp_bytes = 0;
    TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids.data<I>(), sorted_ids.data<I>(),
                                                       positions.data<int64_t>(), order.data<int64_t>(), tokens, 0,
                                                       int(sizeof(I) * 8), stream));
    Tensor temp = ctx.empty(Shape{int64_t(std::max<size_t>(temp_bytes, 1))}, DType::u8, device);
    TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, ids.data<I>(), sorted_ids.data<I>(),
                                                       positions.data<int64_t>(), order.data<int64_t>(), tokens, 0,
                                                       int(sizeof(I) * 8), stream));
    dispatch_float(grad_table.dtype(), "embedding_backward", [&](auto tag) {
      using T = decltype(tag);
      cuda::for_each_row(
          tokens,
          EmbeddingBackward<T, I, kCudaColumns>{sorted_ids.data<I>(), order.data<int64_t>(), grad_out.data<T>(),
                                                grad_table.data<T>(), tokens, vocab, dim, vocab_begin},
          stream);
    });
  });
}

}  // namespace tessera
