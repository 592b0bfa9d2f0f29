// CudaBackend: rotary position embedding (functor in kernels/functors/rotary.h),
// a thread per (token, pair): consecutive threads touch consecutive elements.
#include "core/cuda/launch.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/functors/rotary.h"

namespace tessera {
namespace {

// in, out [B, T, G, R + 2, Dh]; direction +1 rotates, −1 rotates back.
void rotate(const Tensor& in, const Tensor& positions, Tensor& out, float base, float direction, const char* op) {
  const cudaStream_t stream = cuda::device_stream(in);
  launch_rotary(in, positions, out, base, direction, op,
                [&](int64_t pairs, const auto& rotary) { cuda::for_each_index(pairs, rotary, stream); });
}

}  // namespace

void CudaBackend::rotary_forward(const Tensor& qkv, const Tensor& positions, Tensor& out, float base) {
  rotate(qkv, positions, out, base, 1.0f, "rotary_forward");
}

void CudaBackend::rotary_backward(const Tensor& grad_out, const Tensor& positions, Tensor& grad_qkv, float base) {
  rotate(grad_out, positions, grad_qkv, base, -1.0f, "rotary_backward");
}

}  // namespace tessera
