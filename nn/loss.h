// Losses for training and counts for evaluation: cross-entropy over logits
// with an ignore index (mean over the counted targets, backward written in
// place into the logits), and top-1 accuracy counting for classifiers.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/tensor.h"
#include "nn/module.h"

namespace tessera::nn {

struct LossValue {
  double loss = 0.0;  // mean over the counted (non-ignored) targets; 0 when none is counted
  int64_t count = 0;  // targets counted
};

// The mean of per-row losses [N] (f32, 0 on ignored rows) over the targets
// that are not ignore_index: one sum on the device, the count from a host
// copy of the targets.
LossValue mean_loss(const Tensor& losses, const Tensor& targets, int64_t ignore_index);

// The end of a cross-entropy forward (CrossEntropyLoss, and the
// vocabulary-parallel one of parallel/tensor_parallel.h): the mean of the
// rows' losses [N] (mean_loss), keeping the rows' logsumexp [N] f32 and the
// count in `saved` for cross_entropy_backward_in_place.
LossValue finish_cross_entropy_forward(const Tensor& losses, const Tensor& logsumexp, const Tensor& targets,
                                       int64_t ignore_index, Saved& saved);
// Their backward: overwrites logits [N, Vl] or [..., Vl] with
// d(scale·mean loss)/d(logits) from what the forward kept (ignored rows get
// zero). The logits are the columns [vocab_begin, vocab_begin + Vl) of a
// vocabulary of vocab_size (0: the logits' width; see
// ops::cross_entropy_backward). `loss` names the loss in errors.
void cross_entropy_backward_in_place(Tensor& logits, const Tensor& targets, float scale, Saved& saved,
                                     int64_t ignore_index, std::string_view loss, int64_t vocab_begin = 0,
                                     int64_t vocab_size = 0);

// What the trainer trains against: a loss over a model's output and the
// targets, forward then backward in place on the output (so the biggest
// activation, the logits, is never held twice).
class Loss {
 public:
  virtual ~Loss() = default;
  virtual LossValue forward(const Tensor& logits, const Tensor& targets, Saved& saved) const = 0;
  // Overwrites `logits` with d(scale·loss)/d(logits).
  virtual void backward(Tensor& logits, const Tensor& targets, float scale, Saved& saved) const = 0;
};

// Cross-entropy of logits [N, V] or [B, T, V] (f32, bf16 or f16) against
// targets [N] or [B, T] (i32/i64, same device). The log-softmax is fused and
// computed in f32; per-row losses are summed in f32 and returned as a double.
// The count is read from the targets on the host (one small copy; the loss
// value is read back anyway). A target outside [0, V) that is not
// ignore_index gives a NaN loss.
class CrossEntropyLoss : public Loss {
 public:
  explicit CrossEntropyLoss(int64_t ignore_index = -100) : ignore_index_(ignore_index) {}

  // Keeps the per-row logsumexp and the count in `saved` for backward.
  LossValue forward(const Tensor& logits, const Tensor& targets, Saved& saved) const override;
  // Overwrites `logits` with d(scale·loss)/d(logits), loss being the mean that
  // forward returned (scale: 1/num_micro_batches, times the loss scale under
  // mixed precision). Ignored rows get zero gradient.
  void backward(Tensor& logits, const Tensor& targets, float scale, Saved& saved) const override;

  int64_t ignore_index() const { return ignore_index_; }

 private:
  int64_t ignore_index_;
};

// Number of rows whose argmax over the last dimension (the first maximum on a
// tie) equals the target, skipping ignore_index targets. logits [N, C] or
// [..., C]; targets [N] or [...] i32/i64. For evaluation: a host loop over a
// host copy of the logits (classifier logits are small).
int64_t count_correct(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);

}  // namespace tessera::nn
