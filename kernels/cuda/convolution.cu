// CudaBackend: 2-D convolution (NCHW) through cuDNN's legacy convolution API
// (cudnnConvolutionForward / BackwardData / BackwardFilter), with the bias
// add and bias gradient from the functors in kernels/functors/convolution.h.
//
// Algorithms come from cuDNN's heuristics (the *_v7 queries, no benchmarking):
// the best-ranked one that is deterministic, else the best-ranked one. f32
// convolutions keep FMA math (no TF32), so f32 results match the CPU's to f32
// precision; bf16 and f16 use tensor cores, accumulating in f32. `accumulate`
// is cuDNN's beta = 1. Workspace comes from the device's CudaLibraries.
#include <cudnn.h>

#include "core/context.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_libraries.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_stream.h"
#include "kernels/cuda/row_launch.cuh"
#include "kernels/functors/convolution.h"

namespace tessera {
namespace {

cudnnDataType_t cudnn_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDNN_DATA_FLOAT;
    case DType::bf16:
      return CUDNN_DATA_BFLOAT16;
    case DType::f16:
      return CUDNN_DATA_HALF;
    default:
      throw_unsupported_dtype(dtype, "conv2d on cuda");
  }
}

// Owns one cuDNN descriptor: created in the constructor, destroyed in the destructor.
template <typename Handle, cudnnStatus_t (*Create)(Handle*), cudnnStatus_t (*Destroy)(Handle)>
class CudnnDescriptor {
 public:
  CudnnDescriptor() { TESSERA_CUDNN_CHECK(Create(&handle_)); }
  ~CudnnDescriptor() { Destroy(handle_); }
  CudnnDescriptor(const CudnnDescriptor&) = delete;
  CudnnDescriptor& operator=(const CudnnDescriptor&) = delete;
  Handle get() const { return handle_; }

 private:
  Handle handle_ = nullptr;
};

// An NCHW tensor [N, C, H, W].
class TensorDescriptor {
 public:
  explicit TensorDescriptor(const Tensor& t) {
    const Shape& s = t.shape();
    TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc_.get(), CUDNN_TENSOR_NCHW, cudnn_type(t.dtype()), int(s[0]),
                                                   int(s[1]), int(s[2]), int(s[3])));
  }
  cudnnTensorDescriptor_t get() const { return desc_.get(); }

 private:
  CudnnDescriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor> desc_;
};

// A KCRS filter [K, C, R, S].
class FilterDescriptor {
 public:
  explicit FilterDescriptor(const Tensor& t) {
    const Shape& s = t.shape();
    TESSERA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(desc_.get(), cudnn_type(t.dtype()), CUDNN_TENSOR_NCHW, int(s[0]),
                                                   int(s[1]), int(s[2]), int(s[3])));
  }
  cudnnFilterDescriptor_t get() const { return desc_.get(); }

 private:
  CudnnDescriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor> desc_;
};

// Stride and padding, cross-correlation (as every framework means by convolution), f32 accumulation.
class ConvolutionDescriptor {
 public:
  ConvolutionDescriptor(const ops::Conv2dParams& p, DType dtype) : f32_(dtype == DType::f32) {
    TESSERA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(desc_.get(), p.pad_h, p.pad_w, p.stride_h, p.stride_w, 1, 1,
                                                        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    TESSERA_CUDNN_CHECK(cudnnSetConvolutionMathType(desc_.get(), f32_ ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH));
  }
  cudnnConvolutionDescriptor_t get() const { return desc_.get(); }

  // The best-ranked algorithm among cuDNN's heuristic results that can run,
  // deterministic if any is, never with tensor-core math for f32; sets the
  // descriptor's math type to the algorithm's.
  template <typename Perf>
  Perf choose(const Perf* results, int count, const char* op) const {
    const Perf* chosen = nullptr;
    for (int i = 0; i < count; ++i) {
      const Perf& r = results[i];
      if (r.status != CUDNN_STATUS_SUCCESS) continue;
      if (f32_ && (r.mathType == CUDNN_TENSOR_OP_MATH || r.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)) continue;
      if (r.determinism == CUDNN_DETERMINISTIC) {
        chosen = &r;
        break;
      }
      if (!chosen) chosen = &r;
    }
    TESSERA_CHECK(chosen != nullptr, op, ": cuDNN's heuristics offer no usable algorithm for this convolution");
    if (!f32_) TESSERA_CUDNN_CHECK(cudnnSetConvolutionMathType(desc_.get(), chosen->mathType));
    return *chosen;
  }

 private:
  CudnnDescriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor, cudnnDestroyConvolutionDescriptor>
      desc_;
  bool f32_;
};

struct CudnnCall {
  CudaLibraries& libraries;
  cudnnHandle_t handle;

