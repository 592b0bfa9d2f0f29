// ops:: cast, scale_, axpy and add: argument checks, then the device's backend.
// axpy also adds a bf16/f16 x into an f32 y (gradient accumulation); add
// needs one dtype throughout.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// An output may be an input itself (same bytes, same dtype) or lie apart from it;
// a partial overlap would let one element's write clobber another's read.
void check_alias(std::string_view op, const detail::Arg& out, const detail::Arg& in) {
  const Tensor& a = out.tensor;
  const Tensor& b = in.tensor;
  if (!a.shares_storage_with(b)) return;
  const bool overlap =
      a.offset_bytes() < b.offset_bytes() + b.nbytes() && b.offset_bytes() < a.offset_bytes() + a.nbytes();
  const bool same = a.offset_bytes() == b.offset_bytes() && a.dtype() == b.dtype();
  TESSERA_CHECK(!overlap || same, op, ": '", out.name, "' must be '", in.name, "' itself or not overlap it in memory");
}

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
  check_alias(op, {"y", y}, {"x", x});
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
  check_alias(op, {"y", y}, {"x", x});
  backend_for(x, "axpy").axpy(alpha, x, y);
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  constexpr std::string_view op = "add";
  check_like(op, {"a", a}, {"b", b});
  check_like(op, {"a", a}, {"out", out});
  detail::check_same_device(op, {{"a", a}, {"b", b}, {"out", out}});
  check_alias(op, {"out", out}, {"a", a});
  check_alias(op, {"out", out}, {"b", b});
  backend_for(a, "add").add(a, b, out);
}

}  // namespace tessera::ops
