// ops:: softmax, cross-entropy, LayerNorm and RMSNorm: argument checks, then
// the device's backend. Rows are all leading dimensions flattened; per-row
// outputs (losses, logsumexp, mean, rstd) are f32 with one element per row,
// in any shape (e.g. [N] or [B, T]); the vocabulary-parallel cross-entropy's
// partial sums are [2, N].
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// `arg` is a floating tensor with the dtype and shape of `like`.
void check_like(std::string_view op, const detail::Arg& arg, const detail::Arg& like) {
  detail::check_floating(op, arg);
  detail::check_same_dtype(op, like, arg);
  detail::check_shape(op, arg, like.tensor.shape());
}

// A per-row f32 output or input with `rows` elements.
void check_per_row(std::string_view op, const detail::Arg& arg, int64_t rows) {
  detail::check_dtype(op, arg, DType::f32);
  detail::check_numel(op, arg, rows);
}

// A row-wise input: floating, at least one dimension, non-empty rows.
void check_rows_input(std::string_view op, const detail::Arg& arg) {
  detail::check_floating(op, arg);
  TESSERA_CHECK(arg.tensor.ndim() >= 1, op, ": '", arg.name,
                "' must have at least one dimension (rows × D), got a scalar");
  TESSERA_CHECK(detail::last_dim(arg.tensor) >= 1, op, ": '", arg.name, "' has shape ", arg.tensor.shape().to_string(),
                "; its last dimension must not be 0");
}

// A [D] parameter (weight, bias or their gradients) with the dtype of `dtype_of`.
void check_parameter(std::string_view op, const detail::Arg& arg, const detail::Arg& dtype_of, int64_t d) {
  detail::check_floating(op, arg);
  detail::check_same_dtype(op, dtype_of, arg);
  detail::check_shape(op, arg, Shape{d});
}

// Logits of width `width` as the columns [vocab_begin, vocab_begin + width) of a
// vocabulary of vocab_size (0: the width itself, the whole vocabulary).
void check_vocab_shard(std::string_view op, int64_t vocab_begin, int64_t width, int64_t vocab_size) {
  TESSERA_CHECK(vocab_begin >= 0, op, ": vocab_begin must be >= 0 (the shard's first vocabulary column), got ",
                vocab_begin);
  TESSERA_CHECK(vocab_size >= 0, op, ": vocab_size must be >= 0 (0: the logits' width), got ", vocab_size);
  const int64_t vocab = vocab_size == 0 ? width : vocab_size;
  TESSERA_CHECK(vocab_begin <= vocab && width <= vocab - vocab_begin, op, ": the logits' ", width,
                " columns from vocab_begin ", vocab_begin, " reach past vocab_size ", vocab,
                "; a shard must lie within the vocabulary");
}

void check_eps(std::string_view op, float eps) {
  TESSERA_CHECK(eps >= 0.0f, op, ": eps must be >= 0, got ", eps);
}

}  // namespace

void softmax_forward(const Tensor& x, Tensor& y) {
  constexpr std::string_view op = "softmax_forward";
  check_rows_input(op, {"x", x});
  check_like(op, {"y", y}, {"x", x});
  detail::check_same_device(op, {{"x", x}, {"y", y}});
  backend_for(x, "softmax_forward").softmax_forward(x, y);
}

