// ops:: ReLU, GELU and SwiGLU: argument checks, then the device's backend.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

void check_unary(std::string_view op, const Tensor& x, const Tensor& y) {
  detail::check_floating(op, {"x", x});
  detail::check_floating(op, {"y", y});
  detail::check_same_dtype(op, {"x", x}, {"y", y});
  detail::check_shape(op, {"y", y}, x.shape());
  detail::check_same_device(op, {{"x", x}, {"y", y}});
}

void check_unary_backward(std::string_view op, const Tensor& x, const Tensor& grad_y, const Tensor& grad_x) {
  check_unary(op, x, grad_y);
  detail::check_floating(op, {"grad_x", grad_x});
  detail::check_same_dtype(op, {"x", x}, {"grad_x", grad_x});
  detail::check_shape(op, {"grad_x", grad_x}, x.shape());
  detail::check_same_device(op, {{"x", x}, {"grad_x", grad_x}});
}

// x [..., 2F] with F ≥ 1; returns the shape [..., F] of y and grad_y.
Shape check_swiglu_input(std::string_view op, const Tensor& x) {
  detail::check_floating(op, {"x", x});
  TESSERA_CHECK(x.ndim() >= 1 && x.size(-1) > 0 && x.size(-1) % 2 == 0, op,
                ": the last dimension of 'x' must hold [gate | up], an even width 2F > 0; got shape ",
                x.shape().to_string());
  return x.shape().with_dim(-1, x.size(-1) / 2);
}

}  // namespace

void relu_forward(const Tensor& x, Tensor& y) {
  check_unary("relu_forward", x, y);
  backend_for(x, "relu_forward").relu_forward(x, y);
}

void relu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  check_unary_backward("relu_backward", x, grad_y, grad_x);
  backend_for(x, "relu_backward").relu_backward(x, grad_y, grad_x);
}

void gelu_forward(const Tensor& x, Tensor& y) {
  check_unary("gelu_forward", x, y);
  backend_for(x, "gelu_forward").gelu_forward(x, y);
}

void gelu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  check_unary_backward("gelu_backward", x, grad_y, grad_x);
  backend_for(x, "gelu_backward").gelu_backward(x, grad_y, grad_x);
}

void swiglu_forward(const Tensor& x, Tensor& y) {
  constexpr std::string_view op = "swiglu_forward";
  const Shape half = check_swiglu_input(op, x);
  detail::check_floating(op, {"y", y});
  detail::check_same_dtype(op, {"x", x}, {"y", y});
  detail::check_shape(op, {"y", y}, half);
  TESSERA_CHECK(!detail::overlaps(y, x), op, ": 'y' must not overlap 'x' in memory");
  detail::check_same_device(op, {{"x", x}, {"y", y}});
  backend_for(x, "swiglu_forward").swiglu_forward(x, y);
}

void swiglu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x) {
  constexpr std::string_view op = "swiglu_backward";
  const Shape half = check_swiglu_input(op, x);
  detail::check_floating(op, {"grad_y", grad_y});
  detail::check_same_dtype(op, {"x", x}, {"grad_y", grad_y});
  detail::check_shape(op, {"grad_y", grad_y}, half);
  detail::check_floating(op, {"grad_x", grad_x});
  detail::check_same_dtype(op, {"x", x}, {"grad_x", grad_x});
  detail::check_shape(op, {"grad_x", grad_x}, x.shape());
  detail::check_alias(op, {"grad_x", grad_x}, {"x", x});
  TESSERA_CHECK(!detail::overlaps(grad_x, grad_y), op, ": 'grad_x' must not overlap 'grad_y' in memory");
  detail::check_same_device(op, {{"x", x}, {"grad_y", grad_y}, {"grad_x", grad_x}});
  backend_for(x, "swiglu_backward").swiglu_backward(x, grad_y, grad_x);
}

}  // namespace tessera::ops
