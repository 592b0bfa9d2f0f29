// ops:: whole-tensor reductions (sum, mean, max, sum_squares) and their
// gradients: argument checks, then the device's backend (reduce / reduce_backward).
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// A one-element f32 tensor (the result or its gradient).
void check_scalar(std::string_view op, const detail::Arg& arg) {
  detail::check_dtype(op, arg, DType::f32);
  detail::check_numel(op, arg, 1);
}

void run_reduce(std::string_view op, ReduceKind kind, const Tensor& x, Tensor& out) {
  detail::check_floating(op, {"x", x});
  check_scalar(op, {"out", out});
  detail::check_same_device(op, {{"x", x}, {"out", out}});
  if (kind == ReduceKind::max)
    TESSERA_CHECK(x.numel() > 0, op, ": 'x' is empty; the maximum of no elements is undefined");
  TESSERA_CHECK(!x.shares_storage_with(out), op, ": 'out' must not share memory with 'x'");
  backend_for(x, "reduce").reduce(kind, x, out);
}

// x is undefined for sum and mean (their gradient needs only grad_x's shape).
void run_backward(std::string_view op, ReduceKind kind, const Tensor& x, const Tensor& grad_out, Tensor& grad_x) {
  check_scalar(op, {"grad_out", grad_out});
  detail::check_floating(op, {"grad_x", grad_x});
  if (x.defined()) {
    detail::check_floating(op, {"x", x});
    detail::check_same_dtype(op, {"x", x}, {"grad_x", grad_x});
    detail::check_shape(op, {"grad_x", grad_x}, x.shape());
    if (kind == ReduceKind::max)
      TESSERA_CHECK(x.numel() > 0, op, ": 'x' is empty; the maximum of no elements is undefined");
  }
  detail::check_same_device(op, {{"x", x}, {"grad_out", grad_out}, {"grad_x", grad_x}});
  TESSERA_CHECK(!grad_out.shares_storage_with(grad_x), op, ": 'grad_x' must not share memory with 'grad_out'");
  backend_for(grad_x, "reduce_backward").reduce_backward(kind, x, grad_out, grad_x);
}

}  // namespace

void sum(const Tensor& x, Tensor& out) {
  run_reduce("sum", ReduceKind::sum, x, out);
}
void mean(const Tensor& x, Tensor& out) {
  run_reduce("mean", ReduceKind::mean, x, out);
}
void max(const Tensor& x, Tensor& out) {
  run_reduce("max", ReduceKind::max, x, out);
}
void sum_squares(const Tensor& x, Tensor& out) {
  run_reduce("sum_squares", ReduceKind::sum_squares, x, out);
}

void sum_backward(const Tensor& grad_out, Tensor& grad_x) {
  run_backward("sum_backward", ReduceKind::sum, Tensor(), grad_out, grad_x);
}
void mean_backward(const Tensor& grad_out, Tensor& grad_x) {
  run_backward("mean_backward", ReduceKind::mean, Tensor(), grad_out, grad_x);
}
void sum_squares_backward(const Tensor& x, const Tensor& grad_out, Tensor& grad_x) {
  detail::check_defined("sum_squares_backward", {"x", x});
  run_backward("sum_squares_backward", ReduceKind::sum_squares, x, grad_out, grad_x);
}
void max_backward(const Tensor& x, const Tensor& grad_out, Tensor& grad_x) {
  detail::check_defined("max_backward", {"x", x});
  run_backward("max_backward", ReduceKind::max, x, grad_out, grad_x);
}

}  // namespace tessera::ops
