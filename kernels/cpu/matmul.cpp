// CpuBackend: matmul (with its fused epilogue), matmul_backward, bias_add and
// bias_add_backward. GEMMs go to OpenBLAS (f32: cblas_sgemm) and oneDNN
// (bf16: AMX / AVX512_BF16 kernels, f32 or bf16 output). oneDNN 2.6 has no f16
// matmul on the CPU, so f16 operands are widened to f32 and run through sgemm
// (exact: every f16 is an f32; only the output is rounded, once). The
// epilogue and the bias passes are the functors of kernels/functors/matmul.h.
#include "kernels/functors/matmul.h"

#include <cblas.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <dnnl.hpp>

#include "core/context.h"
#include "core/cpu_libraries.h"
#include "core/parallel_for.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/row_launch.h"
#include "kernels/functors/matmul_plan.h"

namespace tessera {
namespace {

// Batched GEMMs whose items are at most this many multiply-adds run one item
// per thread (each single-threaded: OpenBLAS's OpenMP build and oneDNN stay on
// one thread inside a parallel region); larger items use all threads each.
constexpr int64_t kSmallGemmMacs = int64_t(1) << 22;

Tensor f32_scratch(Context& ctx, int64_t numel) {
  return ctx.empty(Shape{numel}, DType::f32, Device::cpu());
}

// Elements spanned by an operand of `g` stored with `rows` rows of `ld`.
int64_t operand_extent(int64_t batch, int64_t stride, int64_t rows, int64_t ld) {
  return (stride == 0 ? 0 : (batch - 1) * stride) + rows * ld;
}

bool c_packed(const Gemm& g) {
  return g.ldc == g.n && (g.batch == 1 || g.stride_c == g.m * g.n);
}

// C = act(x + beta·C + bias) over rows of `cols` (C, bias and pre of
// c_dtype, packed; bias and pre may be null); see BiasActivationRows.
void run_epilogue(const float* x, void* c, DType c_dtype, const void* bias, void* pre, ops::Activation activation,
                  float beta, int64_t rows, int64_t cols) {
  dispatch_float(c_dtype, "matmul epilogue", [&](auto tag) {
    using T = decltype(tag);
    const T* bias_data = static_cast<const T*>(bias);
    T* c_data = static_cast<T*>(c);
    T* pre_data = static_cast<T*>(pre);
    switch (activation) {
      case ops::Activation::none:
        cpu_for_each_row(rows, cols,
                         BiasActivationRows<float, T, identity_activation>{x, bias_data, c_data, pre_data, cols, beta});
        break;
      case ops::Activation::relu:
        cpu_for_each_row(rows, cols, BiasActivationRows<float, T, relu>{x, bias_data, c_data, pre_data, cols, beta});
        break;
      case ops::Activation::gelu:
        cpu_for_each_row(rows, cols, BiasActivationRows<float, T, gelu>{x, bias_data, c_data, pre_data, cols, beta});
        break;
    }
  });
}

// C (packed, `numel` elements of c_dtype) = beta·C.
void scale_c(void* c, DType dtype, int64_t numel, float beta) {
  dispatch_float(dtype, "matmul", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(numel, ScaleInPlace<T>{static_cast<T*>(c), beta});
  });
}

template <typename From, typename To>
void convert(const void* x, void* y, int64_t numel) {
  cpu_for_each_index(numel, Convert<From, To>{static_cast<const From*>(x), static_cast<To*>(y)});
}

// f16 <-> f32 for whole operands. With F16C (any AVX2-era x86) the hardware
// converts 8 values per instruction, rounding to nearest even exactly as
// core/half.h does; the portable functor (bit manipulation, not vectorised)
// handles the tails and builds without F16C.
void widen_f16(const void* x, float* y, int64_t numel) {
#if defined(__F16C__)
  const f16* in = static_cast<const f16*>(x);
  parallel_for(numel, int64_t(1) << 15, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
      _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    for (; i < end; ++i) Convert<f16, float>{in, y}(i);
  });
#else
  convert<f16, float>(x, y, numel);
#endif
}

void narrow_to_f16(const float* x, void* y, int64_t numel) {
#if defined(__F16C__)
  f16* out = static_cast<f16*>(y);
  parallel_for(numel, int64_t(1) << 15, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < end; ++i) Convert<float, f16>{x, out}(i);
  });
