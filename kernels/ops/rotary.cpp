// ops:: rotary position embedding of grouped projections [B, T, G, R + 2, Dh]:
// argument checks, then the device's backend.
#include <cmath>

#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// in, out [B, T, G, R + 2, Dh] (out may be in itself), positions [T] i32/i64.
void check_rotary(std::string_view op, std::string_view in_name, const Tensor& in, const Tensor& positions,
                  std::string_view out_name, const Tensor& out, float base) {
  detail::check_floating(op, {in_name, in});
  detail::check_ndim(op, {in_name, in}, 5);
  TESSERA_CHECK(in.size(3) >= 3, op, ": '", in_name,
                "' must be [B, T, G, R + 2, Dh] (per key/value group: R ≥ 1 queries, the key, the value), got shape ",
                in.shape().to_string());
  TESSERA_CHECK(in.size(4) % 2 == 0, op, ": the head dimension (last of '", in_name, "', shape ",
                in.shape().to_string(), ") must be even: rotary embedding rotates pairs (i, i + Dh/2)");
  detail::check_index(op, {"positions", positions});
  detail::check_shape(op, {"positions", positions}, Shape{in.size(1)});
  TESSERA_CHECK(std::isfinite(base) && base > 0.0f, op, ": the rotary base must be a positive number, got ", base,
                "; check --rotary-base");
  detail::check_floating(op, {out_name, out});
  detail::check_same_dtype(op, {in_name, in}, {out_name, out});
  detail::check_shape(op, {out_name, out}, in.shape());
  detail::check_alias(op, {out_name, out}, {in_name, in});
  TESSERA_CHECK(!detail::overlaps(out, positions), op, ": '", out_name, "' must not overlap 'positions' in memory");
  detail::check_same_device(op, {{in_name, in}, {"positions", positions}, {out_name, out}});
}

}  // namespace

void rotary_forward(const Tensor& qkv, const Tensor& positions, Tensor& out, float base) {
  check_rotary("rotary_forward", "qkv", qkv, positions, "out", out, base);
  backend_for(qkv, "rotary_forward").rotary_forward(qkv, positions, out, base);
}

void rotary_backward(const Tensor& grad_out, const Tensor& positions, Tensor& grad_qkv, float base) {
  check_rotary("rotary_backward", "grad_out", grad_out, positions, "grad_qkv", grad_qkv, base);
  backend_for(grad_out, "rotary_backward").rotary_backward(grad_out, positions, grad_qkv, base);
}

}  // namespace tessera::ops
