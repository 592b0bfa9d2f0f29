// CudaBackend: matmul (with its epilogue) and matmul_backward through
// cuBLASLt, host code only. Row-major C = op(A)·op(B) is computed as the
// column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ: the same buffers, operands swapped.
// Strided batches are layout attributes (a shared operand has batch stride
// 0); arithmetic is CUBLAS_COMPUTE_32F for f32, bf16 and f16 inputs.
//
// The epilogue is fused when cuBLASLt can: BIAS, RELU(_BIAS), GELU(_BIAS),
// and GELU_AUX(_BIAS) writing pre_activation (its leading dimension, N, must
// be a multiple of 8). cuBLASLt's RELU_AUX stores a bit-mask, not the
// pre-activation, so ReLU with pre_activation, GELU with an unaligned N, and
// any case the heuristic finds no algorithm for are a plain GEMM (into f32
// scratch when C is bf16/f16) followed by the epilogue functor, exactly as on
// the CPU.
//
// cuBLASLt's heuristic runs once per distinct GEMM: its choice is kept in the
// device's CudaLibraries (core/gemm_algorithm_cache.h) under
// gemm_algorithm_key (kernels/functors/matmul_plan.h).
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "core/context.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_libraries.h"
#include "core/cuda_runtime.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/matmul_launch.h"
#include "kernels/functors/matmul_plan.h"

namespace tessera {
namespace {

// cuBLASLt's recommended workspace for Hopper (also ample for Ampere).
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      throw_unsupported_dtype(dtype, "matmul on cuda");
  }
}

// Makes the tensor's device current and returns its compute stream (what
// cuda::device_stream does for .cu files; that header holds kernel templates).
cudaStream_t compute_stream(const Tensor& t) {
  cuda_runtime::set_device(t.device().index);
  return static_cast<cudaStream_t>(t.context().compute_stream(t.device()).native_handle());
}

// RAII owners of the cuBLASLt descriptors.
class LtMatmulDesc {
 public:
  LtMatmulDesc() { TESSERA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~LtMatmulDesc() { (void)cublasLtMatmulDescDestroy(desc_); }
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;
  template <typename V>
  void set(cublasLtMatmulDescAttributes_t attribute, const V& value) {
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, attribute, &value, sizeof value));
  }
  cublasLtMatmulDesc_t get() const { return desc_; }

 private:
  cublasLtMatmulDesc_t desc_ = nullptr;
};

// A column-major rows×cols matrix with leading dimension ld, `batch` of them
// `stride` elements apart.
class LtLayout {
 public:
  LtLayout(DType dtype, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
    TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_, cuda_type(dtype), uint64_t(rows), uint64_t(cols), ld));
    if (batch > 1) {
      const int32_t count = int32_t(batch);
      TESSERA_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(layout_, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout_, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                            &stride, sizeof stride));
    }
  }
  ~LtLayout() { (void)cublasLtMatrixLayoutDestroy(layout_); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
  cublasLtMatrixLayout_t get() const { return layout_; }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

class LtPreference {
 public:
  LtPreference() { TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference_)); }
  ~LtPreference() { (void)cublasLtMatmulPreferenceDestroy(preference_); }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
  template <typename V>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, const V& value) {
    TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference_, attribute, &value, sizeof value));
  }
  cublasLtMatmulPreference_t get() const { return preference_; }

 private:
  cublasLtMatmulPreference_t preference_ = nullptr;
};

// A fused epilogue: kind, bias (length n, C's dtype) and the GELU input
// output (aux, laid out like C).
struct LtEpilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
};

// cuBLASLt's heuristic for one GEMM (A and B swapped: see the top of the file).
LtMatmulAlgorithm heuristic_algorithm(cublasLtHandle_t handle, const LtMatmulDesc& desc, const LtLayout& b_layout,
                                      const LtLayout& a_layout, const LtLayout& c_layout, const Gemm& g) {
  LtPreference preference;
  preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kWorkspaceBytes));
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, pointer_alignment(g.b));
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, pointer_alignment(g.a));
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, pointer_alignment(g.c));
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, pointer_alignment(g.c));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  LtMatmulAlgorithm choice;
  choice.status = cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), b_layout.get(), a_layout.get(), c_layout.get(),
                                                 c_layout.get(), preference.get(), 1, &heuristic, &found);
  choice.found = choice.status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (choice.found) choice.algo = heuristic.algo;
  return choice;
}

