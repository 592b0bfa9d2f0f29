// CpuBackend: 2-D convolution (NCHW) through oneDNN's convolution primitives
// (forward with the bias fused, backward data, backward weights with the bias
// gradient fused), old 2.x API.
//
// Memory formats: the primitives are created with format_tag::any, so oneDNN
// picks its blocked layouts (nChw16c, ...) and its JIT/AMX kernels, and our
// plain NCHW/OIHW tensors are reordered in and out around each call. Measured
// on this machine (one thread, LeNet layers at batch 128, forward + backward
// data + backward weights, reorders included): conv 32→64 5×5 on 14×14 takes
// 43 ms in f32 and 13 ms in bf16 (AMX) with blocked layouts against 96 ms and
// 70 ms with plain ones (oneDNN's im2col+GEMM kernels; our own im2col +
// OpenBLAS sgemm forward was slower still, 49 ms against 14 ms). The exception
// is the f32 backward-data pass with very few input channels (a first layer),
// where channel blocking pads C up to 16: there plain layouts win, 3.4 ms
// against 18 ms for conv 1→32.
//
// dtypes: f32 and bf16 run natively (bf16 weight and bias gradients are
// computed in f32 and rounded once). oneDNN 2.6 has no f16 convolution on the
// CPU (and its f16 reorders are slow reference code), so f16 calls run the f32
// path on widened copies (exact) and round each output once.
//
// `accumulate` adds through a reorder with a sum post-op, rounding once.
// Scratch memory (reordered copies, oneDNN's scratchpad) comes from the Context.
#include "kernels/functors/convolution.h"

#include <dnnl.hpp>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/context.h"
#include "core/cpu_libraries.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/row_launch.h"

namespace tessera {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using DnnlType = memory::data_type;

// Below this many input channels, f32 backward data uses plain layouts (see the top of the file).
constexpr int64_t kMinBlockedBackwardDataChannels = 4;

// f32 and bf16 (f16 is widened to f32 before it gets here).
DnnlType dnnl_type(DType dtype) {
  TESSERA_CHECK(dtype == DType::f32 || dtype == DType::bf16, "conv2d on cpu: oneDNN path given ", dtype_name(dtype));
  return dtype == DType::bf16 ? DnnlType::bf16 : DnnlType::f32;
}

memory::dims dims_of(const Shape& shape) {
  return memory::dims(shape.sizes().begin(), shape.sizes().end());
}

// The geometry of one convolution in oneDNN's terms. padding_r makes oneDNN's
// output size equal ours, (H + 2·pad − R) / stride + 1 rounded down; it is
// negative when the division drops input rows, which oneDNN accepts.
struct ConvGeometry {
  memory::dims x, weight, bias, y;
  memory::dims strides, padding_l, padding_r;
  DnnlType type;

  ConvGeometry(const Tensor& x_tensor, const Tensor& weight_tensor, const ops::Conv2dParams& params)
      : x(dims_of(x_tensor.shape())), weight(dims_of(weight_tensor.shape())), type(dnnl_type(x_tensor.dtype())) {
    const Shape out = ops::conv2d_output_shape(x_tensor.shape(), weight_tensor.shape(), params);
    bias = {weight[0]};
    y = dims_of(out);
    strides = {params.stride_h, params.stride_w};
    padding_l = {params.pad_h, params.pad_w};
    padding_r = {(y[2] - 1) * params.stride_h + weight[2] - x[2] - params.pad_h,
                 (y[3] - 1) * params.stride_w + weight[3] - x[3] - params.pad_w};
  }

  memory::desc x_desc(bool plain) const { return {x, type, plain ? Tag::nchw : Tag::any}; }
  memory::desc weight_desc(bool plain, DnnlType t) const { return {weight, t, plain ? Tag::oihw : Tag::any}; }
  memory::desc y_desc(bool plain) const { return {y, type, plain ? Tag::nchw : Tag::any}; }

  // The forward primitive descriptor: what the backward ones are created against.
  dnnl::convolution_forward::primitive_desc forward(const memory::desc& bias_desc, const dnnl::primitive_attr& attr,
                                                    const dnnl::engine& engine) const {
    const dnnl::convolution_forward::desc desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                               x_desc(false), weight_desc(false, type), bias_desc, y_desc(false),
                                               strides, padding_l, padding_r);
    return {desc, attr, engine};
  }
};

// One operator call's oneDNN work: wraps tensors as oneDNN memories, makes
// reordered copies where the primitive wants another layout or type, and keeps
// the scratch tensors alive until the stream has finished.
class DnnlCall {
 public:
  explicit DnnlCall(Context& ctx)
      : ctx_(ctx), engine_(ctx.cpu_libraries().engine()), stream_(ctx.cpu_libraries().stream()) {
    attr_.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  }

  const dnnl::engine& engine() const { return engine_; }
  const dnnl::primitive_attr& attr() const { return attr_; }

