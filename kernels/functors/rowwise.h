// Softmax, fused cross-entropy (whole or vocabulary-parallel), LayerNorm and
// RMSNorm, forward and backward, written once for the host and the device:
//   - row functors, op(group, row), for everything computed along a row
//     (run by cpu_for_each_row with SerialGroup, cuda::for_each_row with a
//     warp; see kernels/functors/row_group.h);
//   - an index functor, op(row), for the per-row scalars that finish the
//     vocabulary-parallel cross-entropy (cpu_for_each_index, cuda::for_each_index);
//   - column-sum functors for the weight/bias gradients of the norms, which
//     sum over rows: term(row, col) gives a row's contributions to a column,
//     store(col, sums) writes the totals (honouring `accumulate`). The
//     launchers (kernels/cpu/rowwise.cpp, kernels/cuda/rowwise.cu) add the
//     terms of each column in row order, so results do not depend on threads.
// Loads convert to f32 (to_float), all arithmetic is f32, stores round once
// (from_float<T>). Rows are contiguous: element i of row r is at r·d + i.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/half.h"
#include "kernels/functors/row_group.h"
#include "kernels/functors/rowwise_math.h"

namespace tessera {

// ---------------------------------------------------------------------------
// Reductions along a row, shared by the functors below
// ---------------------------------------------------------------------------
template <typename Group, typename T>
TESSERA_HD_INLINE float row_max(const Group& g, const T* x, int64_t d) {
  float m = -INFINITY;
  TESSERA_SIMD_REDUCTION(max : m)
  for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
    const float v = to_float(x[i]);
    m = v > m ? v : m;  // compare-and-select vectorises; NaN inputs surface through the exp sum instead
  }
  return g.max(m);
}

// Σ exp(x[i] − shift).
template <typename Group, typename T>
TESSERA_HD_INLINE float row_sum_exp(const Group& g, const T* x, int64_t d, float shift) {
  float s = 0.0f;
  TESSERA_SIMD_REDUCTION(+ : s)
  for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) s += exp_f32(to_float(x[i]) - shift);
  return g.sum(s);
}

template <typename Group, typename T>
TESSERA_HD_INLINE float row_sum(const Group& g, const T* x, int64_t d) {
  float s = 0.0f;
  TESSERA_SIMD_REDUCTION(+ : s)
  for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) s += to_float(x[i]);
  return g.sum(s);
}

// Σ (x[i] − center)²; center 0 gives the sum of squares.
template <typename Group, typename T>
TESSERA_HD_INLINE float row_sum_squares(const Group& g, const T* x, int64_t d, float center) {
  float s = 0.0f;
  TESSERA_SIMD_REDUCTION(+ : s)
  for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
    const float v = to_float(x[i]) - center;
    s += v * v;
  }
  return g.sum(s);
}

TESSERA_HD_INLINE float quiet_nan_f32() {
  return bits_float(0x7fc00000u);
}

// ---------------------------------------------------------------------------
// Softmax: y = exp(x − max) / Σ exp(x − max), over rows of length d
// ---------------------------------------------------------------------------
template <typename T>
struct SoftmaxForward {
  const T* x;
  T* y;
  int64_t d;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* xr = x + row * d;
    T* yr = y + row * d;
    const float m = row_max(g, xr, d);
    if constexpr (std::is_same_v<T, float>) {
      // f32 holds exp(x − m) exactly as computed: store it, then scale (one exp per element).
      float s = 0.0f;
      TESSERA_SIMD_REDUCTION(+ : s)
      for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
        const float e = exp_f32(xr[i] - m);
        yr[i] = e;
        s += e;
      }
      const float inv_sum = 1.0f / g.sum(s);
      TESSERA_SIMD
      for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) yr[i] *= inv_sum;
    } else {
      // 16-bit storage would round exp(x − m) twice: recompute it instead.
      const float inv_sum = 1.0f / row_sum_exp(g, xr, d, m);
      for_each_lane_index_prefetching<kGroupLanes<Group>>(
          g.lane(), d, xr, yr, [&](int64_t i) { yr[i] = from_float<T>(exp_f32(to_float(xr[i]) - m) * inv_sum); });
    }
  }
};

