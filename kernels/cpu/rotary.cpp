// CpuBackend: rotary position embedding (functor in kernels/functors/rotary.h).
#include "kernels/functors/rotary.h"

#include <algorithm>

#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

// in, out [B, T, G, R + 2, Dh]; direction +1 rotates, −1 rotates back.
void rotate(const Tensor& in, const Tensor& positions, Tensor& out, float base, float direction, const char* op) {
  // Each pair touches 2·G·(R + 2) elements: about 2^14 elements a chunk.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 13) / (in.size(2) * in.size(3)));
  launch_rotary(in, positions, out, base, direction, op,
                [&](int64_t pairs, const auto& rotary) { cpu_for_each_index(pairs, rotary, grain); });
}

}  // namespace

void CpuBackend::rotary_forward(const Tensor& qkv, const Tensor& positions, Tensor& out, float base) {
  rotate(qkv, positions, out, base, 1.0f, "rotary_forward");
}

void CpuBackend::rotary_backward(const Tensor& grad_out, const Tensor& positions, Tensor& grad_qkv, float base) {
  rotate(grad_out, positions, grad_qkv, base, -1.0f, "rotary_backward");
}

}  // namespace tessera
