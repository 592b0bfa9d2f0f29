// `tessera plan`'s prediction of one training step of a language model (gpt,
// llama, with experts) under a layout on a cluster, and the search over
// layouts. What the step is made of, per rank of the busiest pipeline stage:
//
//   compute       per Transformer layer and micro-batch, forward: the GEMMs
//                 (qkv, projection, MLP, experts, router; plan/costs.h), the
//                 attention core (fused: causal half of 4·b·s²·h/t FLOPs, its
//                 backward 2.5×; unfused: both s×s products in full, and the
//                 scores' softmax and dropout through memory), the
//                 memory-bound kernels (norms, residual adds, activation,
//                 dropouts, rope; sharded by t under sequence parallelism);
//                 backward: B (input gradients: the same GEMMs again, the
//                 attention's backward, twice the memory-bound bytes) and W
//                 (weight gradients: the same GEMMs again); --recompute runs
//                 the forward again before B. The first chunk adds the
//                 embedding, the last the final norm, the head's GEMMs and
//                 the cross-entropy over f32 logits.
//   tp, cp, ep    inside each layer, not overlapped: tensor parallelism's
//                 all-reduces (or all-gathers and reduce-scatters under
//                 sequence parallelism) of b·s·h values, two per forward, two
//                 per backward; context parallelism's ring of K and V blocks
//                 beside the attention (only what outlasts it); the experts'
//                 dispatch and combine all-to-alls.
//   pipeline      the real schedule (parallel/pipeline_schedule.h) for P
//                 stages, M micro-batches and V chunks, simulated with these
//                 costs per model chunk (layers as parallel::partition_layers
//                 splits them) and the activations' send between stages: its
//                 span holds the bubble.
//   data parallel the gradients' reduction (f32, over the dp × cp ranks;
//                 experts over dp / ep) beside the last micro-batch's
//                 backward (what outlasts it is exposed); ZeRO-1/2 gather the
//                 values after the step, ZeRO-3 gathers them for every
//                 micro-batch's forward and backward beside the compute.
//   optimizer     the step's bytes (values, f32 master, moments, gradient)
//                 through memory, over the rank's share of the parameters.
//
// Memory of the fullest rank: the model state by parallel::predict_memory
// (the formula `tessera train --estimate-memory` prints and the tests hold
// against the allocator), plus activations: per layer and micro-batch the
// tensors its backward reads (Korthikanti et al. 2022's terms: 34·s·b·h +
// 5·a·s²·b bytes with 2-byte values and dropout, split by t under tensor
// and sequence parallelism, except the inputs of qkv and the MLP's first
// linear, which Tessera keeps whole (gathered) where Megatron gathers them
// again in backward; a fused attention keeps no s×s tensor; full
// recompute keeps only each layer's input, plus one layer's whole set while
// it runs backward), times the units in flight on the stage (the schedule's
// simulation), plus the last stage's f32 logits.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "nn/models.h"
#include "nn/optimizer.h"
#include "parallel/pipeline_schedule.h"
#include "plan/cluster.h"

