// ops:: mixture-of-experts routing (the router's softmax, top-k and
// renormalised weights, and their backward): argument checks, then the
// device's backend.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {

void moe_route(const Tensor& logits, Tensor& probs, Tensor& experts, Tensor& weights, Tensor& logsumexp) {
  constexpr const char* op = "moe_route";
  detail::check_dtype(op, {"logits", logits}, DType::f32);
  detail::check_ndim(op, {"logits", logits}, 2);
  detail::check_ndim(op, {"experts", experts}, 2);
  const int64_t tokens = logits.size(0), num_experts = logits.size(1), top_k = experts.size(1);
  TESSERA_CHECK(top_k >= 1 && top_k <= num_experts, op, ": top-k ", top_k, " must be from 1 to the ", num_experts,
                " experts; check --moe-router-topk and --num-experts");
  detail::check_dtype(op, {"experts", experts}, DType::i32);
  detail::check_shape(op, {"experts", experts}, Shape{tokens, top_k});
  detail::check_dtype(op, {"probs", probs}, DType::f32);
  detail::check_shape(op, {"probs", probs}, logits.shape());
  detail::check_dtype(op, {"weights", weights}, DType::f32);
  detail::check_shape(op, {"weights", weights}, Shape{tokens, top_k});
  detail::check_dtype(op, {"logsumexp", logsumexp}, DType::f32);
  detail::check_shape(op, {"logsumexp", logsumexp}, Shape{tokens});
  detail::check_alias(op, {"probs", probs}, {"logits", logits});
  detail::check_same_device(
      op, {{"logits", logits}, {"probs", probs}, {"experts", experts}, {"weights", weights}, {"logsumexp", logsumexp}});
  backend_for(logits, op).moe_route(logits, probs, experts, weights, logsumexp);
}

void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& grad_weights,
                        const Tensor* grad_probs, const Tensor* grad_logsumexp, Tensor& grad_logits) {
  constexpr const char* op = "moe_route_backward";
  detail::check_dtype(op, {"probs", probs}, DType::f32);
  detail::check_ndim(op, {"probs", probs}, 2);
  const int64_t tokens = probs.size(0);
  detail::check_dtype(op, {"experts", experts}, DType::i32);
  detail::check_ndim(op, {"experts", experts}, 2);
  detail::check_shape(op, {"experts", experts}, Shape{tokens, experts.size(1)});
  for (const auto& [name, tensor] : {std::pair<const char*, const Tensor*>{"weights", &weights},
                                     std::pair<const char*, const Tensor*>{"grad_weights", &grad_weights}}) {
    detail::check_dtype(op, {name, *tensor}, DType::f32);
    detail::check_shape(op, {name, *tensor}, experts.shape());
  }
  if (grad_probs) {
    detail::check_dtype(op, {"grad_probs", *grad_probs}, DType::f32);
    detail::check_shape(op, {"grad_probs", *grad_probs}, probs.shape());
  }
  if (grad_logsumexp) {
    detail::check_dtype(op, {"grad_logsumexp", *grad_logsumexp}, DType::f32);
    detail::check_shape(op, {"grad_logsumexp", *grad_logsumexp}, Shape{tokens});
  }
  detail::check_dtype(op, {"grad_logits", grad_logits}, DType::f32);
  detail::check_shape(op, {"grad_logits", grad_logits}, probs.shape());
  detail::check_alias(op, {"grad_logits", grad_logits}, {"probs", probs});
  if (grad_probs) detail::check_alias(op, {"grad_logits", grad_logits}, {"grad_probs", *grad_probs});
  detail::check_same_device(op, {{"probs", probs},
                                 {"experts", experts},
                                 {"weights", weights},
                                 {"grad_weights", grad_weights},
                                 {"grad_logits", grad_logits}});
  if (grad_probs) detail::check_same_device(op, {{"probs", probs}, {"grad_probs", *grad_probs}});
  if (grad_logsumexp) detail::check_same_device(op, {{"probs", probs}, {"grad_logsumexp", *grad_logsumexp}});
  backend_for(probs, op).moe_route_backward(probs, experts, weights, grad_weights, grad_probs, grad_logsumexp,
                                            grad_logits);
}

}  // namespace tessera::ops
