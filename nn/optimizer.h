// Optimizer: AdamW or SGD over a model's parameters, one fused operator call
// (ops::adamw_step / ops::sgd_step) per parameter buffer per step. It owns the
// f32 state (AdamW's exp_avg/exp_avg_sq, SGD's momentum buffer) and, for
// parameters stored in bf16/f16, an f32 master copy that the step updates and
// rounds back into the parameter's value. Also the global gradient norm and
// the clipping coefficient, which fold into the step's grad_scale.
//
// One training step (the trainer's recipe, with GradScaler from grad_scaler.h):
//   const float loss_scale = scaler.scale();              // before update(), which may change it
//   const GradNorm norm = global_grad_norm(params);       // of the loss-scaled grads; one host sync
//   if (!scaler.update(!norm.finite)) {                    // fp16 overflow: back off and skip
//     const float coef = clip_coefficient(norm.norm / loss_scale, max_norm);
//     optimizer.step(schedule.lr(optimizer.step_count()), coef / loss_scale);
//   }
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "nn/parameter.h"

namespace tessera::nn {

enum class OptimizerKind { sgd, adamw };

// Parses "sgd" / "adamw" (the --optimizer flag); throws naming the flag otherwise.
OptimizerKind parse_optimizer_kind(const std::string& name);
const char* optimizer_kind_name(OptimizerKind kind);

// The learning rate, AdamW's betas and ε and the weight decay are doubles,
// as PyTorch's optimizers (and Megatron-LM's arguments) hold them: AdamW
// computes each step's bias corrections 1 − β^step from them in double.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adamw;
  double lr = 1e-3;  // the peak learning rate; step() takes the scheduled one
  // SGD (PyTorch's torch.optim.SGD rules)
  float momentum = 0.0f;
  float dampening = 0.0f;
  bool nesterov = false;
  // AdamW (torch.optim.AdamW rules)
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // AdamW: decoupled (param ·= 1 − lr·wd); SGD: L2 added to the gradient.
  // Applied only to parameters with Parameter::weight_decay set.
  double weight_decay = 0.0;
};

// Throws tessera::Error naming the flag (--lr, --sgd-momentum, --dampening,
// --nesterov, --adam-beta1, --adam-beta2, --adam-eps, --weight-decay) and the value.
void validate(const OptimizerConfig& config);

class Optimizer {
 public:
  // Validates the config and every parameter (defined value and f32 grad of
  // the same size, unique names), allocates the zeroed state on each
  // parameter's device, and initialises masters from non-f32 values.
  // The parameters must outlive the optimizer.
  Optimizer(std::vector<Parameter*> parameters, const OptimizerConfig& config);

  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  Optimizer(Optimizer&&) = default;
  Optimizer& operator=(Optimizer&&) = default;

  // One update of every parameter with learning rate `lr` (≥ 0, finite: the
  // schedule's value) and gradients multiplied by `grad_scale` first (1 /
  // loss scale × clip coefficient). Increments step() before the update, so
  // AdamW's bias correction uses 1 on the first call. Does not zero grads.
  void step(double lr, float grad_scale = 1.0f);

  // Steps taken so far (0 before the first). set_step restores it from a checkpoint.
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t step);

  // Every state buffer, for checkpoints, in parameter order:
  //   "<name>.exp_avg", "<name>.exp_avg_sq" (AdamW), "<name>.momentum_buffer"
  //   (SGD with momentum), "<name>.master" (non-f32 parameters only); all f32,
  //   the parameter's shape. Loading copies into the pointed-to tensors
  //   (Tensor::copy_); after loading masters, call values_from_masters().
  std::vector<std::pair<std::string, Tensor*>> state_tensors();

  // Rounds every master into its parameter's value (after a checkpoint load).
  void values_from_masters();
  // Re-reads every master from its parameter's value (after loading weights
  // without optimizer state, e.g. fine-tuning from a model-only checkpoint).
  void masters_from_values();

  const OptimizerConfig& config() const { return config_; }
  const std::vector<Parameter*>& parameters() const { return parameters_; }

 private:
  struct State {
    Tensor exp_avg, exp_avg_sq;  // AdamW
    Tensor momentum_buffer;      // SGD with momentum > 0
    Tensor master;               // non-f32 parameters; undefined otherwise
  };
  std::vector<Parameter*> parameters_;
  std::vector<State> states_;
  OptimizerConfig config_;
  int64_t step_ = 0;
};

// Global L2 norm of all gradients: √(Σ_p Σ_i grad_p[i]²).
struct GradNorm {
  double norm = 0.0;
  bool finite = true;  // false if any gradient holds an inf or NaN (fp16 overflow)
};

// Σ_p sum_squares(grad_p) as a one-element f32 tensor on the parameters'
// device, with no host synchronisation (for an all-reduce before the square
// root under tensor/pipeline parallelism). The list must not be empty and
// every gradient must live on one device.
Tensor grad_sum_squares(const std::vector<Parameter*>& parameters);
// √ of the above, read back with one host synchronisation (0 for an empty list).
GradNorm global_grad_norm(const std::vector<Parameter*>& parameters);
// The factor gradients are multiplied by to clip their global norm to
// max_norm: min(1, max_norm / (norm + 1e-6)); 1 when max_norm ≤ 0 (clipping off)
// or when norm is not finite (such steps are the scaler's to skip).
float clip_coefficient(double norm, double max_norm);

}  // namespace tessera::nn