#else
  convert<float, f16>(x, y, numel);
#endif
}

void check_blas_sizes(const Gemm& g) {
  for (const int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldc})
    TESSERA_CHECK(v <= INT_MAX, "matmul: a dimension of ", v, " exceeds what OpenBLAS takes (", INT_MAX, ")");
}

// f32 through OpenBLAS (a, b, c all f32).
void sgemm(const Gemm& g) {
  check_blas_sizes(g);
  const auto one = [](const Gemm& x) {
    cblas_sgemm(CblasRowMajor, x.trans_a ? CblasTrans : CblasNoTrans, x.trans_b ? CblasTrans : CblasNoTrans, int(x.m),
                int(x.n), int(x.k), x.alpha, static_cast<const float*>(x.a), int(x.lda), static_cast<const float*>(x.b),
                int(x.ldb), x.beta, static_cast<float*>(x.c), int(x.ldc));
  };
  if (g.batch == 1) {
    one(g);
  } else if (g.m * g.n * g.k <= kSmallGemmMacs) {
    parallel_for(g.batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) one(g.batch_item(i));
    });
  } else {
    for (int64_t i = 0; i < g.batch; ++i) one(g.batch_item(i));
  }
}

// bf16 through oneDNN's matmul (c bf16 or f32). Strided batches are oneDNN
// memory descriptors; a shared operand is a batch dimension of 1
// (broadcast). alpha is an output scale and beta a sum post-op, both fixed in
// the primitive descriptor (oneDNN caches primitives, so recreating the
// descriptor per call costs a few microseconds).
void onednn_gemm(Context& ctx, const Gemm& g) {
  using dnnl::memory;
  const auto type = [](DType dtype) { return dtype == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32; };
  // A row-major operand of logical size rows×cols, stored transposed or not.
  const auto desc = [&](DType dtype, int64_t stride, int64_t rows, int64_t cols, int64_t ld, bool transposed) {
    const memory::dim row_stride = transposed ? 1 : ld, col_stride = transposed ? ld : 1;
    if (g.batch == 1) return memory::desc({rows, cols}, type(dtype), memory::dims{row_stride, col_stride});
    const memory::dim batch = stride == 0 ? 1 : g.batch;
    return memory::desc({batch, rows, cols}, type(dtype),
                        memory::dims{stride == 0 ? rows * cols : stride, row_stride, col_stride});
  };
  const memory::desc a_md = desc(g.ab_dtype, g.stride_a, g.m, g.k, g.lda, g.trans_a);
  const memory::desc b_md = desc(g.ab_dtype, g.stride_b, g.k, g.n, g.ldb, g.trans_b);
  const memory::desc c_md = desc(g.c_dtype, g.stride_c, g.m, g.n, g.ldc, false);

  dnnl::primitive_attr attr;
  if (g.alpha != 1.0f) attr.set_output_scales(0, {g.alpha});
  if (g.beta != 0.0f) {
    dnnl::post_ops post_ops;
    post_ops.append_sum(g.beta);
    attr.set_post_ops(post_ops);
  }
  CpuLibraries& libraries = ctx.cpu_libraries();
  dnnl::engine& engine = libraries.engine();
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine);
  const memory a_mem(a_md, engine, const_cast<void*>(g.a));
  const memory b_mem(b_md, engine, const_cast<void*>(g.b));
  const memory c_mem(c_md, engine, g.c);
  dnnl::matmul(pd).execute(libraries.stream(),
                           {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
  libraries.stream().wait();
}

// One GEMM as run_gemm hands it over: batch 1 or a non-zero C batch stride.
void gemm_item(Context& ctx, const Gemm& g) {
  if (g.batch == 0 || g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // an empty sum: C = beta·C
    TESSERA_CHECK(c_packed(g), "matmul: internal error: unpacked C with an empty inner dimension");
    scale_c(g.c, g.c_dtype, g.batch * g.m * g.n, g.beta);
    return;
  }
  switch (g.ab_dtype) {
    case DType::f32:
      sgemm(g);
      return;
    case DType::bf16:
      onednn_gemm(ctx, g);
      return;
    case DType::f16: {
      // Widen A and B to f32 (exact) and use sgemm; an f16 C is computed in
      // f32 scratch and rounded once (adding beta·C through the epilogue functor).
      Gemm w = g;
      const int64_t a_numel = operand_extent(g.batch, g.stride_a, g.trans_a ? g.k : g.m, g.lda);
      const int64_t b_numel = operand_extent(g.batch, g.stride_b, g.trans_b ? g.n : g.k, g.ldb);
      Tensor a32 = f32_scratch(ctx, a_numel), b32 = f32_scratch(ctx, b_numel);
      widen_f16(g.a, a32.data<float>(), a_numel);
      widen_f16(g.b, b32.data<float>(), b_numel);
      w.a = a32.data_ptr();
      w.b = b32.data_ptr();
      w.ab_dtype = DType::f32;
      if (g.c_dtype == DType::f32) {
        sgemm(w);
        return;
      }
      TESSERA_CHECK(c_packed(g), "matmul: internal error: unpacked f16 C");
      Tensor c32 = f32_scratch(ctx, g.batch * g.m * g.n);
      w.c = c32.data_ptr();
      w.c_dtype = DType::f32;
      w.ldc = g.n;
      w.stride_c = g.m * g.n;
      w.beta = 0.0f;
      sgemm(w);
      if (g.beta == 0.0f)
        narrow_to_f16(c32.data<float>(), g.c, c32.numel());
      else
        run_epilogue(c32.data<float>(), g.c, g.c_dtype, nullptr, nullptr, ops::Activation::none, g.beta, g.batch * g.m,
                     g.n);
      return;
    }
    default:
      throw_unsupported_dtype(g.ab_dtype, "matmul");
  }
}

// Any Gemm from kernels/functors/matmul_plan.h on the host.
void cpu_gemm(Context& ctx, const Gemm& g) {
  if (g.batch == 0) {  // an empty batch: a batch-summed C is beta·C, a batched C is empty
    if (g.stride_c == 0) scale_c(g.c, g.c_dtype, g.m * g.n, g.beta);
    return;
  }
  if (g.batch > 1 && g.stride_c == 0 && g.c_dtype != DType::f32) {
    // A sum over batches into a low-precision C: sum in f32, round once.
    Tensor c32 = f32_scratch(ctx, g.m * g.n);
    Gemm w = g;
    w.c = c32.data_ptr();
    w.c_dtype = DType::f32;
    w.ldc = g.n;
    w.beta = 0.0f;
    run_gemm(w, [&](const Gemm& item) { gemm_item(ctx, item); });
    TESSERA_CHECK(g.ldc == g.n, "matmul: internal error: unpacked batch-summed C");
    run_epilogue(c32.data<float>(), g.c, g.c_dtype, nullptr, nullptr, ops::Activation::none, g.beta, g.m, g.n);
    return;
  }
  run_gemm(g, [&](const Gemm& item) { gemm_item(ctx, item); });
}

}  // namespace

