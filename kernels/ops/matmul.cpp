// ops:: matrix multiply (with its fused bias/activation epilogue), its
// backward, and bias_add: argument checks, then the device's backend.
//
// Dtype rules checked here (the backends rely on them):
//   matmul:          a, b share a floating dtype; c is that dtype or f32;
//                    bias and pre_activation have c's dtype.
//   matmul_backward: grad_c has a's dtype or f32 (the backends narrow an f32
//                    grad_c to a's dtype); grad_a, grad_b have a's dtype or f32.
//   bias_add:        x, bias, y share a dtype; bias_add_backward's grad_bias
//                    has grad_y's dtype or f32.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

void check_no_overlap(std::string_view op, const detail::Arg& out, const detail::Arg& in) {
  TESSERA_CHECK(!detail::overlaps(out.tensor, in.tensor), op, ": output '", out.name, "' overlaps input '", in.name,
                "'; a matrix product cannot be computed in place");
}

void check_output_dtype(std::string_view op, const detail::Arg& out, DType input_dtype) {
  detail::check_floating(op, out);
  TESSERA_CHECK(out.tensor.dtype() == input_dtype || out.tensor.dtype() == DType::f32, op, ": '", out.name,
                "' must be ", dtype_name(input_dtype), " (the inputs' dtype) or f32, got ",
                dtype_name(out.tensor.dtype()));
}

// The shape of op(A)·op(B), after checking that a and b can be multiplied.
// `b_placeholder`: b's values are not read (only its shape and dtype).
Shape product_shape(std::string_view op, const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b,
                    bool b_placeholder = false) {
  detail::check_floating(op, {"a", a});
  if (b_placeholder)
    TESSERA_CHECK(b.dtype() == a.dtype(), op, ": 'b' is ", dtype_name(b.dtype()), ", 'a' ", dtype_name(a.dtype()));
  else
    detail::check_floating(op, {"b", b});
  if (!b_placeholder) detail::check_same_dtype(op, {"a", a}, {"b", b});
  TESSERA_CHECK(a.ndim() == 2 || a.ndim() == 3, op, ": 'a' must be [M, K] or [B, M, K], has shape ",
                a.shape().to_string());
  TESSERA_CHECK(b.ndim() == 2 || (b.ndim() == 3 && a.ndim() == 3), op, ": 'b' must be [K, N]",
                a.ndim() == 3 ? " or [B, K, N]" : "", " for 'a' of shape ", a.shape().to_string(), ", has shape ",
                b.shape().to_string());
  if (b.ndim() == 3)
    TESSERA_CHECK(b.size(0) == a.size(0), op, ": batch sizes differ: 'a' ", a.shape().to_string(), ", 'b' ",
                  b.shape().to_string());
  const int64_t m = transpose_a ? a.shape()[-1] : a.shape()[-2];
  const int64_t k = transpose_a ? a.shape()[-2] : a.shape()[-1];
  const int64_t kb = transpose_b ? b.shape()[-1] : b.shape()[-2];
  const int64_t n = transpose_b ? b.shape()[-2] : b.shape()[-1];
  TESSERA_CHECK(k == kb, op, ": inner dimensions differ: op(a) is ", m, "x", k, " (a ", a.shape().to_string(),
                transpose_a ? ", transposed" : "", "), op(b) is ", kb, "x", n, " (b ", b.shape().to_string(),
                transpose_b ? ", transposed" : "", ")");
  return a.ndim() == 3 ? Shape{a.size(0), m, n} : Shape{m, n};
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, Tensor& c, const MatmulOptions& options) {
  constexpr std::string_view op = "matmul";
  const Shape shape = product_shape(op, a, b, options.transpose_a, options.transpose_b);
  check_output_dtype(op, {"c", c}, a.dtype());
  detail::check_shape(op, {"c", c}, shape);
  check_no_overlap(op, {"c", c}, {"a", a});
  check_no_overlap(op, {"c", c}, {"b", b});
  const Tensor no_tensor;
  const Tensor& bias = options.bias ? *options.bias : no_tensor;
  const Tensor& pre = options.pre_activation ? *options.pre_activation : no_tensor;
  if (options.bias) {
    detail::check_dtype(op, {"bias", bias}, c.dtype());
    detail::check_shape(op, {"bias", bias}, Shape{shape[-1]});
    check_no_overlap(op, {"c", c}, {"bias", bias});
  }
  if (options.pre_activation) {
    detail::check_dtype(op, {"pre_activation", pre}, c.dtype());
    detail::check_shape(op, {"pre_activation", pre}, shape);
    check_no_overlap(op, {"pre_activation", pre}, {"c", c});
    check_no_overlap(op, {"pre_activation", pre}, {"a", a});
    check_no_overlap(op, {"pre_activation", pre}, {"b", b});
  }
  detail::check_same_device(op, {{"a", a}, {"b", b}, {"c", c}, {"bias", bias}, {"pre_activation", pre}});
  backend_for(a, "matmul").matmul(a, b, c, options);
}

