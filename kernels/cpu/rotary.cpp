// CpuBackend: rotary position embedding (functor in kernels/functors/rotary.h).
// The angles of each (token position t, pair i) are computed once per call
// into a [T, Dh/2] table of cosines and sines (not once per sequence of the
// batch), then each token's query and key slots are rotated in a vectorised
// loop over their pairs.
#include "kernels/functors/rotary.h"

#include <algorithm>

#include "core/context.h"
#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

// The pairs of `rotary` for `batch` sequences, walked token by token.
template <typename Rotary>
void rotate_tokens(Context& ctx, int64_t batch, const Rotary& rotary) {
  const int64_t tokens = rotary.tokens, half = rotary.head_dim / 2;
  Tensor table = ctx.empty(Shape{2, tokens, half}, DType::f32);
  float* cosines = table.data<float>();
  float* sines = cosines + tokens * half;
  parallel_for(tokens, std::max<int64_t>(1, 256 / half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = 0; i < half; ++i) rotary.angle(t, i, cosines[t * half + i], sines[t * half + i]);
  });
  // About 2^14 elements a chunk.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / (rotary.groups * rotary.slots * rotary.head_dim));
  parallel_for(batch * tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const float* c = cosines + (token % tokens) * half;
      const float* s = sines + (token % tokens) * half;
      for (int64_t g = 0; g < rotary.groups; ++g) {
        for (int64_t slot = 0; slot + 1 < rotary.slots; ++slot) {  // the queries and the key
          const int64_t start = rotary.slot_start(token, g, slot);
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) rotary.rotate(start, i, c[i], s[i]);
        }
        const int64_t value = rotary.slot_start(token, g, rotary.slots - 1);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) rotary.copy_value(value, i);
      }
    }
  });
}

// in, out [B, T, G, R + 2, Dh]; direction +1 rotates, −1 rotates back.
void rotate(const Tensor& in, const Tensor& positions, Tensor& out, float base, float direction, const char* op) {
  launch_rotary(in, positions, out, base, direction, op,
                [&](int64_t, const auto& rotary) { rotate_tokens(in.context(), in.size(0), rotary); });
}

}  // namespace

void CpuBackend::rotary_forward(const Tensor& qkv, const Tensor& positions, Tensor& out, float base) {
  rotate(qkv, positions, out, base, 1.0f, "rotary_forward");
}

void CpuBackend::rotary_backward(const Tensor& grad_out, const Tensor& positions, Tensor& grad_qkv, float base) {
  rotate(grad_out, positions, grad_qkv, base, -1.0f, "rotary_backward");
}

}  // namespace tessera