void softmax_backward(const Tensor& y, const Tensor& grad_y, Tensor& grad_x) {
  constexpr std::string_view op = "softmax_backward";
  check_rows_input(op, {"y", y});
  check_like(op, {"grad_y", grad_y}, {"y", y});
  check_like(op, {"grad_x", grad_x}, {"y", y});
  detail::check_same_device(op, {{"y", y}, {"grad_y", grad_y}, {"grad_x", grad_x}});
  backend_for(y, "softmax_backward").softmax_backward(y, grad_y, grad_x);
}

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp,
                           int64_t ignore_index) {
  constexpr std::string_view op = "cross_entropy_forward";
  check_rows_input(op, {"logits", logits});
  const int64_t n = detail::rows(logits);
  detail::check_index(op, {"targets", targets});
  detail::check_numel(op, {"targets", targets}, n);
  check_per_row(op, {"losses", losses}, n);
  check_per_row(op, {"logsumexp", logsumexp}, n);
  detail::check_same_device(op,
                            {{"logits", logits}, {"targets", targets}, {"losses", losses}, {"logsumexp", logsumexp}});
  backend_for(logits, "cross_entropy_forward").cross_entropy_forward(logits, targets, losses, logsumexp, ignore_index);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& logsumexp, const Tensor& targets,
                            const Tensor& grad_losses, Tensor& grad_logits, int64_t ignore_index, int64_t vocab_begin,
                            int64_t vocab_size) {
  constexpr std::string_view op = "cross_entropy_backward";
  check_rows_input(op, {"logits", logits});
  const int64_t n = detail::rows(logits), width = detail::last_dim(logits);
  check_per_row(op, {"logsumexp", logsumexp}, n);
  detail::check_index(op, {"targets", targets});
  detail::check_numel(op, {"targets", targets}, n);
  check_per_row(op, {"grad_losses", grad_losses}, n);
  check_like(op, {"grad_logits", grad_logits}, {"logits", logits});
  check_vocab_shard(op, vocab_begin, width, vocab_size);
  detail::check_same_device(op, {{"logits", logits},
                                 {"logsumexp", logsumexp},
                                 {"targets", targets},
                                 {"grad_losses", grad_losses},
                                 {"grad_logits", grad_logits}});
  backend_for(logits, "cross_entropy_backward")
      .cross_entropy_backward(logits, logsumexp, targets, grad_losses, grad_logits, ignore_index, vocab_begin,
                              vocab_size == 0 ? width : vocab_size);
}

void cross_entropy_shard_max(const Tensor& logits, Tensor& row_max) {
  constexpr std::string_view op = "cross_entropy_shard_max";
  check_rows_input(op, {"logits", logits});
  check_per_row(op, {"row_max", row_max}, detail::rows(logits));
  detail::check_same_device(op, {{"logits", logits}, {"row_max", row_max}});
  backend_for(logits, "cross_entropy_shard_max").cross_entropy_shard_max(logits, row_max);
}

void cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets, const Tensor& row_max, int64_t vocab_begin,
                              Tensor& sums, int64_t ignore_index) {
  constexpr std::string_view op = "cross_entropy_shard_sums";
  check_rows_input(op, {"logits", logits});
  const int64_t n = detail::rows(logits);
  detail::check_index(op, {"targets", targets});
  detail::check_numel(op, {"targets", targets}, n);
  check_per_row(op, {"row_max", row_max}, n);
  detail::check_dtype(op, {"sums", sums}, DType::f32);
  detail::check_shape(op, {"sums", sums}, Shape{2, n});
  TESSERA_CHECK(vocab_begin >= 0, op, ": vocab_begin must be >= 0 (the shard's first vocabulary column), got ",
                vocab_begin);
  detail::check_same_device(op, {{"logits", logits}, {"targets", targets}, {"row_max", row_max}, {"sums", sums}});
  backend_for(logits, "cross_entropy_shard_sums")
      .cross_entropy_shard_sums(logits, targets, row_max, vocab_begin, sums, ignore_index);
}