// grad_x = y·(grad_y − Σ y·grad_y); grad_x may be grad_y (each element is read before it is written).
template <typename T>
struct SoftmaxBackward {
  const T* y;
  const T* grad_y;
  T* grad_x;
  int64_t d;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* yr = y + row * d;
    const T* gyr = grad_y + row * d;
    T* gxr = grad_x + row * d;
    float dot = 0.0f;
    TESSERA_SIMD_REDUCTION(+ : dot)
    for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) dot += to_float(yr[i]) * to_float(gyr[i]);
    dot = g.sum(dot);
    TESSERA_SIMD
    for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
      const float yi = to_float(yr[i]);
      gxr[i] = from_float<T>(yi * (to_float(gyr[i]) - dot));
    }
  }
};

// ---------------------------------------------------------------------------
// Cross-entropy over logits [N, V] (I: the targets' index type)
// ---------------------------------------------------------------------------
// logsumexp[n] = log Σ_v exp(logits[n, v]); losses[n] = logsumexp[n] − logits[n, target],
// 0 when target == ignore_index, NaN when the target is outside [0, V).
template <typename T, typename I>
struct CrossEntropyForward {
  const T* logits;
  const I* targets;
  float* losses;
  float* logsumexp;
  int64_t v;
  int64_t ignore_index;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* xr = logits + row * v;
    const float m = row_max(g, xr, v);
    const float lse = m + logf(row_sum_exp(g, xr, v, m));
    if (g.lane() != 0) return;
    const int64_t target = int64_t(targets[row]);
    float loss = 0.0f;
    if (target != ignore_index) loss = (target >= 0 && target < v) ? lse - to_float(xr[target]) : quiet_nan_f32();
    losses[row] = loss;
    logsumexp[row] = lse;
  }
};

// grad_logits[n, v] = grad_losses[n]·(exp(logits[n, v] − logsumexp[n]) − [vocab_begin + v == target]);
// rows whose target is ignore_index get 0, rows with a target outside
// [0, vocab_size) NaN (their loss is NaN). The logits may be one shard, the
// columns [vocab_begin, vocab_begin + v) of a vocabulary of vocab_size (whole:
// vocab_begin 0, vocab_size v); logsumexp is then the global one.
// grad_logits may be logits: each element is read, then written.
template <typename T, typename I>
struct CrossEntropyBackward {
  const T* logits;
  const float* logsumexp;
  const I* targets;
  const float* grad_losses;
  T* grad_logits;
  int64_t v;
  int64_t ignore_index;
  int64_t vocab_begin;
  int64_t vocab_size;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* xr = logits + row * v;
    T* gr = grad_logits + row * v;
    const int64_t target = int64_t(targets[row]);
    if (target == ignore_index) {
      TESSERA_SIMD
      for (int64_t i = g.lane(); i < v; i += kGroupLanes<Group>) gr[i] = from_float<T>(0.0f);
      return;
    }
    const bool valid = target >= 0 && target < vocab_size;
    const float scale = valid ? grad_losses[row] : quiet_nan_f32();
    // The target's column in this shard; outside [0, v) (never matched) when another shard holds it.
    const int64_t local_target = valid ? target - vocab_begin : -1;
    const float lse = logsumexp[row];
    // One pass over a row that is not in cache, with an exp per element: prefetch.
    for_each_lane_index_prefetching<kGroupLanes<Group>>(g.lane(), v, xr, gr, [&](int64_t i) {
      const float p = exp_f32(to_float(xr[i]) - lse);
      gr[i] = from_float<T>(scale * (i == local_target ? p - 1.0f : p));
    });
  }
};

// ---------------------------------------------------------------------------
// Vocabulary-parallel cross-entropy: logits [N, v] hold the columns
// [vocab_begin, vocab_begin + v) of a vocabulary of vocab_size; the caller
// all-reduces between the steps (max of maxima, sum of sums).
// ---------------------------------------------------------------------------
// maxima[n] = max_v logits[n, v] over this shard.
template <typename T>
struct CrossEntropyShardMax {
  const T* logits;
  float* maxima;
  int64_t v;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const float m = row_max(g, logits + row * v, v);
    if (g.lane() == 0) maxima[row] = m;
  }
};