  // A tensor as a plain (nchw, oihw or x) memory of its own dtype.
  memory user(const Tensor& t, Tag tag) const {
    return memory({dims_of(t.shape()), dnnl_type(t.dtype()), tag}, engine_, t.data_ptr());
  }

  memory scratch(const memory::desc& desc) {
    scratch_.push_back(ctx_.empty(Shape{int64_t(desc.get_size())}, DType::u8));
    return memory(desc, engine_, scratch_.back().data_ptr());
  }

  // An input as the primitive wants it: `user` itself, or a reordered copy
  // (made once per call: the backward passes share grad_y's).
  memory input(const memory& user, const memory::desc& wanted) {
    if (user.get_desc() == wanted) return user;
    for (const auto& [source, copy] : copies_)
      if (source == user.get_data_handle() && copy.get_desc() == wanted) return copy;
    memory copy = scratch(wanted);
    dnnl::reorder(user, copy).execute(stream_, {{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, copy}});
    copies_.emplace_back(user.get_data_handle(), copy);
    return copy;
  }

  // Where the primitive writes an output: `user` itself when it has the
  // wanted layout and nothing is accumulated, else scratch memory that
  // finish_output() moves into `user`.
  memory output(const memory& user, const memory::desc& wanted, bool accumulate) {
    if (!accumulate && user.get_desc() == wanted) return user;
    return scratch(wanted);
  }
  void finish_output(const memory& result, const memory& user, bool accumulate) {
    if (result.get_data_handle() == user.get_data_handle()) return;
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops sum;
      sum.append_sum(1.0f);
      attr.set_post_ops(sum);
    }
    dnnl::reorder(dnnl::reorder::primitive_desc(result, user, attr))
        .execute(stream_, {{DNNL_ARG_FROM, result}, {DNNL_ARG_TO, user}});
  }

  // Runs `primitive` with its scratchpad (from the Context) added to `args`.
  void execute(const dnnl::primitive& primitive, const memory::desc& scratchpad, std::unordered_map<int, memory> args) {
    if (scratchpad.get_size() > 0) args.emplace(DNNL_ARG_SCRATCHPAD, scratch(scratchpad));
    primitive.execute(stream_, args);
  }

  void wait() { stream_.wait(); }

 private:
  Context& ctx_;
  dnnl::engine& engine_;
  dnnl::stream& stream_;
  dnnl::primitive_attr attr_;
  std::vector<Tensor> scratch_;
  std::vector<std::pair<void*, memory>> copies_;  // reordered inputs, by source address
};

void backward_data(DnnlCall& call, const ConvGeometry& geo, const dnnl::convolution_forward::primitive_desc& hint,
                   const Tensor& grad_y, const Tensor& weight, Tensor& grad_x, bool accumulate) {
  const bool plain = geo.type == DnnlType::f32 && geo.x[1] < kMinBlockedBackwardDataChannels;
  const dnnl::convolution_backward_data::desc desc(dnnl::algorithm::convolution_direct, geo.x_desc(plain),
                                                   geo.weight_desc(plain, geo.type), geo.y_desc(plain), geo.strides,
                                                   geo.padding_l, geo.padding_r);
  const dnnl::convolution_backward_data::primitive_desc pd(desc, call.attr(), call.engine(), hint);
  const memory user_grad_x = call.user(grad_x, Tag::nchw);
  const memory grad_x_memory = call.output(user_grad_x, pd.diff_src_desc(), accumulate);
  call.execute(dnnl::convolution_backward_data(pd), pd.scratchpad_desc(),
               {{DNNL_ARG_DIFF_DST, call.input(call.user(grad_y, Tag::nchw), pd.diff_dst_desc())},
                {DNNL_ARG_WEIGHTS, call.input(call.user(weight, Tag::oihw), pd.weights_desc())},
                {DNNL_ARG_DIFF_SRC, grad_x_memory}});
  call.finish_output(grad_x_memory, user_grad_x, accumulate);
}