// Whether "no algorithm" is the heuristic's answer for this GEMM, not a
// passing failure (say, out of host memory) that must not be remembered.
bool answer_is_final(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS || status == CUBLAS_STATUS_NOT_SUPPORTED;
}

// Runs one GEMM as run_gemm hands it over (batch 1 or a non-zero C batch
// stride). Returns false, having queued nothing, when cuBLASLt has no
// algorithm for it (only possible with a fused epilogue; a plain GEMM then throws).
bool lt_gemm(const Tensor& on, const Gemm& g, const LtEpilogue& epilogue = {}) {
  const cudaStream_t stream = compute_stream(on);
  CudaLibraries& libraries = on.context().cuda_libraries(on.device().index);
  cublasLtHandle_t handle = libraries.cublaslt();

  // Column-major view: D (n×m, ld ldc) = op'(B buffer) (n×k) · op'(A buffer) (k×m).
  LtMatmulDesc desc;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_b);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_a);
  const LtLayout b_layout(g.ab_dtype, g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k, g.ldb, g.batch, g.stride_b);
  const LtLayout a_layout(g.ab_dtype, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m, g.lda, g.batch, g.stride_a);
  const LtLayout c_layout(g.c_dtype, g.n, g.m, g.ldc, g.batch, g.stride_c);
  if (epilogue.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue.kind);
    if (epilogue.bias) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, epilogue.bias);
    if (epilogue.aux) {
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, epilogue.aux);
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t(g.ldc));
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, int64_t(g.stride_c));
    }
  }

  // The heuristic runs once per distinct GEMM (shape, layouts, dtypes,
  // epilogue, alignments); later calls take its choice from the cache.
  const GemmAlgorithmKey key = gemm_algorithm_key(g, int32_t(epilogue.kind));
  std::optional<LtMatmulAlgorithm> choice = libraries.gemm_algorithms().find(key);
  if (!choice) {
    choice = heuristic_algorithm(handle, desc, b_layout, a_layout, c_layout, g);
    if (answer_is_final(choice->status)) libraries.gemm_algorithms().insert(key, *choice);
  }
  if (!choice->found) {
    TESSERA_CHECK(epilogue.kind != CUBLASLT_EPILOGUE_DEFAULT, "matmul: cuBLASLt has no algorithm for a ", g.m, "x", g.n,
                  "x", g.k, " GEMM (batch ", g.batch, ", ", dtype_name(g.ab_dtype), " -> ", dtype_name(g.c_dtype),
                  "): ", cublasGetStatusName(choice->status));
    return false;
  }
  void* workspace = libraries.workspace(kWorkspaceBytes);
  TESSERA_CUBLAS_CHECK(cublasLtMatmul(handle, desc.get(), &g.alpha, g.b, b_layout.get(), g.a, a_layout.get(), &g.beta,
                                      g.c, c_layout.get(), g.c, c_layout.get(), &choice->algo, workspace,
                                      kWorkspaceBytes, stream));
  return true;
}

// Any Gemm from kernels/functors/matmul_plan.h on the device of `on`.
void cuda_gemm(const Tensor& on, const Gemm& g) {
  const cudaStream_t stream = compute_stream(on);
  if (g.batch == 0) {  // an empty batch: a batch-summed C is beta·C, a batched C is empty
    if (g.stride_c == 0) cuda::launch_scale(g.c, g.c_dtype, g.m * g.n, g.beta, stream);
    return;
  }
  const auto item = [&](const Gemm& x) {
    if (x.m == 0 || x.n == 0) return;
    if (x.k == 0) {  // an empty sum: C = beta·C (C is packed: it comes from a tensor)
      cuda::launch_scale(x.c, x.c_dtype, x.batch * x.m * x.n, x.beta, stream);
      return;
    }
    lt_gemm(on, x);
  };
  if (g.batch > 1 && g.stride_c == 0 && g.c_dtype != DType::f32) {
    // A sum over batches into a low-precision C: sum in f32, round once.
    Tensor c32 = on.context().empty(Shape{g.m * g.n}, DType::f32, on.device());
    Gemm w = g;
    w.c = c32.data_ptr();
    w.c_dtype = DType::f32;
    w.ldc = g.n;
    w.beta = 0.0f;
    run_gemm(w, item);
    cuda::launch_matmul_epilogue(c32.data<float>(), g.c, g.c_dtype, nullptr, nullptr, ops::Activation::none, g.beta,
                                 g.m, g.n, stream);
    return;
  }
  run_gemm(g, item);
}