namespace tessera::plan {

// How attention's core runs: Tessera's fused kernel (no s×s tensor in
// memory, masked blocks skipped), or as separate kernels over s×s scores
// (Megatron-LM of 2021: two batched GEMMs, the softmax and the dropout).
enum class AttentionKernel { fused, unfused };

struct PlanModel {
  nn::ModelConfig model;     // gpt or llama, with experts or without
  int64_t global_batch = 1;  // sequences per optimizer step
  DType dtype = DType::bf16;
  nn::OptimizerConfig optimizer;  // its kind and momentum decide the state's bytes
  AttentionKernel attention = AttentionKernel::fused;
  int64_t gradient_bytes = 4;  // per element of a gradient (Tessera: f32)
};

struct PlanLayout {
  int dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;  // ep divides dp (experts split over data ranks)
  int vpp = 1;                                 // model chunks per stage (interleaved 1F1B: > 1; zbv: 2)
  parallel::PipelineScheduleKind schedule = parallel::PipelineScheduleKind::one_f_one_b;
  int zero = 0;
  int64_t micro_batch = 1;
  bool recompute = false;
  bool sequence_parallel = false;
  int world() const { return dp * tp * pp * cp; }
  // "dp 32 tp 8 pp 2 vpp 2 1f1b zero 1 mbs 1 recompute sp"
  std::string describe() const;
  // The `tessera train` flags that run it ("--tp 8 --pp 2 ...").
  std::string flags() const;
};

struct StepTime {
  double compute = 0;           // the busiest stage's forwards and backwards, all micro-batches
  double tensor_parallel = 0;   // within compute's span: tp collectives
  double context_parallel = 0;  // exposed ring exchange
  double expert_parallel = 0;   // all-to-alls
  double pipeline_bubble = 0;   // the schedule's span minus the busiest stage's work
  double data_parallel = 0;     // exposed gradient reduction
  double zero = 0;              // exposed ZeRO gathers
  double optimizer = 0;
  double step = 0;  // the whole step
};

struct MemoryUse {
  int64_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, logits = 0;
  int stage = 0;  // the fullest
  int64_t total() const { return parameters + gradients + optimizer + activations + logits; }
};

struct Prediction {
  PlanLayout layout;
  StepTime time;
  MemoryUse memory;               // the fullest rank's
  std::vector<MemoryUse> stages;  // every pipeline stage's rank (stage 0 holds world rank 0)
  double model_flops = 0;         // one step, the whole model, without recompute (MFU's numerator)
  double hardware_flops = 0;      // what the accelerators compute (with recompute): TFLOP/s as Megatron-LM counts them
  double tokens_per_s = 0;
  double tflops_per_gpu = 0;  // hardware_flops / step / world
  double mfu = 0;             // model_flops / step / world / peak
  bool fits = false;
  bool simulated = false;  // the pipeline by the schedule's simulation, not its closed form
};

// Why `layout` cannot run `model` on `cluster` (its world, a size that does
// not divide, a schedule's rule), naming the flag; empty when it can.
std::string layout_problem(const PlanModel& model, const Cluster& cluster, const PlanLayout& layout);

// The step under `layout` (layout_problem must be empty). `simulate`: the
// pipeline by the schedule's simulator (exact for the schedule, slower for
// many micro-batches); otherwise its closed form.
Prediction predict(const PlanModel& model, const Cluster& cluster, const PlanLayout& layout, bool simulate = true);

// The share of the accelerator's memory a rank may fill (the rest: the
// runtime's context, communication buffers, fragmentation).
constexpr double kUsableMemory = 0.92;

// What the search may vary; a set field fixes that axis.
struct SearchLimits {
  std::optional<int> tp, pp, cp, ep, vpp, zero;
  std::optional<int64_t> micro_batch;
  std::optional<bool> recompute, sequence_parallel;
  std::optional<parallel::PipelineScheduleKind> schedule;
};

struct SearchResult {
  std::vector<Prediction> ranked;  // layouts that fit, fastest first (the first `simulated`)
  int64_t considered = 0, refused = 0, too_big = 0;
  std::vector<std::string> refusals;   // a few reasons layouts were refused (distinct)
  std::optional<Prediction> smallest;  // when nothing fits: the layout nearest to fitting
};

// Every layout of the cluster's world within `limits`, predicted by the
// closed form, those that fit ranked, the best `simulate_top` simulated and
// ranked again.
// `progress(done, total)` is called every 2,000 layouts when given.
SearchResult search_layouts(const PlanModel& model, const Cluster& cluster, const SearchLimits& limits,
                            int simulate_top = 24, const std::function<void(int64_t, int64_t)>& progress = {});

// FLOPs of one step of the whole model (forward and backward, 3× the forward;
// `recompute` adds a forward): per layer 2·(GEMM parameters)·tokens plus
// attention's 4·s·h per token (full s×s, as Megatron-LM counts), the head's
// 2·V·h per token.
double step_flops(const PlanModel& model, bool recompute);

// The ZeRO paper's model-state bytes per GPU (Rajbhandari et al. 2020,
// mixed-precision Adam): 2-byte values and gradients and K bytes of optimizer
// state per parameter, of which stage 1 shards the optimizer state over nd
// ranks, stage 2 also the gradients, stage 3 also the values. Tessera's own
// accounting (parallel::predict_memory, which the planner uses) keeps
// gradients in f32 and counts the buffers its reductions hold.
double zero_paper_model_state_bytes(double psi, int nd, int stage, double k);

}  // namespace tessera::plan