  explicit CudnnCall(const Tensor& t)
      : libraries(t.context().cuda_libraries(t.device().index)), handle(libraries.cudnn()) {}
  void* workspace(size_t bytes) { return bytes ? libraries.workspace(bytes) : nullptr; }
};

}  // namespace

void CudaBackend::conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                                 const ops::Conv2dParams& params) {
  const cudaStream_t stream = cuda::device_stream(x);
  CudnnCall call(x);
  const TensorDescriptor x_desc(x), y_desc(y);
  const FilterDescriptor w_desc(weight);
  const ConvolutionDescriptor conv(params, x.dtype());

  cudnnConvolutionFwdAlgoPerf_t results[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int count = 0;
  TESSERA_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(call.handle, x_desc.get(), w_desc.get(), conv.get(),
                                                             y_desc.get(), CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &count,
                                                             results));
  const auto algo = conv.choose(results, count, "conv2d_forward");
  size_t bytes = 0;
  TESSERA_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(call.handle, x_desc.get(), w_desc.get(), conv.get(),
                                                              y_desc.get(), algo.algo, &bytes));
  const float one = 1.0f, zero = 0.0f;
  TESSERA_CUDNN_CHECK(cudnnConvolutionForward(call.handle, &one, x_desc.get(), x.data_ptr(), w_desc.get(),
                                              weight.data_ptr(), conv.get(), algo.algo, call.workspace(bytes), bytes,
                                              &zero, y_desc.get(), y.data_ptr()));
  if (!bias.defined()) return;
  dispatch_float(y.dtype(), "conv2d_forward", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(y.numel(), Conv2dBiasAdd<T>{y.data<T>(), bias.data<T>(), y.size(1), y.size(2) * y.size(3)},
                         stream);
  });
}

void CudaBackend::conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x,
                                  Tensor* grad_weight, Tensor* grad_bias, const ops::Conv2dParams& params,
                                  bool accumulate) {
  const cudaStream_t stream = cuda::device_stream(x);
  CudnnCall call(x);
  const TensorDescriptor x_desc(x), dy_desc(grad_y);
  const FilterDescriptor w_desc(weight);
  const ConvolutionDescriptor conv(params, x.dtype());
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;

  if (grad_x) {
    cudnnConvolutionBwdDataAlgoPerf_t results[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    int count = 0;
    TESSERA_CUDNN_CHECK(
        cudnnGetConvolutionBackwardDataAlgorithm_v7(call.handle, w_desc.get(), dy_desc.get(), conv.get(), x_desc.get(),
                                                    CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &count, results));
    const auto algo = conv.choose(results, count, "conv2d_backward (grad_x)");
    size_t bytes = 0;
    TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(call.handle, w_desc.get(), dy_desc.get(),
                                                                     conv.get(), x_desc.get(), algo.algo, &bytes));
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardData(call.handle, &one, w_desc.get(), weight.data_ptr(), dy_desc.get(),
                                                     grad_y.data_ptr(), conv.get(), algo.algo, call.workspace(bytes),
                                                     bytes, &beta, x_desc.get(), grad_x->data_ptr()));
  }

  if (grad_weight) {
    cudnnConvolutionBwdFilterAlgoPerf_t results[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    int count = 0;
    TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        call.handle, x_desc.get(), dy_desc.get(), conv.get(), w_desc.get(), CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
        &count, results));
    const auto algo = conv.choose(results, count, "conv2d_backward (grad_weight)");
    size_t bytes = 0;
    TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(call.handle, x_desc.get(), dy_desc.get(),
                                                                       conv.get(), w_desc.get(), algo.algo, &bytes));
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(call.handle, &one, x_desc.get(), x.data_ptr(), dy_desc.get(),
                                                       grad_y.data_ptr(), conv.get(), algo.algo, call.workspace(bytes),
                                                       bytes, &beta, w_desc.get(), grad_weight->data_ptr()));
  }

  if (grad_bias) {
    const int64_t batch = grad_y.size(0), channels = grad_y.size(1), plane = grad_y.size(2) * grad_y.size(3);
    dispatch_float(grad_y.dtype(), "conv2d_backward", [&](auto tag) {
      using T = decltype(tag);
      cuda::for_each_row(channels,
                         Conv2dBiasGrad<T>{grad_y.data<T>(), grad_bias->data<T>(), batch, channels, plane, accumulate},
                         stream);
    });
  }
}

}  // namespace tessera