void matmul_backward(const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a, Tensor* grad_b,
                     bool transpose_a, bool transpose_b, bool accumulate) {
  constexpr std::string_view op = "matmul_backward";
  // b's values are read only for grad_a: without it b may be a placeholder.
  const Shape shape = product_shape(op, a, b, transpose_a, transpose_b, !grad_a && !b.defined());
  check_output_dtype(op, {"grad_c", grad_c}, a.dtype());
  detail::check_shape(op, {"grad_c", grad_c}, shape);
  const Tensor no_tensor;
  const Tensor& ga = grad_a ? *grad_a : no_tensor;
  const Tensor& gb = grad_b ? *grad_b : no_tensor;
  if (grad_a) {
    check_output_dtype(op, {"grad_a", ga}, a.dtype());
    detail::check_shape(op, {"grad_a", ga}, a.shape());
    for (const detail::Arg& in : {detail::Arg{"grad_c", grad_c}, detail::Arg{"a", a}, detail::Arg{"b", b}})
      check_no_overlap(op, {"grad_a", ga}, in);
  }
  if (grad_b) {
    check_output_dtype(op, {"grad_b", gb}, a.dtype());
    detail::check_shape(op, {"grad_b", gb}, b.shape());
    for (const detail::Arg& in :
         {detail::Arg{"grad_c", grad_c}, detail::Arg{"a", a}, detail::Arg{"b", b}, detail::Arg{"grad_a", ga}})
      check_no_overlap(op, {"grad_b", gb}, in);
  }
  detail::check_same_device(op, {{"grad_c", grad_c}, {"a", a}, {"b", b}, {"grad_a", ga}, {"grad_b", gb}});
  if (!grad_a && !grad_b) return;
  backend_for(grad_c, "matmul_backward")
      .matmul_backward(grad_c, a, b, grad_a, grad_b, transpose_a, transpose_b, accumulate);
}

void bias_add(const Tensor& x, const Tensor& bias, Tensor& y) {
  constexpr std::string_view op = "bias_add";
  detail::check_floating(op, {"x", x});
  TESSERA_CHECK(x.ndim() >= 1, op, ": 'x' must have at least one dimension (rows of C values), is a scalar");
  detail::check_dtype(op, {"bias", bias}, x.dtype());
  detail::check_shape(op, {"bias", bias}, Shape{detail::last_dim(x)});
  detail::check_dtype(op, {"y", y}, x.dtype());
  detail::check_shape(op, {"y", y}, x.shape());
  check_no_overlap(op, {"y", y}, {"bias", bias});
  TESSERA_CHECK(!detail::overlaps(y, x) || y.data_ptr() == x.data_ptr(), op,
                ": 'y' partly overlaps 'x'; pass x itself (in place) or a separate tensor");
  detail::check_same_device(op, {{"x", x}, {"bias", bias}, {"y", y}});
  backend_for(x, "bias_add").bias_add(x, bias, y);
}

void bias_add_backward(const Tensor& grad_y, Tensor& grad_bias, bool accumulate) {
  constexpr std::string_view op = "bias_add_backward";
  detail::check_floating(op, {"grad_y", grad_y});
  TESSERA_CHECK(grad_y.ndim() >= 1, op, ": 'grad_y' must have at least one dimension, is a scalar");
  check_output_dtype(op, {"grad_bias", grad_bias}, grad_y.dtype());
  detail::check_shape(op, {"grad_bias", grad_bias}, Shape{detail::last_dim(grad_y)});
  check_no_overlap(op, {"grad_bias", grad_bias}, {"grad_y", grad_y});
  detail::check_same_device(op, {{"grad_y", grad_y}, {"grad_bias", grad_bias}});
  backend_for(grad_y, "bias_add_backward").bias_add_backward(grad_y, grad_bias, accumulate);
}

}  // namespace tessera::ops
