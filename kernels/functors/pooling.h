// 2-D max pooling (NCHW), forward and backward, as functors shared by the
// CPU and CUDA backends.
//   forward:  one output element per index: the maximum over its window
//             (padding excluded; the first maximum wins a tie, a NaN wins
//             over numbers) and its position h·W + w within the input plane.
//   backward: the sum of grad_y over the outputs whose index points at an
//             input element, in output order, in f32. Two forms of the same
//             sum, both deterministic and free of atomics:
//               - a gather, one input element per index (CUDA: every thread
//                 owns its result, so no atomics);
//               - a scatter, one input plane per index (CPU: each output is
//                 read once, ~30× faster than the gather on LeNet's pooling
//                 backward, which scans the covering windows per element).
//             Both add in increasing output position from 0, so they agree
//             bit for bit.
// Forward elements are also reachable as at(row, column) of the [N·C·P, Q]
// matrix they live in: the CPU walks rows so that a row's divisions are done
// once per row, not per element, and vectorises across the columns.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/half.h"

namespace tessera {

// Sizes of one pooling call: input plane H×W, output plane P×Q, window,
// stride and padding.
struct Pool2dGeometry {
  int height, width;
  int out_height, out_width;
  int kernel_h, kernel_w;
  int stride_h, stride_w;
  int pad_h, pad_w;
};

// The first output (along one axis) whose window [o·stride − pad, o·stride − pad + kernel) covers
// input position i, and one past the last; a range of outputs in [0, outputs).
TESSERA_HD int pool_first_output(int i, int kernel, int stride, int pad) {
  const int lowest = i + pad - kernel + 1;  // o·stride ≥ lowest
  return lowest <= 0 ? 0 : (lowest + stride - 1) / stride;
}
TESSERA_HD int pool_end_output(int i, int stride, int pad, int outputs) {
  const int last = (i + pad) / stride;  // o·stride ≤ i + pad
  return last + 1 < outputs ? last + 1 : outputs;
}

// Calls fn(std::integral_constant<int, KernelH>{}, std::integral_constant<int, KernelW>{}) with
// the window size as compile-time constants for the common 2×2 and 3×3 windows, 0 (read at
// run time) otherwise; host code, for the launchers of MaxPool2dForward.
template <typename Fn>
void dispatch_pool_window(int kernel_h, int kernel_w, Fn&& fn) {
  if (kernel_h == 2 && kernel_w == 2) return fn(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
  if (kernel_h == 3 && kernel_w == 3) return fn(std::integral_constant<int, 3>{}, std::integral_constant<int, 3>{});
  fn(std::integral_constant<int, 0>{}, std::integral_constant<int, 0>{});
}

// y[n, c, p, q] = max of x[n, c] over the window of (p, q); indices[n, c, p, q] = its h·W + w.
// KernelH/KernelW > 0 fix the window size at compile time (the launchers do so for 2×2 and 3×3):
// the window loops then unroll into straight-line code the CPU vectorises across columns (3× faster
// on LeNet's 2×2 pooling). 0 reads the size from the geometry.
template <typename T, int KernelH = 0, int KernelW = 0>
struct MaxPool2dForward {
  const T* x;
  T* y;
  int32_t* indices;
  Pool2dGeometry g;

  TESSERA_HD void operator()(int64_t i) const { at(i / g.out_width, int(i % g.out_width)); }

  // Output row `row` (= plane·P + p), column q.
  TESSERA_HD void at(int64_t row, int q) const {
    const int kernel_h = KernelH > 0 ? KernelH : g.kernel_h, kernel_w = KernelW > 0 ? KernelW : g.kernel_w;
    const int p = int(row % g.out_height);
    const int64_t plane = row / g.out_height;
    const T* xp = x + plane * g.height * g.width;
    const int h0 = p * g.stride_h - g.pad_h, w0 = q * g.stride_w - g.pad_w;
    float best = -INFINITY;
    int best_index = -1;
    // Every window position, in row-major order; positions in the padding are skipped by `inside`.
    // take = inside and (v > best, or v is the first NaN, or v is the first element inside).
    // Applied with a bit mask: compilers turn a conditional select back into a branch, which
    // random data mispredicts.
    for (int r = 0; r < kernel_h; ++r) {
      for (int s = 0; s < kernel_w; ++s) {
        const int h = h0 + r, w = w0 + s;
        const bool inside = (h >= 0) & (h < g.height) & (w >= 0) & (w < g.width);
        const int offset = inside ? h * g.width + w : 0;
        const float v = to_float(xp[offset]);
        const uint32_t take = 0u - uint32_t(inside & ((v > best) | ((v != v) & (best == best)) | (best_index < 0)));
        best = bits_float((float_bits(v) & take) | (float_bits(best) & ~take));
        best_index = int((uint32_t(offset) & take) | (uint32_t(best_index) & ~take));
      }
    }
    const int64_t i = row * g.out_width + q;
    y[i] = xp[best_index];  // the element itself: exact, and no rounding back to T
    indices[i] = best_index;
  }
};

// grad_x[n, c, h, w] = Σ grad_y[n, c, p, q] over the outputs (p, q) whose window covers (h, w) and
// whose index is h·W + w.
template <typename T>
struct MaxPool2dBackward {
  const T* grad_y;
  const int32_t* indices;
  T* grad_x;
  Pool2dGeometry g;

  TESSERA_HD void operator()(int64_t i) const {
    const int w = int(i % g.width);
    const int64_t rest = i / g.width;
    const int h = int(rest % g.height);
    const int64_t plane_offset = rest / g.height * g.out_height * g.out_width;
    const int target = h * g.width + w;
    const int p_end = pool_end_output(h, g.stride_h, g.pad_h, g.out_height);
    const int q_begin = pool_first_output(w, g.kernel_w, g.stride_w, g.pad_w);
    const int q_end = pool_end_output(w, g.stride_w, g.pad_w, g.out_width);
    float sum = 0.0f;
    for (int p = pool_first_output(h, g.kernel_h, g.stride_h, g.pad_h); p < p_end; ++p) {
      for (int q = q_begin; q < q_end; ++q) {
        const int64_t j = plane_offset + p * g.out_width + q;
        const float gy = to_float(grad_y[j]);
        sum += indices[j] == target ? gy : 0.0f;  // a select, not a branch: which output took it is random
      }
    }
    grad_x[i] = from_float<T>(sum);
  }
};

// The same gradient as MaxPool2dBackward for input plane `plane`, accumulated in f32
// (grad_x is f32; backends with a 16-bit grad_x round it afterwards).
template <typename T>
struct MaxPool2dBackwardScatter {
  const T* grad_y;
  const int32_t* indices;
  float* grad_x;
  int64_t in_plane, out_plane;  // H·W, P·Q

  TESSERA_HD void operator()(int64_t plane) const {
    float* gx = grad_x + plane * in_plane;
    const T* gy = grad_y + plane * out_plane;
    const int32_t* index = indices + plane * out_plane;
    for (int64_t i = 0; i < in_plane; ++i) gx[i] = 0.0f;
    for (int64_t j = 0; j < out_plane; ++j) gx[index[j]] += to_float(gy[j]);
  }
};

}  // namespace tessera
