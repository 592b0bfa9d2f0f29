// The elementwise side of the matmul family, written once for the CPU and
// CUDA: the GEMM epilogue (beta·C, bias, activation, pre-activation copy) as a
// row functor, bias_add's backward as column sums in f32 (one thread per
// column, or per chunk of rows and column, on a GPU; the CPU runs the same
// f32 row-order sums blocked for its caches and finishes with ColumnSums),
// and the small conversion and scaling passes around a library GEMM.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "kernels/functors/activation.h"
#include "kernels/functors/row_group.h"

namespace tessera {

TESSERA_HD float identity_activation(float x) {
  return x;
}

// One row of the epilogue, for rows of `cols` contiguous elements:
//   v = x[j] + beta·y[j] + bias[j];  pre[j] = v;  y[j] = act(v)
// x is the GEMM result (alpha·op(A)·op(B), or already including beta·C when
// beta is passed as 0); y is C. x may be y itself (in place). bias and pre may
// be null; every flag is uniform over the launch, so the branches are
// loop-invariant (unswitched on the CPU, uniform within a warp on a GPU).
// bias_add is this functor with act = identity_activation, beta = 0 and no pre.
template <typename X, typename Y, float (*Act)(float)>
struct BiasActivationRows {
  const X* x;
  const Y* bias;
  Y* y;
  Y* pre;
  int64_t cols;
  float beta;

  template <typename Group>
  TESSERA_HD void operator()(const Group& g, int64_t row) const {
    const X* xr = x + row * cols;
    Y* yr = y + row * cols;
    Y* pr = pre ? pre + row * cols : nullptr;
    for (int64_t j = g.lane(); j < cols; j += kGroupLanes<Group>) {
      float v = to_float(xr[j]);
      if (beta != 0.0f) v += beta * to_float(yr[j]);
      if (bias) v += to_float(bias[j]);
      if (pr) pr[j] = from_float<Y>(v);
      yr[j] = from_float<Y>(Act(v));
    }
  }
};

// Σ_{r in [row_begin, row_end)} x[r·cols + col], summed in f32 in row order
// (a fixed order: the result does not depend on how work is split).
template <typename T>
TESSERA_HD float column_sum(const T* x, int64_t cols, int64_t col, int64_t row_begin, int64_t row_end) {
  float sum = 0.0f;
  for (int64_t r = row_begin; r < row_end; ++r) sum += to_float(x[r * cols + col]);
  return sum;
}

// out[col] = Σ_rows x[:, col] (+ out[col] when accumulating): index functor over columns.
template <typename T, typename Out>
struct ColumnSums {
  const T* x;
  Out* out;
  int64_t rows;
  int64_t cols;
  bool accumulate;
  TESSERA_HD void operator()(int64_t col) const {
    float sum = column_sum(x, cols, col, 0, rows);
    if (accumulate) sum += to_float(out[col]);
    out[col] = from_float<Out>(sum);
  }
};

// First pass of a two-pass column sum for devices that need more parallelism
// than one thread per column: index i = chunk·cols + col sums rows
// [chunk·rows_per_chunk, +rows_per_chunk) into partial[i] (f32). ColumnSums
// over `partial` ([chunks, cols]) then finishes, in a fixed order.
template <typename T>
struct ColumnPartialSums {
  const T* x;
  float* partial;
  int64_t rows;
  int64_t cols;
  int64_t rows_per_chunk;
  TESSERA_HD void operator()(int64_t i) const {
    const int64_t chunk = i / cols;
    const int64_t col = i - chunk * cols;
    const int64_t begin = chunk * rows_per_chunk;
    const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
    partial[i] = column_sum(x, cols, col, begin, end);
  }
};

// y[i] = x[i] converted (f16 operands widened to f32 for an f32 GEMM).
template <typename From, typename To>
struct Convert {
  const From* x;
  To* y;
  TESSERA_HD void operator()(int64_t i) const { y[i] = from_float<To>(to_float(x[i])); }
};

// y[i] = beta·y[i] (0 when beta is 0, so NaN garbage in y is overwritten): C
// of a GEMM with an empty inner dimension.
template <typename T>
struct ScaleInPlace {
  T* y;
  float beta;
  TESSERA_HD void operator()(int64_t i) const { y[i] = from_float<T>(beta == 0.0f ? 0.0f : beta * to_float(y[i])); }
};

}  // namespace tessera