// Weight gradients in f32 whatever the storage type; the bias gradient is fused when asked for.
void backward_weights(DnnlCall& call, const ConvGeometry& geo, const dnnl::convolution_forward::primitive_desc& hint,
                      const Tensor& grad_y, const Tensor& x, Tensor& grad_weight, Tensor* grad_bias, bool accumulate) {
  const memory::desc bias_desc = grad_bias ? memory::desc(geo.bias, DnnlType::f32, Tag::x) : memory::desc();
  const dnnl::convolution_backward_weights::desc desc(dnnl::algorithm::convolution_direct, geo.x_desc(false),
                                                      geo.weight_desc(false, DnnlType::f32), bias_desc,
                                                      geo.y_desc(false), geo.strides, geo.padding_l, geo.padding_r);
  const dnnl::convolution_backward_weights::primitive_desc pd(desc, call.attr(), call.engine(), hint);
  const memory user_grad_weight = call.user(grad_weight, Tag::oihw);
  const memory grad_weight_memory = call.output(user_grad_weight, pd.diff_weights_desc(), accumulate);
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, call.input(call.user(x, Tag::nchw), pd.src_desc())},
      {DNNL_ARG_DIFF_DST, call.input(call.user(grad_y, Tag::nchw), pd.diff_dst_desc())},
      {DNNL_ARG_DIFF_WEIGHTS, grad_weight_memory}};
  memory user_grad_bias, grad_bias_memory;
  if (grad_bias) {
    user_grad_bias = call.user(*grad_bias, Tag::x);
    grad_bias_memory = call.output(user_grad_bias, pd.diff_bias_desc(), accumulate);
    args.emplace(DNNL_ARG_DIFF_BIAS, grad_bias_memory);
  }
  call.execute(dnnl::convolution_backward_weights(pd), pd.scratchpad_desc(), std::move(args));
  call.finish_output(grad_weight_memory, user_grad_weight, accumulate);
  if (grad_bias) call.finish_output(grad_bias_memory, user_grad_bias, accumulate);
}

// An f32 copy of an f16 tensor (undefined stays undefined).
Tensor widened(CpuBackend& backend, const Tensor& t) {
  if (!t.defined()) return t;
  Tensor wide = t.context().empty(t.shape(), DType::f32);
  backend.cast(t, wide);
  return wide;
}

// The bias gradient alone (no weight gradient to fuse it with).
void bias_gradient(const Tensor& grad_y, Tensor& grad_bias, bool accumulate) {
  const int64_t batch = grad_y.size(0), channels = grad_y.size(1), plane = grad_y.size(2) * grad_y.size(3);
  dispatch_float(grad_y.dtype(), "conv2d_backward", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_row(channels, batch * plane,
                     Conv2dBiasGrad<T>{grad_y.data<T>(), grad_bias.data<T>(), batch, channels, plane, accumulate});
  });
}

}  // namespace

void CpuBackend::conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                                const ops::Conv2dParams& params) {
  if (x.dtype() == DType::f16) {
    Tensor wide_y = x.context().empty(y.shape(), DType::f32);
    conv2d_forward(widened(*this, x), widened(*this, weight), widened(*this, bias), wide_y, params);
    cast(wide_y, y);
    return;
  }
  DnnlCall call(x.context());
  const ConvGeometry geo(x, weight, params);
  const memory::desc bias_desc = bias.defined() ? memory::desc(geo.bias, geo.type, Tag::x) : memory::desc();
  const auto pd = geo.forward(bias_desc, call.attr(), call.engine());
  const memory user_y = call.user(y, Tag::nchw);
  const memory y_memory = call.output(user_y, pd.dst_desc(), false);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, call.input(call.user(x, Tag::nchw), pd.src_desc())},
                                       {DNNL_ARG_WEIGHTS, call.input(call.user(weight, Tag::oihw), pd.weights_desc())},
                                       {DNNL_ARG_DST, y_memory}};
  if (bias.defined()) args.emplace(DNNL_ARG_BIAS, call.input(call.user(bias, Tag::x), pd.bias_desc()));
  call.execute(dnnl::convolution_forward(pd), pd.scratchpad_desc(), std::move(args));
  call.finish_output(y_memory, user_y, false);
  call.wait();
}

void CpuBackend::conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x,
                                 Tensor* grad_weight, Tensor* grad_bias, const ops::Conv2dParams& params,
                                 bool accumulate) {
  if (x.dtype() == DType::f16) {
    Tensor wide[3];
    Tensor* outputs[3] = {grad_x, grad_weight, grad_bias};
    Tensor* wide_outputs[3] = {};
    for (int i = 0; i < 3; ++i) {
      if (!outputs[i]) continue;
      wide[i] = accumulate ? widened(*this, *outputs[i]) : x.context().empty(outputs[i]->shape(), DType::f32);
      wide_outputs[i] = &wide[i];
    }
    conv2d_backward(widened(*this, grad_y), widened(*this, x), widened(*this, weight), wide_outputs[0], wide_outputs[1],
                    wide_outputs[2], params, accumulate);
    for (int i = 0; i < 3; ++i)
      if (outputs[i]) cast(wide[i], *outputs[i]);
    return;
  }
  DnnlCall call(x.context());
  const ConvGeometry geo(x, weight, params);
  const auto hint = geo.forward(memory::desc(), call.attr(), call.engine());
  if (grad_x) backward_data(call, geo, hint, grad_y, weight, *grad_x, accumulate);
  if (grad_weight) backward_weights(call, geo, hint, grad_y, x, *grad_weight, grad_bias, accumulate);
  call.wait();
  if (grad_bias && !grad_weight) bias_gradient(grad_y, *grad_bias, accumulate);
}

}  // namespace tessera
