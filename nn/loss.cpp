// CrossEntropyLoss over ops::cross_entropy_forward/backward, the forward's end
// and the backward it shares with the vocabulary-parallel loss
// (parallel/tensor_parallel.cpp), and accuracy counting on the host.
#include "nn/loss.h"

#include <vector>

#include "core/context.h"
#include "kernels/ops.h"

namespace tessera::nn {
namespace {

// logits as [N, V] and targets as [N], after checking they belong together.
void check_pair(const Tensor& logits, const Tensor& targets, std::string_view op) {
  TESSERA_CHECK(logits.defined() && targets.defined(), op, ": undefined logits or targets");
  TESSERA_CHECK(logits.ndim() >= 2, op, ": logits must be [N, V] or [B, T, V], got shape ", logits.shape().to_string());
  TESSERA_CHECK(targets.dtype() == DType::i32 || targets.dtype() == DType::i64, op,
                ": targets must be i32 or i64 class ids, got ", dtype_name(targets.dtype()));
  const int64_t rows = logits.numel() / logits.shape()[-1];
  TESSERA_CHECK(targets.numel() == rows, op, ": ", targets.numel(), " targets (shape ", targets.shape().to_string(),
                ") for ", rows, " rows of logits (shape ", logits.shape().to_string(), ")");
}

std::vector<int64_t> host_targets(const Tensor& targets) {
  if (targets.dtype() == DType::i64) return targets.to_vector<int64_t>();
  const std::vector<int32_t> values = targets.to_vector<int32_t>();
  return std::vector<int64_t>(values.begin(), values.end());
}

}  // namespace

LossValue mean_loss(const Tensor& losses, const Tensor& targets, int64_t ignore_index) {
  Tensor total = losses.context().empty(Shape{1}, DType::f32, losses.device());
  ops::sum(losses, total);
  LossValue value;
  for (const int64_t t : host_targets(targets))
    if (t != ignore_index) ++value.count;
  if (value.count > 0) value.loss = total.to_doubles()[0] / double(value.count);
  return value;
}

LossValue CrossEntropyLoss::forward(const Tensor& logits, const Tensor& targets, Saved& saved) const {
  check_pair(logits, targets, "cross-entropy loss");
  Context& ctx = logits.context();
  const int64_t vocab = logits.shape()[-1], rows = logits.numel() / vocab;
  const Tensor logits_2d = logits.view(Shape{rows, vocab});
  const Tensor targets_1d = targets.view(Shape{rows});
  Tensor losses = ctx.empty(Shape{rows}, DType::f32, logits.device());
  Tensor logsumexp = ctx.empty(Shape{rows}, DType::f32, logits.device());
  ops::cross_entropy_forward(logits_2d, targets_1d, losses, logsumexp, ignore_index_);
  return finish_cross_entropy_forward(losses, logsumexp, targets, ignore_index_, saved);
}

void CrossEntropyLoss::backward(Tensor& logits, const Tensor& targets, float scale, Saved& saved) const {
  check_pair(logits, targets, "cross-entropy loss backward");
  cross_entropy_backward_in_place(logits, targets, scale, saved, ignore_index_, "cross-entropy loss");
}

LossValue finish_cross_entropy_forward(const Tensor& losses, const Tensor& logsumexp, const Tensor& targets,
                                       int64_t ignore_index, Saved& saved) {
  const LossValue value = mean_loss(losses, targets, ignore_index);
  saved.clear();
  saved.tensors = {logsumexp};
  saved.scalars = {value.count};
  return value;
}

void cross_entropy_backward_in_place(Tensor& logits, const Tensor& targets, float scale, Saved& saved,
                                     int64_t ignore_index, std::string_view loss, int64_t vocab_begin,
                                     int64_t vocab_size) {
  TESSERA_CHECK(saved.tensors.size() == 1 && saved.scalars.size() == 1, loss,
                " backward: no matching forward (the Saved holds no logsumexp)");
  const Tensor logsumexp = saved.tensors[0];
  const int64_t count = saved.scalars[0];
  saved.clear();
  Context& ctx = logits.context();
  const int64_t width = logits.shape()[-1], rows = logits.numel() / width;
  // d(scale·mean)/d(loss_n) = scale/count for every counted row (the kernel zeroes ignored rows).
  Tensor grad_losses =
      ctx.full(Shape{rows}, DType::f32, count > 0 ? double(scale) / double(count) : 0.0, logits.device());
  Tensor logits_2d = logits.view(Shape{rows, width});
  ops::cross_entropy_backward(logits_2d, logsumexp, targets.view(Shape{rows}), grad_losses, logits_2d, ignore_index,
                              vocab_begin, vocab_size);
}

int64_t count_correct(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  check_pair(logits, targets, "count_correct");
  const int64_t classes = logits.shape()[-1], rows = logits.numel() / classes;
  const std::vector<double> values = logits.to_doubles();
  const std::vector<int64_t> labels = host_targets(targets);
  int64_t correct = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (labels[size_t(r)] == ignore_index) continue;
    const double* row = values.data() + r * classes;
    int64_t best = 0;
    for (int64_t c = 1; c < classes; ++c)
      if (row[c] > row[best]) best = c;
    if (best == labels[size_t(r)]) ++correct;
  }
  return correct;
}

}  // namespace tessera::nn
