// ops:: dropout forward and backward: argument checks, then the device's backend.
#include <cmath>

#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

void check_dropout(std::string_view op, std::string_view in_name, const Tensor& in, std::string_view out_name,
                   const Tensor& out, float p) {
  detail::check_floating(op, {in_name, in});
  detail::check_floating(op, {out_name, out});
  detail::check_same_dtype(op, {in_name, in}, {out_name, out});
  detail::check_shape(op, {out_name, out}, in.shape());
  detail::check_same_device(op, {{in_name, in}, {out_name, out}});
  TESSERA_CHECK(p >= 0.0f && p <= 1.0f, op, ": drop probability 'p' must be in [0, 1], got ", p);
  detail::check_alias(op, {out_name, out}, {in_name, in});
}

}  // namespace

void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset) {
  check_dropout("dropout_forward", "x", x, "y", y, p);
  backend_for(x, "dropout_forward").dropout_forward(x, y, p, seed, offset);
}

void dropout_backward(const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset) {
  check_dropout("dropout_backward", "grad_y", grad_y, "grad_x", grad_x, p);
  backend_for(grad_y, "dropout_backward").dropout_backward(grad_y, grad_x, p, seed, offset);
}

}  // namespace tessera::ops