// sums [2, rows]: sums[0, n] = Σ_v exp(logits[n, v] − maxima[n]) over this shard (maxima: the global
// row maxima); sums[1, n] = logits[n, target − vocab_begin] when this shard holds the target, else 0
// (and 0 when target == ignore_index).
template <typename T, typename I>
struct CrossEntropyShardSums {
  const T* logits;
  const I* targets;
  const float* maxima;
  float* sums;
  int64_t rows;
  int64_t v;
  int64_t vocab_begin;
  int64_t ignore_index;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* xr = logits + row * v;
    const float sum_exp = row_sum_exp(g, xr, v, maxima[row]);
    if (g.lane() != 0) return;
    const int64_t target = int64_t(targets[row]);
    // target ≥ vocab_begin ≥ 0 first, so the subtraction cannot overflow.
    const bool here = target != ignore_index && target >= vocab_begin && target - vocab_begin < v;
    sums[row] = sum_exp;
    sums[rows + row] = here ? to_float(xr[target - vocab_begin]) : 0.0f;
  }
};

// From the all-reduced maxima and sums, per row (as CrossEntropyForward):
// logsumexp[n] = maxima[n] + log(sums[0, n]); losses[n] = logsumexp[n] − sums[1, n],
// 0 when target == ignore_index, NaN when the target is outside [0, vocab_size).
template <typename I>
struct CrossEntropyShardFinish {
  const float* maxima;
  const float* sums;
  const I* targets;
  float* losses;
  float* logsumexp;
  int64_t rows;
  int64_t vocab_size;
  int64_t ignore_index;

  TESSERA_HD_INLINE void operator()(int64_t row) const {
    const float lse = maxima[row] + logf(sums[row]);
    const int64_t target = int64_t(targets[row]);
    float loss = 0.0f;
    if (target != ignore_index) loss = (target >= 0 && target < vocab_size) ? lse - sums[rows + row] : quiet_nan_f32();
    losses[row] = loss;
    logsumexp[row] = lse;
  }
};

// ---------------------------------------------------------------------------
// LayerNorm and RMSNorm over rows of length d
// ---------------------------------------------------------------------------
// LayerNorm: mean, rstd = 1/√(var + eps) (biased variance, two passes for
// stability), y = (x − mean)·rstd·weight + bias (bias may be null).
template <typename T>
struct LayerNormForward {
  const T* x;
  const T* weight;
  const T* bias;
  T* y;
  float* mean;
  float* rstd;
  int64_t d;
  float eps;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* xr = x + row * d;
    const T* w = weight;
    const T* b = bias;
    T* yr = y + row * d;
    const float inv_d = 1.0f / float(d);
    const float mu = row_sum(g, xr, d) * inv_d;
    const float rs = 1.0f / sqrtf(row_sum_squares(g, xr, d, mu) * inv_d + eps);
    if (b) {
      for_each_lane_index_prefetching<kGroupLanes<Group>>(g.lane(), d, xr, yr, [&](int64_t i) {
        yr[i] = from_float<T>((to_float(xr[i]) - mu) * rs * to_float(w[i]) + to_float(b[i]));
      });
    } else {
      for_each_lane_index_prefetching<kGroupLanes<Group>>(
          g.lane(), d, xr, yr, [&](int64_t i) { yr[i] = from_float<T>((to_float(xr[i]) - mu) * rs * to_float(w[i])); });
    }
    if (g.lane() == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
};

// With x̂ = (x − mean)·rstd and ĝ = grad_y·weight:
//   grad_x = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)).
// grad_x may be grad_y.
template <typename T>
struct LayerNormBackward {
  const T* grad_y;
  const T* x;
  const T* weight;
  const float* mean;
  const float* rstd;
  T* grad_x;
  int64_t d;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* gyr = grad_y + row * d;
    const T* xr = x + row * d;
    const T* w = weight;
    T* gxr = grad_x + row * d;
    const float mu = mean[row], rs = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    TESSERA_SIMD_REDUCTION(+ : sum_g, sum_gx)
    for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
      const float gi = to_float(gyr[i]) * to_float(w[i]);
      sum_g += gi;
      sum_gx += gi * (to_float(xr[i]) - mu) * rs;
    }
    const float inv_d = 1.0f / float(d);
    const float mean_g = g.sum(sum_g) * inv_d, mean_gx = g.sum(sum_gx) * inv_d;
    TESSERA_SIMD
    for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
      const float gi = to_float(gyr[i]) * to_float(w[i]);
      const float xhat = (to_float(xr[i]) - mu) * rs;
      gxr[i] = from_float<T>(rs * (gi - mean_g - xhat * mean_gx));
    }
  }
};

