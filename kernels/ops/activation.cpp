// ops:: ReLU and GELU: argument checks, then the device's backend.
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

}  // namespace tessera::ops