// The fused epilogue for `options`, or DEFAULT when it must run unfused.
LtEpilogue fused_epilogue(const ops::MatmulOptions& options, int64_t n) {
  const bool bias = options.bias != nullptr;
  LtEpilogue e;
  e.bias = bias ? options.bias->data_ptr() : nullptr;
  switch (options.activation) {
    case ops::Activation::none:
      if (!options.pre_activation) e.kind = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      break;
    case ops::Activation::relu:
      if (!options.pre_activation) e.kind = bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
      break;
    case ops::Activation::gelu:
      if (!options.pre_activation) {
        e.kind = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
      } else if (n % 8 == 0) {
        e.kind = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
        e.aux = options.pre_activation->data_ptr();
      }
      break;
  }
  return e;
}

}  // namespace

void CudaBackend::matmul(const Tensor& a, const Tensor& b, Tensor& c, const ops::MatmulOptions& options) {
  Gemm g = make_gemm(a, options.transpose_a, b, options.transpose_b, c, options.alpha, options.beta);
  const bool epilogue = options.bias || options.activation != ops::Activation::none || options.pre_activation;
  if (!epilogue) {
    cuda_gemm(a, g);
    return;
  }
  const cudaStream_t stream = compute_stream(a);
  const int64_t cols = c.shape()[-1], rows = cols == 0 ? 0 : c.numel() / cols;
  if (rows == 0 || cols == 0) return;
  // Fused: one cuBLASLt call when the epilogue is expressible and an algorithm exists.
  const LtEpilogue fused = fused_epilogue(options, g.n);
  if (fused.kind != CUBLASLT_EPILOGUE_DEFAULT && g.k > 0) {
    bool done = true;
    run_gemm(g, [&](const Gemm& item) { done = done && lt_gemm(a, item, fused); });
    if (done) return;
    // run_gemm hands over a single GEMM here (C is never batch-summed in a
    // forward product), so nothing was queued when it reports no algorithm.
  }
  const void* bias = options.bias ? options.bias->data_ptr() : nullptr;
  void* pre = options.pre_activation ? options.pre_activation->data_ptr() : nullptr;
  if (c.dtype() == DType::f32) {
    cuda_gemm(a, g);
    cuda::launch_matmul_epilogue(c.data<float>(), c.data_ptr(), c.dtype(), bias, pre, options.activation, 0.0f, rows,
                                 cols, stream);
    return;
  }
  // A bf16/f16 C: alpha·op(A)·op(B) into f32 scratch; the epilogue adds beta·C
  // and the bias, activates and rounds once.
  Tensor acc = c.context().empty(Shape{c.numel()}, DType::f32, c.device());
  g.c = acc.data_ptr();
  g.c_dtype = DType::f32;
  g.beta = 0.0f;
  cuda_gemm(a, g);
  cuda::launch_matmul_epilogue(acc.data<float>(), c.data_ptr(), c.dtype(), bias, pre, options.activation, options.beta,
                               rows, cols, stream);
}

void CudaBackend::matmul_backward(const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a,
                                  Tensor* grad_b, bool transpose_a, bool transpose_b, bool accumulate) {
  Tensor dc = grad_c;
  if (grad_c.dtype() != a.dtype()) {  // an f32 grad_c of low-precision operands: narrow it to their dtype
    dc = a.context().empty(grad_c.shape(), a.dtype(), a.device());
    cuda::launch_narrow_f32(grad_c.data<float>(), dc.data_ptr(), a.dtype(), dc.numel(), compute_stream(a));
  }
  if (grad_a) cuda_gemm(a, grad_a_gemm(dc, b, *grad_a, transpose_a, transpose_b, accumulate));
  if (grad_b) cuda_gemm(a, grad_b_gemm(dc, a, *grad_b, transpose_a, transpose_b, accumulate));
}

}  // namespace tessera
