// ReLU, GELU (tanh approximation) and SwiGLU (Llama's gated SiLU), forward and
// backward, as index functors run by cpu_for_each_index on the host and
// cuda::for_each_index on a GPU.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "kernels/functors/float_math.h"

namespace tessera {

TESSERA_HD_INLINE float relu(float x) {
  return x > 0.0f ? x : 0.0f;
}
// d relu / dx, taking 0 at x = 0 (as PyTorch does).
TESSERA_HD_INLINE float relu_grad(float x) {
  return x > 0.0f ? 1.0f : 0.0f;
}

// GELU, tanh approximation (Hendrycks & Gimpel): 0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³),
// computed as x·σ(2u), which is the same function: it avoids the cancellation
// in 1 + tanh(u) for negative x, and with exp_f32 it vectorises on the host.
inline constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;

TESSERA_HD_INLINE float gelu(float x) {
  const float u = kGeluSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return x / (1.0f + exp_f32(-2.0f * u));
}

// d gelu / dx = σ(2u) + 2·x·σ(2u)·(1 − σ(2u))·du/dx, du/dx = √(2/π)·(1 + 3·0.044715·x²).
TESSERA_HD_INLINE float gelu_grad(float x) {
  const float u = kGeluSqrt2OverPi * (x + kGeluCubic * x * x * x);
  const float s = 1.0f / (1.0f + exp_f32(-2.0f * u));
  const float du_dx = kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du_dx;
}

// y[i] = f(x[i]) for an activation f.
template <typename T, float (*F)(float)>
struct ActivationForward {
  const T* x;
  T* y;
  TESSERA_HD void operator()(int64_t i) const { y[i] = from_float<T>(F(to_float(x[i]))); }
};

// grad_x[i] = grad_y[i]·f'(x[i]).
template <typename T, float (*DF)(float)>
struct ActivationBackward {
  const T* x;
  const T* grad_y;
  T* grad_x;
  TESSERA_HD void operator()(int64_t i) const { grad_x[i] = from_float<T>(to_float(grad_y[i]) * DF(to_float(x[i]))); }
};

// SiLU (swish): silu(a) = a·σ(a) = a / (1 + e^−a), as torch computes it.
TESSERA_HD_INLINE float sigmoid(float x) {
  return 1.0f / (1.0f + exp_f32(-x));
}

// y[r, f] = silu(gate)·up with gate = x[r, f], up = x[r, F + f]: an index
// functor over the elements i = r·F + f of y [R, F]; x [R, 2F]. element(i,
// r·2F + f) is the same work for a launcher that walks rows (the CPU's: a
// row's f are contiguous, so its loop vectorises, where i / F would not).
template <typename T>
struct SwigluForward {
  const T* x;
  T* y;
  int64_t width;  // F

  TESSERA_HD_INLINE void element(int64_t i, int64_t gate) const {
    const float a = to_float(x[gate]);
    y[i] = from_float<T>(a * sigmoid(a) * to_float(x[gate + width]));
  }
  TESSERA_HD void operator()(int64_t i) const { element(i, i + (i / width) * width); }  // gate = r·2F + f
};

// The gradients of y = silu(a)·u for dy = grad_y[r, f]:
//   d gate = dy·u·silu'(a), silu'(a) = σ(a)·(1 + a·(1 − σ(a))),   d up = dy·silu(a).
// An index functor over the elements of grad_y [R, F] (element(i, gate) as
// SwigluForward's); x, grad_x [R, 2F], and grad_x may be x (each pair is read
// before it is written, by one thread).
template <typename T>
struct SwigluBackward {
  const T* x;
  const T* grad_y;
  T* grad_x;
  int64_t width;  // F

  TESSERA_HD_INLINE void element(int64_t i, int64_t gate) const {
    const float a = to_float(x[gate]), u = to_float(x[gate + width]), dy = to_float(grad_y[i]);
    const float s = sigmoid(a);
    grad_x[gate] = from_float<T>(dy * u * s * (1.0f + a * (1.0f - s)));
    grad_x[gate + width] = from_float<T>(dy * a * s);
  }
  TESSERA_HD void operator()(int64_t i) const { element(i, i + (i / width) * width); }
};

}  // namespace tessera
