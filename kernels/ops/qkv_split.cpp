// ops:: split_qkv / join_qkv (the projections' queries and key/value block
// for ring attention): argument checks, then the device's backend.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// H and G of qkv [B, T, 3, H, Dh] (grouped false) or [B, T, G, R + 2, Dh].
struct Heads {
  int64_t heads, groups;
};
Heads heads_of(std::string_view op, const Tensor& qkv, bool grouped) {
  detail::check_floating(op, {"qkv", qkv});
  detail::check_ndim(op, {"qkv", qkv}, 5);
  if (grouped) {
    TESSERA_CHECK(qkv.size(3) >= 3, op, ": grouped qkv must be [B, T, G, R + 2, Dh] (R ≥ 1), got shape ",
                  qkv.shape().to_string());
    return {qkv.size(2) * (qkv.size(3) - 2), qkv.size(2)};
  }
  TESSERA_CHECK(qkv.size(2) == 3, op, ": qkv must be [B, T, 3, H, Dh], got shape ", qkv.shape().to_string());
  return {qkv.size(3), qkv.size(3)};
}

Shape q_shape(const Tensor& qkv, Heads h) {
  return Shape{qkv.size(0), qkv.size(1), h.heads, qkv.size(4)};
}
Shape kv_shape(const Tensor& qkv, Heads h) {
  return Shape{qkv.size(0), qkv.size(1), h.groups, 2, qkv.size(4)};
}

}  // namespace

void split_qkv(const Tensor& qkv, bool grouped, Tensor& q, Tensor& kv) {
  constexpr const char* op = "split_qkv";
  const Heads h = heads_of(op, qkv, grouped);
  detail::check_shape(op, {"q", q}, q_shape(qkv, h));
  detail::check_shape(op, {"kv", kv}, kv_shape(qkv, h));
  detail::check_same_dtype(op, {"qkv", qkv}, {"q", q});
  detail::check_same_dtype(op, {"qkv", qkv}, {"kv", kv});
  detail::check_alias(op, {"q", q}, {"qkv", qkv});
  detail::check_alias(op, {"kv", kv}, {"qkv", qkv});
  detail::check_same_device(op, {{"qkv", qkv}, {"q", q}, {"kv", kv}});
  backend_for(qkv, op).split_qkv(qkv, grouped, q, kv);
}

void join_qkv(const Tensor& grad_q, const Tensor& grad_kv, bool grouped, Tensor& grad_qkv) {
  constexpr const char* op = "join_qkv";
  const Heads h = heads_of(op, grad_qkv, grouped);
  detail::check_shape(op, {"grad_q", grad_q}, q_shape(grad_qkv, h));
  detail::check_shape(op, {"grad_kv", grad_kv}, kv_shape(grad_qkv, h));
  detail::check_same_dtype(op, {"grad_q", grad_q}, {"grad_kv", grad_kv});
  TESSERA_CHECK(grad_q.dtype() == DType::f32 || grad_q.dtype() == grad_qkv.dtype(), op,
                ": the gradients must be f32 or grad_qkv's dtype ", dtype_name(grad_qkv.dtype()), ", got ",
                dtype_name(grad_q.dtype()));
  detail::check_alias(op, {"grad_qkv", grad_qkv}, {"grad_q", grad_q});
  detail::check_alias(op, {"grad_qkv", grad_qkv}, {"grad_kv", grad_kv});
  detail::check_same_device(op, {{"grad_q", grad_q}, {"grad_kv", grad_kv}, {"grad_qkv", grad_qkv}});
  backend_for(grad_qkv, op).join_qkv(grad_q, grad_kv, grouped, grad_qkv);
}

}  // namespace tessera::ops
