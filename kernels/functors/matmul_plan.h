// How the matmul family's operators become library GEMMs, decided once for
// both backends (host code, no device math): a row-major strided-batched GEMM
// description built from tensors, the four products of matmul_backward, and
// the rewrites that turn batches into one larger GEMM where the memory layout
// allows (shared 2-D B stacked under all batches' rows; a batch-summing
// gradient folded into the inner dimension) or into a sequence of
// accumulating GEMMs where it does not. Also the key under which a GPU
// library's algorithm choice for a GEMM is cached (core/gemm_algorithm_cache.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/error.h"
#include "core/gemm_algorithm_cache.h"
#include "core/tensor.h"

namespace tessera {

// C[i] = alpha·op(A[i])·op(B[i]) + beta·C[i] for i in [0, batch), row-major:
// op(A) is m×k (A stored [m, k], or [k, m] when trans_a), op(B) is k×n, C is
// m×n. Leading dimensions and batch strides are in elements. A batch stride
// of 0 on A or B shares that operand across batches; stride_c == 0 with
// batch > 1 means every batch's product is summed into the one C.
struct Gemm {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  const void* a = nullptr;
  bool trans_a = false;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  bool trans_b = false;
  int64_t ldb = 0, stride_b = 0;
  void* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  DType ab_dtype = DType::f32;
  DType c_dtype = DType::f32;
  float alpha = 1.0f, beta = 0.0f;

  // The GEMM of batch `i` alone.
  Gemm batch_item(int64_t i) const {
    Gemm g = *this;
    g.batch = 1;
    g.a = static_cast<const char*>(a) + i * stride_a * int64_t(dtype_size(ab_dtype));
    g.b = static_cast<const char*>(b) + i * stride_b * int64_t(dtype_size(ab_dtype));
    g.c = static_cast<char*>(c) + i * stride_c * int64_t(dtype_size(c_dtype));
    return g;
  }
};

// The largest power of two, up to 256 (cuBLASLt's default assumption), dividing a pointer.
inline uint32_t pointer_alignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// What decides a library's algorithm for `g` with this epilogue code: every
// field of g but the pointers (only their alignments) and alpha, beta.
inline GemmAlgorithmKey gemm_algorithm_key(const Gemm& g, int32_t epilogue) {
  GemmAlgorithmKey key;
  key.batch = g.batch;
  key.m = g.m;
  key.n = g.n;
  key.k = g.k;
  key.lda = g.lda;
  key.ldb = g.ldb;
  key.ldc = g.ldc;
  key.stride_a = g.stride_a;
  key.stride_b = g.stride_b;
  key.stride_c = g.stride_c;
  key.trans_a = g.trans_a;
  key.trans_b = g.trans_b;
  key.ab_dtype = g.ab_dtype;
  key.c_dtype = g.c_dtype;
  key.epilogue = epilogue;
  key.align_a = pointer_alignment(g.a);
  key.align_b = pointer_alignment(g.b);
  key.align_c = pointer_alignment(g.c);
  return key;
}

// out = alpha·op(x)·op(y) + beta·out for contiguous tensors of 2 or 3
// dimensions (the last two are the matrix); a 2-D operand next to a 3-D one is
// shared by every batch, a 2-D out with 3-D operands sums over the batch.
inline Gemm make_gemm(const Tensor& x, bool trans_x, const Tensor& y, bool trans_y, const Tensor& out, float alpha,
                      float beta) {
  const auto rows = [](const Tensor& t) { return t.size(t.ndim() - 2); };
  const auto cols = [](const Tensor& t) { return t.size(t.ndim() - 1); };
  const auto batch = [](const Tensor& t) { return t.ndim() == 3 ? t.size(0) : int64_t(1); };
  Gemm g;
  g.batch = std::max({batch(x), batch(y), batch(out)});
  g.m = trans_x ? cols(x) : rows(x);
  g.k = trans_x ? rows(x) : cols(x);
  g.n = trans_y ? rows(y) : cols(y);
  g.a = x.data_ptr();
  g.trans_a = trans_x;
  g.lda = cols(x);
  g.stride_a = x.ndim() == 3 ? rows(x) * cols(x) : 0;
  g.b = y.data_ptr();
  g.trans_b = trans_y;
  g.ldb = cols(y);
  g.stride_b = y.ndim() == 3 ? rows(y) * cols(y) : 0;
  g.c = out.data_ptr();
  g.ldc = cols(out);
  g.stride_c = out.ndim() == 3 ? rows(out) * cols(out) : 0;
  g.ab_dtype = x.dtype();
  g.c_dtype = out.dtype();
  g.alpha = alpha;
  g.beta = beta;
  return g;
}

// The products of matmul_backward (C = op(A)·op(B)), each written in the
// stored layout of its operand:
//   grad_a = dC·op(B)ᵀ          (A stored [M, K])   or  op(B)·dCᵀ  (A stored [K, M])
//   grad_b = op(A)ᵀ·dC          (B stored [K, N])   or  dCᵀ·op(A)  (B stored [N, K])
inline Gemm grad_a_gemm(const Tensor& grad_c, const Tensor& b, const Tensor& grad_a, bool transpose_a, bool transpose_b,
                        bool accumulate) {
  const float beta = accumulate ? 1.0f : 0.0f;
  return transpose_a ? make_gemm(b, transpose_b, grad_c, true, grad_a, 1.0f, beta)
                     : make_gemm(grad_c, false, b, !transpose_b, grad_a, 1.0f, beta);
}

inline Gemm grad_b_gemm(const Tensor& grad_c, const Tensor& a, const Tensor& grad_b, bool transpose_a, bool transpose_b,
                        bool accumulate) {
  const float beta = accumulate ? 1.0f : 0.0f;
  return transpose_b ? make_gemm(grad_c, true, a, transpose_a, grad_b, 1.0f, beta)
                     : make_gemm(a, !transpose_a, grad_c, false, grad_b, 1.0f, beta);
}

// Runs `run(g)` for GEMMs equivalent to `g`, each with batch == 1 or a
// non-zero C batch stride (what BLAS-like libraries take):
//   - a B shared by all batches, with A not transposed and A, C packed: the
//     batches' rows are stacked into one GEMM of batch·m rows;
//   - a batch-summing GEMM (stride_c == 0) whose batches are stacked along k
//     (A transposed, B not, both packed): one GEMM of inner dimension batch·k;
//     otherwise one GEMM per batch, each after the first accumulating (beta 1).
template <typename Run>
void run_gemm(Gemm g, Run&& run) {
  if (g.batch > 1 && g.stride_c != 0 && g.stride_b == 0 && !g.trans_a && g.lda == g.k && g.stride_a == g.m * g.k &&
      g.ldc == g.n && g.stride_c == g.m * g.n) {
    g.m *= g.batch;
    g.batch = 1;
  }
  if (g.batch > 1 && g.stride_c == 0) {
    if (g.trans_a && !g.trans_b && g.lda == g.m && g.stride_a == g.k * g.m && g.ldb == g.n && g.stride_b == g.k * g.n) {
      g.k *= g.batch;
      g.batch = 1;
    } else {
      for (int64_t i = 0; i < g.batch; ++i) {
        Gemm item = g.batch_item(i);
        if (i > 0) item.beta = 1.0f;
        run(item);
      }
      return;
    }
  }
  run(g);
}

}  // namespace tessera