void cross_entropy_shard_finish(const Tensor& row_max, const Tensor& sums, const Tensor& targets, int64_t vocab_size,
                                Tensor& losses, Tensor& logsumexp, int64_t ignore_index) {
  constexpr std::string_view op = "cross_entropy_shard_finish";
  detail::check_index(op, {"targets", targets});
  const int64_t n = targets.numel();
  check_per_row(op, {"row_max", row_max}, n);
  detail::check_dtype(op, {"sums", sums}, DType::f32);
  detail::check_shape(op, {"sums", sums}, Shape{2, n});
  check_per_row(op, {"losses", losses}, n);
  check_per_row(op, {"logsumexp", logsumexp}, n);
  TESSERA_CHECK(vocab_size >= 1, op, ": vocab_size must be >= 1 (the whole vocabulary, every shard), got ", vocab_size);
  detail::check_same_device(
      op, {{"row_max", row_max}, {"sums", sums}, {"targets", targets}, {"losses", losses}, {"logsumexp", logsumexp}});
  backend_for(targets, "cross_entropy_shard_finish")
      .cross_entropy_shard_finish(row_max, sums, targets, vocab_size, losses, logsumexp, ignore_index);
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean, Tensor& rstd,
                       float eps) {
  constexpr std::string_view op = "layernorm_forward";
  check_rows_input(op, {"x", x});
  const int64_t d = detail::last_dim(x), rows = detail::rows(x);
  check_parameter(op, {"weight", weight}, {"x", x}, d);
  if (bias.defined()) check_parameter(op, {"bias", bias}, {"x", x}, d);
  check_like(op, {"y", y}, {"x", x});
  check_per_row(op, {"mean", mean}, rows);
  check_per_row(op, {"rstd", rstd}, rows);
  check_eps(op, eps);
  detail::check_same_device(op,
                            {{"x", x}, {"weight", weight}, {"bias", bias}, {"y", y}, {"mean", mean}, {"rstd", rstd}});
  backend_for(x, "layernorm_forward").layernorm_forward(x, weight, bias, y, mean, rstd, eps);
}

void layernorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias, bool accumulate) {
  constexpr std::string_view op = "layernorm_backward";
  check_rows_input(op, {"x", x});
  const int64_t d = detail::last_dim(x), rows = detail::rows(x);
  check_like(op, {"grad_y", grad_y}, {"x", x});
  check_parameter(op, {"weight", weight}, {"x", x}, d);
  check_per_row(op, {"mean", mean}, rows);
  check_per_row(op, {"rstd", rstd}, rows);
  check_like(op, {"grad_x", grad_x}, {"x", x});
  check_parameter(op, {"grad_weight", grad_weight}, {"weight", weight}, d);
  const Tensor no_bias;
  const Tensor& grad_bias_arg = grad_bias ? *grad_bias : no_bias;
  if (grad_bias) check_parameter(op, {"grad_bias", *grad_bias}, {"weight", weight}, d);
  detail::check_same_device(op, {{"grad_y", grad_y},
                                 {"x", x},
                                 {"weight", weight},
                                 {"mean", mean},
                                 {"rstd", rstd},
                                 {"grad_x", grad_x},
                                 {"grad_weight", grad_weight},
                                 {"grad_bias", grad_bias_arg}});
  backend_for(x, "layernorm_backward")
      .layernorm_backward(grad_y, x, weight, mean, rstd, grad_x, grad_weight, grad_bias, accumulate);
}

void rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps) {
  constexpr std::string_view op = "rmsnorm_forward";
  check_rows_input(op, {"x", x});
  const int64_t d = detail::last_dim(x), rows = detail::rows(x);
  check_parameter(op, {"weight", weight}, {"x", x}, d);
  check_like(op, {"y", y}, {"x", x});
  check_per_row(op, {"rstd", rstd}, rows);
  check_eps(op, eps);
  detail::check_same_device(op, {{"x", x}, {"weight", weight}, {"y", y}, {"rstd", rstd}});
  backend_for(x, "rmsnorm_forward").rmsnorm_forward(x, weight, y, rstd, eps);
}

void rmsnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& grad_x,
                      Tensor& grad_weight, bool accumulate) {
  constexpr std::string_view op = "rmsnorm_backward";
  check_rows_input(op, {"x", x});
  const int64_t d = detail::last_dim(x), rows = detail::rows(x);
  check_like(op, {"grad_y", grad_y}, {"x", x});
  check_parameter(op, {"weight", weight}, {"x", x}, d);
  check_per_row(op, {"rstd", rstd}, rows);
  check_like(op, {"grad_x", grad_x}, {"x", x});
  check_parameter(op, {"grad_weight", grad_weight}, {"weight", weight}, d);
  detail::check_same_device(op, {{"grad_y", grad_y},
                                 {"x", x},
                                 {"weight", weight},
                                 {"rstd", rstd},
                                 {"grad_x", grad_x},
                                 {"grad_weight", grad_weight}});
  backend_for(x, "rmsnorm_backward").rmsnorm_backward(grad_y, x, weight, rstd, grad_x, grad_weight, accumulate);
}

}  // namespace tessera::ops
