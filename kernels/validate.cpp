// Argument checks for ops::.
#include "kernels/validate.h"

namespace tessera::ops::detail {

void check_defined(std::string_view op, const Arg& arg) {
  TESSERA_CHECK(arg.tensor.defined(), op, ": argument '", arg.name, "' is an undefined tensor");
}

Device check_same_device(std::string_view op, std::initializer_list<Arg> args) {
  const Arg* first = nullptr;
  for (const Arg& arg : args) {
    if (!arg.tensor.defined()) continue;
    if (!first) {
      first = &arg;
      continue;
    }
    TESSERA_CHECK(arg.tensor.device() == first->tensor.device(), op, ": '", arg.name, "' is on ",
                  arg.tensor.device().to_string(), " but '", first->name, "' is on ",
                  first->tensor.device().to_string(), "; move them to one device with .to()");
  }
  TESSERA_CHECK(first != nullptr, op, ": no defined tensor among the arguments");
  return first->tensor.device();
}

void check_floating(std::string_view op, const Arg& arg) {
  check_defined(op, arg);
  TESSERA_CHECK(is_floating(arg.tensor.dtype()), op, ": '", arg.name, "' must be f32, bf16 or f16, got ",
                dtype_name(arg.tensor.dtype()));
}

void check_index(std::string_view op, const Arg& arg) {
  check_defined(op, arg);
  TESSERA_CHECK(arg.tensor.dtype() == DType::i32 || arg.tensor.dtype() == DType::i64, op, ": '", arg.name,
                "' must hold indices (i32 or i64), got ", dtype_name(arg.tensor.dtype()));
}

void check_dtype(std::string_view op, const Arg& arg, DType dtype) {
  check_defined(op, arg);
  TESSERA_CHECK(arg.tensor.dtype() == dtype, op, ": '", arg.name, "' must be ", dtype_name(dtype), ", got ",
                dtype_name(arg.tensor.dtype()));
}

void check_same_dtype(std::string_view op, const Arg& a, const Arg& b) {
  TESSERA_CHECK(a.tensor.dtype() == b.tensor.dtype(), op, ": '", a.name, "' is ", dtype_name(a.tensor.dtype()),
                " but '", b.name, "' is ", dtype_name(b.tensor.dtype()), "; they must match");
}

void check_shape(std::string_view op, const Arg& arg, const Shape& expected) {
  check_defined(op, arg);
  TESSERA_CHECK(arg.tensor.shape() == expected, op, ": '", arg.name, "' has shape ", arg.tensor.shape().to_string(),
                ", expected ", expected.to_string());
}

void check_numel(std::string_view op, const Arg& arg, int64_t expected) {
  check_defined(op, arg);
  TESSERA_CHECK(arg.tensor.numel() == expected, op, ": '", arg.name, "' has ", arg.tensor.numel(), " elements (shape ",
                arg.tensor.shape().to_string(), "), expected ", expected);
}

void check_ndim(std::string_view op, const Arg& arg, int ndim) {
  check_defined(op, arg);
  TESSERA_CHECK(arg.tensor.ndim() == ndim, op, ": '", arg.name, "' must have ", ndim, " dimensions, has shape ",
                arg.tensor.shape().to_string());
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || !a.shares_storage_with(b) || a.nbytes() == 0 || b.nbytes() == 0) return false;
  return a.offset_bytes() < b.offset_bytes() + b.nbytes() && b.offset_bytes() < a.offset_bytes() + a.nbytes();
}

void check_alias(std::string_view op, const Arg& out, const Arg& in) {
  const bool same = out.tensor.offset_bytes() == in.tensor.offset_bytes() && out.tensor.dtype() == in.tensor.dtype();
  TESSERA_CHECK(!overlaps(out.tensor, in.tensor) || same, op, ": '", out.name, "' must be '", in.name,
                "' itself or not overlap it in memory");
}

int64_t last_dim(const Tensor& t) {
  return t.ndim() == 0 ? 1 : t.shape()[-1];
}

int64_t rows(const Tensor& t) {
  const int64_t d = last_dim(t);
  return d == 0 ? 0 : t.numel() / d;
}

}  // namespace tessera::ops::detail