void CpuBackend::matmul(const Tensor& a, const Tensor& b, Tensor& c, const ops::MatmulOptions& options) {
  Context& ctx = a.context();
  Gemm g = make_gemm(a, options.transpose_a, b, options.transpose_b, c, options.alpha, options.beta);
  const bool epilogue = options.bias || options.activation != ops::Activation::none || options.pre_activation;
  if (!epilogue) {
    cpu_gemm(ctx, g);
    return;
  }
  const int64_t cols = c.shape()[-1], rows = cols == 0 ? 0 : c.numel() / cols;
  const void* bias = options.bias ? options.bias->data_ptr() : nullptr;
  void* pre = options.pre_activation ? options.pre_activation->data_ptr() : nullptr;
  if (c.dtype() == DType::f32) {
    // The GEMM applies alpha and beta in place; the epilogue adds bias and activates.
    cpu_gemm(ctx, g);
    run_epilogue(c.data<float>(), c.data_ptr(), c.dtype(), bias, pre, options.activation, 0.0f, rows, cols);
    return;
  }
  // A bf16/f16 C: the GEMM writes alpha·op(A)·op(B) in f32 scratch, and the
  // epilogue adds beta·C and the bias, activates and rounds once.
  Tensor acc = f32_scratch(ctx, c.numel());
  g.c = acc.data_ptr();
  g.c_dtype = DType::f32;
  g.beta = 0.0f;
  cpu_gemm(ctx, g);
  run_epilogue(acc.data<float>(), c.data_ptr(), c.dtype(), bias, pre, options.activation, options.beta, rows, cols);
}

