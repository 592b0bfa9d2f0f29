// ops:: token dispatch of the mixture of experts (tokens gathered into their
// experts' slots, and the experts' outputs combined back with the router's
// weights): argument checks, then the device's backend.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// A plan: pairs [M] i32 and slot_of [N, K] i32 for N tokens.
void check_plan(std::string_view op, const Tensor* pairs, const Tensor* slot_of, int64_t tokens) {
  if (pairs) {
    detail::check_dtype(op, {"pairs", *pairs}, DType::i32);
    detail::check_ndim(op, {"pairs", *pairs}, 1);
  }
  if (slot_of) {
    detail::check_dtype(op, {"slot_of", *slot_of}, DType::i32);
    detail::check_ndim(op, {"slot_of", *slot_of}, 2);
    TESSERA_CHECK(slot_of->size(0) == tokens, op, ": slot_of has ", slot_of->size(0), " tokens, the rows ", tokens);
  }
}

// rows [·, C] of one floating dtype.
void check_rows(std::string_view op, std::initializer_list<detail::Arg> rows, int64_t width) {
  for (const detail::Arg& row : rows) {
    detail::check_floating(op, row);
    detail::check_ndim(op, row, 2);
    TESSERA_CHECK(row.tensor.size(1) == width, op, ": '", row.name, "' has rows of ", row.tensor.size(1),
                  " elements, expected ", width);
    detail::check_same_dtype(op, *rows.begin(), row);
  }
}

}  // namespace

void moe_permute(const Tensor& x, const Tensor& pairs, int64_t top_k, Tensor& out) {
  constexpr const char* op = "moe_permute";
  check_rows(op, {{"x", x}, {"out", out}}, x.ndim() == 2 ? x.size(1) : -1);
  check_plan(op, &pairs, nullptr, x.size(0));
  TESSERA_CHECK(top_k >= 1, op, ": top-k must be at least 1, got ", top_k);
  detail::check_shape(op, {"out", out}, Shape{pairs.size(0), x.size(1)});
  detail::check_alias(op, {"out", out}, {"x", x});
  detail::check_same_device(op, {{"x", x}, {"pairs", pairs}, {"out", out}});
  backend_for(x, op).moe_permute(x, pairs, top_k, out);
}

void moe_permute_backward(const Tensor& grad_slots, const Tensor& slot_of, Tensor& grad_x) {
  constexpr const char* op = "moe_permute_backward";
  check_rows(op, {{"grad_slots", grad_slots}, {"grad_x", grad_x}}, grad_x.ndim() == 2 ? grad_x.size(1) : -1);
  check_plan(op, nullptr, &slot_of, grad_x.size(0));
  detail::check_alias(op, {"grad_x", grad_x}, {"grad_slots", grad_slots});
  detail::check_same_device(op, {{"grad_slots", grad_slots}, {"slot_of", slot_of}, {"grad_x", grad_x}});
  backend_for(grad_x, op).moe_permute_backward(grad_slots, slot_of, grad_x);
}

void moe_combine(const Tensor& ys, const Tensor& slot_of, const Tensor& weights, Tensor& out) {
  constexpr const char* op = "moe_combine";
  check_rows(op, {{"ys", ys}, {"out", out}}, out.ndim() == 2 ? out.size(1) : -1);
  check_plan(op, nullptr, &slot_of, out.size(0));
  detail::check_dtype(op, {"weights", weights}, DType::f32);
  detail::check_shape(op, {"weights", weights}, slot_of.shape());
  detail::check_alias(op, {"out", out}, {"ys", ys});
  detail::check_same_device(op, {{"ys", ys}, {"slot_of", slot_of}, {"weights", weights}, {"out", out}});
  backend_for(out, op).moe_combine(ys, slot_of, weights, out);
}

void moe_combine_backward(const Tensor& grad_out, const Tensor& ys, const Tensor& pairs, const Tensor& slot_of,
                          const Tensor& weights, Tensor& grad_ys, Tensor& grad_weights) {
  constexpr const char* op = "moe_combine_backward";
  check_rows(op, {{"grad_out", grad_out}, {"ys", ys}, {"grad_ys", grad_ys}},
             grad_out.ndim() == 2 ? grad_out.size(1) : -1);
  check_plan(op, &pairs, &slot_of, grad_out.size(0));
  detail::check_shape(op, {"ys", ys}, Shape{pairs.size(0), grad_out.size(1)});
  detail::check_shape(op, {"grad_ys", grad_ys}, ys.shape());
  detail::check_dtype(op, {"weights", weights}, DType::f32);
  detail::check_shape(op, {"weights", weights}, slot_of.shape());
  detail::check_dtype(op, {"grad_weights", grad_weights}, DType::f32);
  detail::check_shape(op, {"grad_weights", grad_weights}, slot_of.shape());
  detail::check_alias(op, {"grad_ys", grad_ys}, {"grad_out", grad_out});
  detail::check_alias(op, {"grad_ys", grad_ys}, {"ys", ys});
  detail::check_same_device(op, {{"grad_out", grad_out},
                                 {"ys", ys},
                                 {"pairs", pairs},
                                 {"slot_of", slot_of},
                                 {"weights", weights},
                                 {"grad_ys", grad_ys},
                                 {"grad_weights", grad_weights}});
  backend_for(grad_out, op).moe_combine_backward(grad_out, ys, pairs, slot_of, weights, grad_ys, grad_weights);
}

}  // namespace tessera::ops
