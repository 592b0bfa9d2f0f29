// ops:: cast, scale_, axpy and add: argument checks, then the device's backend.
// axpy also adds a bf16/f16 x into an f32 y (gradient accumulation); add
// needs one dtype throughout.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

void check_like(std::string_view op, const detail::Arg& x, const detail::Arg& y) {
  detail::check_floating(op, x);
  detail::check_floating(op, y);
  detail::check_same_dtype(op, x, y);
  detail::check_numel(op, y, x.tensor.numel());
}

}  // namespace

void cast(const Tensor& x, Tensor& y) {
  constexpr std::string_view op = "cast";
  detail::check_floating(op, {"x", x});
  detail::check_floating(op, {"y", y});
  detail::check_numel(op, {"y", y}, x.numel());
  detail::check_same_device(op, {{"x", x}, {"y", y}});
  detail::check_alias(op, {"y", y}, {"x", x});
  backend_for(x, "cast").cast(x, y);
}

void scale_(Tensor& x, float alpha) {
  detail::check_floating("scale_", {"x", x});
  backend_for(x, "scale_").scale_(x, alpha);
}

void axpy(float alpha, const Tensor& x, Tensor& y) {
  constexpr std::string_view op = "axpy";
  detail::check_floating(op, {"x", x});
  detail::check_floating(op, {"y", y});
  TESSERA_CHECK(y.dtype() == x.dtype() || y.dtype() == DType::f32, op, ": 'y' must be ", dtype_name(x.dtype()),
                " (the dtype of 'x') or f32 (an accumulator), got ", dtype_name(y.dtype()));
  detail::check_numel(op, {"y", y}, x.numel());
  detail::check_same_device(op, {{"x", x}, {"y", y}});
  detail::check_alias(op, {"y", y}, {"x", x});
  backend_for(x, "axpy").axpy(alpha, x, y);
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  constexpr std::string_view op = "add";
  check_like(op, {"a", a}, {"b", b});
  check_like(op, {"a", a}, {"out", out});
  detail::check_same_device(op, {{"a", a}, {"b", b}, {"out", out}});
  detail::check_alias(op, {"out", out}, {"a", a});
  detail::check_alias(op, {"out", out}, {"b", b});
  backend_for(a, "add").add(a, b, out);
}

}  // namespace tessera::ops