// RMSNorm: rstd = 1/√(mean(x²) + eps), y = x·rstd·weight.
template <typename T>
struct RmsNormForward {
  const T* x;
  const T* weight;
  T* y;
  float* rstd;
  int64_t d;
  float eps;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* xr = x + row * d;
    const T* w = weight;
    T* yr = y + row * d;
    const float rs = 1.0f / sqrtf(row_sum_squares(g, xr, d, 0.0f) / float(d) + eps);
    for_each_lane_index_prefetching<kGroupLanes<Group>>(
        g.lane(), d, xr, yr, [&](int64_t i) { yr[i] = from_float<T>(to_float(xr[i]) * rs * to_float(w[i])); });
    if (g.lane() == 0) rstd[row] = rs;
  }
};

// With ĝ = grad_y·weight: grad_x = rstd·(ĝ − x·rstd²·mean(ĝ·x)). grad_x may be grad_y.
template <typename T>
struct RmsNormBackward {
  const T* grad_y;
  const T* x;
  const T* weight;
  const float* rstd;
  T* grad_x;
  int64_t d;

  template <typename Group>
  TESSERA_HD_INLINE void operator()(const Group& g, int64_t row) const {
    const T* gyr = grad_y + row * d;
    const T* xr = x + row * d;
    const T* w = weight;
    T* gxr = grad_x + row * d;
    const float rs = rstd[row];
    float dot = 0.0f;
    TESSERA_SIMD_REDUCTION(+ : dot)
    for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>)
      dot += to_float(gyr[i]) * to_float(w[i]) * to_float(xr[i]);
    const float c = rs * rs * g.sum(dot) / float(d);
    TESSERA_SIMD
    for (int64_t i = g.lane(); i < d; i += kGroupLanes<Group>) {
      const float gi = to_float(gyr[i]) * to_float(w[i]);
      gxr[i] = from_float<T>(rs * (gi - to_float(xr[i]) * c));
    }
  }
};

// ---------------------------------------------------------------------------
// Weight and bias gradients of the norms: column sums over rows
// ---------------------------------------------------------------------------
template <int N>
struct ColumnSums {
  float v[N];
};

// Writes a column total into a gradient: overwrite, or add to what it holds.
template <typename T>
TESSERA_HD_INLINE void store_gradient(T* grad, int64_t col, float total, bool accumulate) {
  grad[col] = from_float<T>(accumulate ? to_float(grad[col]) + total : total);
}

// grad_weight[j] = Σ_r grad_y[r, j]·x̂[r, j], grad_bias[j] = Σ_r grad_y[r, j] (grad_bias may be null).
template <typename T>
struct LayerNormParamGrad {
  static constexpr int kTerms = 2;
  const T* grad_y;
  const T* x;
  const float* mean;
  const float* rstd;
  T* grad_weight;
  T* grad_bias;
  int64_t d;
  bool accumulate;

  TESSERA_HD_INLINE ColumnSums<kTerms> term(int64_t row, int64_t col) const {
    const float gy = to_float(grad_y[row * d + col]);
    return {{gy * (to_float(x[row * d + col]) - mean[row]) * rstd[row], gy}};
  }
  TESSERA_HD_INLINE void store(int64_t col, const ColumnSums<kTerms>& sums) const {
    store_gradient(grad_weight, col, sums.v[0], accumulate);
    if (grad_bias) store_gradient(grad_bias, col, sums.v[1], accumulate);
  }
};

// grad_weight[j] = Σ_r grad_y[r, j]·x[r, j]·rstd[r].
template <typename T>
struct RmsNormParamGrad {
  static constexpr int kTerms = 1;
  const T* grad_y;
  const T* x;
  const float* rstd;
  T* grad_weight;
  int64_t d;
  bool accumulate;

  TESSERA_HD_INLINE ColumnSums<kTerms> term(int64_t row, int64_t col) const {
    return {{to_float(grad_y[row * d + col]) * to_float(x[row * d + col]) * rstd[row]}};
  }
  TESSERA_HD_INLINE void store(int64_t col, const ColumnSums<kTerms>& sums) const {
    store_gradient(grad_weight, col, sums.v[0], accumulate);
  }
};

}  // namespace tessera
