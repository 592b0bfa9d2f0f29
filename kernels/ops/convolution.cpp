// ops:: 2-D convolution and max pooling (NCHW): output shapes, argument
// checks, then the device's backend.
#include <limits>

#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// Output size along one axis: floor((in + 2·pad − kernel) / stride) + 1.
int64_t window_count(int64_t in, int64_t kernel, int stride, int pad) {
  return (in + 2 * pad - kernel) / stride + 1;
}

Shape conv_output_shape(std::string_view op, const Shape& x, const Shape& weight, const Conv2dParams& params) {
  TESSERA_CHECK(x.ndim() == 4, op, ": 'x' must be [N, C, H, W], has shape ", x.to_string());
  TESSERA_CHECK(weight.ndim() == 4, op, ": 'weight' must be [K, C, R, S], has shape ", weight.to_string());
  TESSERA_CHECK(weight[1] == x[1], op, ": 'weight' has ", weight[1], " input channels (shape ", weight.to_string(),
                ") but 'x' has ", x[1], " (shape ", x.to_string(), ")");
  TESSERA_CHECK(params.stride_h >= 1 && params.stride_w >= 1, op, ": strides must be at least 1, got ", params.stride_h,
                "×", params.stride_w);
  TESSERA_CHECK(params.pad_h >= 0 && params.pad_w >= 0, op, ": padding must not be negative, got ", params.pad_h, "×",
                params.pad_w);
  TESSERA_CHECK(weight[0] >= 1 && weight[1] >= 1 && weight[2] >= 1 && weight[3] >= 1, op,
                ": 'weight' has an empty dimension (shape ", weight.to_string(), ")");
  TESSERA_CHECK(x[2] + 2 * params.pad_h >= weight[2] && x[3] + 2 * params.pad_w >= weight[3], op, ": the ", weight[2],
                "×", weight[3], " kernel is larger than the padded ", x[2] + 2 * params.pad_h, "×",
                x[3] + 2 * params.pad_w, " input");
  return Shape{x[0], weight[0], window_count(x[2], weight[2], params.stride_h, params.pad_h),
               window_count(x[3], weight[3], params.stride_w, params.pad_w)};
}

Shape pool_output_shape(std::string_view op, const Shape& x, const Pool2dParams& params) {
  TESSERA_CHECK(x.ndim() == 4, op, ": 'x' must be [N, C, H, W], has shape ", x.to_string());
  TESSERA_CHECK(params.kernel_h >= 1 && params.kernel_w >= 1, op, ": the kernel must be at least 1×1, got ",
                params.kernel_h, "×", params.kernel_w);
  TESSERA_CHECK(params.stride_h >= 1 && params.stride_w >= 1, op, ": strides must be at least 1, got ", params.stride_h,
                "×", params.stride_w);
  // At most half the kernel, so every window holds at least one input element.
  TESSERA_CHECK(params.pad_h >= 0 && params.pad_w >= 0 && 2 * params.pad_h <= params.kernel_h &&
                    2 * params.pad_w <= params.kernel_w,
                op, ": padding must be between 0 and half the kernel, got ", params.pad_h, "×", params.pad_w, " for a ",
                params.kernel_h, "×", params.kernel_w, " kernel");
  TESSERA_CHECK(x[2] + 2 * params.pad_h >= params.kernel_h && x[3] + 2 * params.pad_w >= params.kernel_w, op, ": the ",
                params.kernel_h, "×", params.kernel_w, " kernel is larger than the padded ", x[2] + 2 * params.pad_h,
                "×", x[3] + 2 * params.pad_w, " input");
  // indices hold h·W + w as i32.
  TESSERA_CHECK(x[2] * x[3] <= std::numeric_limits<int32_t>::max(), op, ": an input plane of ", x[2], "×", x[3],
                " is too large for i32 indices");
  return Shape{x[0], x[1], window_count(x[2], params.kernel_h, params.stride_h, params.pad_h),
               window_count(x[3], params.kernel_w, params.stride_w, params.pad_w)};
}

// x and weight floating, of one dtype; returns the output shape.
Shape check_conv_inputs(std::string_view op, const Tensor& x, const Tensor& weight, const Conv2dParams& params) {
  detail::check_floating(op, {"x", x});
  detail::check_floating(op, {"weight", weight});
  detail::check_same_dtype(op, {"x", x}, {"weight", weight});
  return conv_output_shape(op, x.shape(), weight.shape(), params);
}