void CpuBackend::matmul_backward(const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a, Tensor* grad_b,
                                 bool transpose_a, bool transpose_b, bool accumulate) {
  Context& ctx = a.context();
  Tensor dc = grad_c;
  if (grad_c.dtype() != a.dtype()) {  // an f32 grad_c of low-precision operands: narrow it to their dtype
    dc = ctx.empty(grad_c.shape(), a.dtype(), Device::cpu());
    if (a.dtype() == DType::f16)
      narrow_to_f16(grad_c.data<float>(), dc.data_ptr(), dc.numel());
    else
      convert<float, bf16>(grad_c.data_ptr(), dc.data_ptr(), dc.numel());
  }
  if (grad_a) cpu_gemm(ctx, grad_a_gemm(dc, b, *grad_a, transpose_a, transpose_b, accumulate));
  if (grad_b) cpu_gemm(ctx, grad_b_gemm(dc, a, *grad_b, transpose_a, transpose_b, accumulate));
}

void CpuBackend::bias_add(const Tensor& x, const Tensor& bias, Tensor& y) {
  const int64_t cols = x.shape()[-1], rows = cols == 0 ? 0 : x.numel() / cols;
  dispatch_float(x.dtype(), "bias_add", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_row(
        rows, cols,
        BiasActivationRows<T, T, identity_activation>{x.data<T>(), bias.data<T>(), y.data<T>(), nullptr, cols, 0.0f});
  });
}

// Column sums, blocked for the cache: work items are (chunk of kRowChunk
// rows, block of kColumnBlock columns), each summing its rows in order into
// f32 with adjacent columns in vector lanes; a second pass sums the chunks'
// partial sums in chunk order. The blocking depends only on the shape, so the
// result does not depend on the number of threads.
void CpuBackend::bias_add_backward(const Tensor& grad_y, Tensor& grad_bias, bool accumulate) {
  constexpr int64_t kRowChunk = 1024, kColumnBlock = 256;
  const int64_t cols = grad_y.shape()[-1], rows = cols == 0 ? 0 : grad_y.numel() / cols;
  if (cols == 0) return;
  const int64_t chunks = std::max<int64_t>(1, (rows + kRowChunk - 1) / kRowChunk);
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  Context& ctx = grad_y.context();
  Tensor partial = f32_scratch(ctx, chunks * cols);
  // sums[c] = Σ_{r in [row_begin, row_end)} x[r·cols + c] for c in the column block.
  const auto block_sums = [&](const auto* x, int64_t row_begin, int64_t row_end, int64_t block, float* sums) {
    const int64_t begin = block * kColumnBlock, end = std::min(cols, begin + kColumnBlock);
#pragma omp simd
    for (int64_t c = begin; c < end; ++c) sums[c] = 0.0f;
    for (int64_t r = row_begin; r < row_end; ++r) {
      const auto* row = x + r * cols;
#pragma omp simd
      for (int64_t c = begin; c < end; ++c) sums[c] += to_float(row[c]);
    }
  };
  const int64_t grain = rows * cols < (int64_t(1) << 15) ? chunks * blocks : 1;
  dispatch_float(grad_y.dtype(), "bias_add_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = grad_y.data<T>();
    parallel_for(chunks * blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t chunk = item / blocks, block = item % blocks;
        block_sums(x, chunk * kRowChunk, std::min(rows, (chunk + 1) * kRowChunk), block,
                   partial.data<float>() + chunk * cols);
      }
    });
  });
  const float* sums = partial.data<float>();
  if (chunks > 1) {
    Tensor totals = f32_scratch(ctx, cols);
    parallel_for(blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) block_sums(sums, 0, chunks, block, totals.data<float>());
    });
    partial = totals;
    sums = partial.data<float>();
  }
  // grad_bias = sums (+ grad_bias): ColumnSums over one row of f32 sums.
  dispatch_float(grad_bias.dtype(), "bias_add_backward", [&](auto tag) {
    using Out = decltype(tag);
    cpu_for_each_index(cols, ColumnSums<float, Out>{sums, grad_bias.data<Out>(), 1, cols, accumulate});
  });
}

}  // namespace tessera