void check_like(std::string_view op, const detail::Arg& arg, const Tensor& like, const Shape& shape) {
  detail::check_floating(op, arg);
  detail::check_same_dtype(op, {"x", like}, arg);
  detail::check_shape(op, arg, shape);
}

}  // namespace

Shape conv2d_output_shape(const Shape& x, const Shape& weight, const Conv2dParams& params) {
  return conv_output_shape("conv2d_output_shape", x, weight, params);
}

void conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, const Conv2dParams& params) {
  constexpr std::string_view op = "conv2d_forward";
  const Shape out = check_conv_inputs(op, x, weight, params);
  if (bias.defined()) check_like(op, {"bias", bias}, x, Shape{weight.size(0)});
  check_like(op, {"y", y}, x, out);
  detail::check_same_device(op, {{"x", x}, {"weight", weight}, {"bias", bias}, {"y", y}});
  if (y.numel() == 0) return;
  backend_for(x, "conv2d_forward").conv2d_forward(x, weight, bias, y, params);
}

void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x, Tensor* grad_weight,
                     Tensor* grad_bias, const Conv2dParams& params, bool accumulate) {
  constexpr std::string_view op = "conv2d_backward";
  const Shape out = check_conv_inputs(op, x, weight, params);
  check_like(op, {"grad_y", grad_y}, x, out);
  const Tensor none;
  if (grad_x) check_like(op, {"grad_x", *grad_x}, x, x.shape());
  if (grad_weight) check_like(op, {"grad_weight", *grad_weight}, x, weight.shape());
  if (grad_bias) check_like(op, {"grad_bias", *grad_bias}, x, Shape{weight.size(0)});
  detail::check_same_device(op, {{"grad_y", grad_y},
                                 {"x", x},
                                 {"weight", weight},
                                 {"grad_x", grad_x ? *grad_x : none},
                                 {"grad_weight", grad_weight ? *grad_weight : none},
                                 {"grad_bias", grad_bias ? *grad_bias : none}});
  if (!grad_x && !grad_weight && !grad_bias) return;
  if (grad_y.numel() == 0) {  // an empty batch: no contribution to the parameters' gradients
    if (!accumulate && grad_weight) grad_weight->fill_(0.0);
    if (!accumulate && grad_bias) grad_bias->fill_(0.0);
    return;
  }
  backend_for(x, "conv2d_backward")
      .conv2d_backward(grad_y, x, weight, grad_x, grad_weight, grad_bias, params, accumulate);
}

Shape maxpool2d_output_shape(const Shape& x, const Pool2dParams& params) {
  return pool_output_shape("maxpool2d_output_shape", x, params);
}

void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const Pool2dParams& params) {
  constexpr std::string_view op = "maxpool2d_forward";
  detail::check_floating(op, {"x", x});
  const Shape out = pool_output_shape(op, x.shape(), params);
  check_like(op, {"y", y}, x, out);
  detail::check_dtype(op, {"indices", indices}, DType::i32);
  detail::check_shape(op, {"indices", indices}, out);
  detail::check_same_device(op, {{"x", x}, {"y", y}, {"indices", indices}});
  backend_for(x, "maxpool2d_forward").maxpool2d_forward(x, y, indices, params);
}

void maxpool2d_backward(const Tensor& grad_y, const Tensor& indices, Tensor& grad_x, const Pool2dParams& params) {
  constexpr std::string_view op = "maxpool2d_backward";
  detail::check_floating(op, {"grad_x", grad_x});
  const Shape out = pool_output_shape(op, grad_x.shape(), params);
  detail::check_floating(op, {"grad_y", grad_y});
  detail::check_same_dtype(op, {"grad_x", grad_x}, {"grad_y", grad_y});
  detail::check_shape(op, {"grad_y", grad_y}, out);
  detail::check_dtype(op, {"indices", indices}, DType::i32);
  detail::check_shape(op, {"indices", indices}, out);
  detail::check_same_device(op, {{"grad_y", grad_y}, {"indices", indices}, {"grad_x", grad_x}});
  backend_for(grad_x, "maxpool2d_backward").maxpool2d_backward(grad_y, indices, grad_x, params);
}

}  // namespace tessera::ops
