// DataParallel: one model replicated on the ranks of a data-parallel
// communicator (or of one per gradient group), its gradients averaged over
// them with communication that overlaps backward, and the optimizer step
// (plain, or ZeRO-1 with the optimizer state sharded over the ranks).
//
// Gradients live in one flat f32 buffer: every Parameter::grad becomes a view
// of it. The buffer is laid out in reverse parameter order (the order backward
// finishes gradients) and split into buckets of whole parameters of about
// bucket_size_mb MiB. Each parameter's on_grad_ready hook counts it in; when
// the last parameter of a bucket is ready on the last micro-batch of a step,
// the bucket's asynchronous average starts (buckets are launched strictly in
// bucket order so every rank issues the same collectives in the same order),
// and the hook polls the communicator so MPI makes progress while the rest of
// backward runs. finish_backward() launches whatever is left and waits.
//
// ZeRO-1 (zero_stage 1): the parameters' values also live in one flat buffer
// (model dtype, same layout). Every bucket is padded to a multiple of the
// number of ranks and split into as many equal pieces; rank r owns piece r of
// every bucket. Gradients are reduce-scattered (average) per bucket, so ZeRO-1
// overlaps backward exactly like plain DP; each rank's Optimizer covers only
// its pieces, through "shard" pseudo-parameters ("<name>.shard<r>": value and
// gradient are views of the parameter's intersection with the rank's piece,
// weight_decay kept), so optimizer state (and f32 masters) take 1/dp of the
// memory; after the update each bucket's parameter values are all-gathered.
//
// ZeRO-2 and ZeRO-3 (zero_stage 2, 3; data_parallel_units.cpp) work per
// sharding unit (DataParallelOptions::units: a GPT block, an embedding, a
// layer), one bucket per unit, padded and split in pieces like ZeRO-1:
//   - ZeRO-2: no flat gradient buffer. A unit's f32 gradient buffer exists
//     from its backward's start (the unit's ParameterHooks::acquire) until its
//     reduce-scatter completes; each rank keeps only its pieces
//     (shard_grads_). Parameter values stay whole (a flat buffer as ZeRO-1,
//     all-gathered after the step).
//   - ZeRO-3 (FSDP): values live only as each rank's pieces (shard_values_,
//     which the optimizer updates in place). A unit's values are all-gathered
//     into a buffer of their own before its forward or backward and freed
//     after it (Parameter::value is a placeholder in between); the next
//     `prefetch` units in the direction of travel are gathered ahead, so
//     their all-gathers run beside this unit's compute.
// Under gradient accumulation ZeRO-2/3 reduce-scatter every micro-batch's
// gradients as its backward completes a unit (adding into the owned pieces):
// holding the whole gradient until the last micro-batch would need the full
// f32 gradient buffer that these stages exist to avoid (DeepSpeed does the
// same). It costs one reduce-scatter per unit per micro-batch instead of per
// step. A parameter reduced after backward (the pipeline's tied embedding)
// keeps its unit's gradient buffer across the step and is reduced once.
//
// Gradient groups (expert parallelism): a replica whose parameters are
// averaged over different groups (parallel::gradient_groups: dense ones over
// dp, cp and ep, experts over dp and cp) holds one GradientReducer
// (gradient_reducer.h) per group: everything above (flat buffers, buckets,
// ZeRO's pieces and units) exists per group, over that group's communicator;
// a sharding unit holding both kinds is one unit in each. One optimizer over
// every group's parameters or pieces. Every rank runs the same model code,
// so every group's collectives come in the same order on all of its ranks.
//
// One optimizer step:
//   dp.begin_step();                                 // zeroes the flat gradients
//   for (micro = 0; micro < accumulation; ++micro) {
//     dp.begin_micro_batch(micro + 1 == accumulation);  // only the last one reduces
//     ... forward, loss backward, model.backward(...) ...
//     dp.finish_backward();                          // no-op except on the last micro-batch
//   }
//   const nn::GradNorm norm = dp.grad_norm();        // global over ranks, same on every rank
//   if (norm.finite) dp.step(lr, clip_coefficient(norm.norm, max_norm));
//
// Nothing here reads io/: communication events reach a trace through the
// `on_event` callback, timed by `clock` (the trainer passes its TraceWriter's).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "nn/module.h"
#include "nn/optimizer.h"
#include "nn/parameter.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"

namespace tessera::parallel {

// One bucket's communication: launched at start_ns, seen complete at end_ns
// (the first poll, test or wait that found it done). Under ZeRO-2/3 also each
// unit's forward and backward (category "compute": from the unit's acquire
// to its release), and `bucket` is the unit's index (unit = true).
struct CommEvent {
  std::string name;  // "all_reduce", "reduce_scatter", "all_gather"; "forward", "backward"
  std::string category = "comm";
  bool unit = false;  // ZeRO-2/3: `bucket` is a sharding unit's index (parameter order)
  int bucket = 0;
  int64_t bytes = 0;  // this rank's contribution (the input)
  int64_t start_ns = 0, end_ns = 0;
  bool launched_in_backward = false;  // from a gradient hook, before finish_backward()
};

struct DataParallelOptions {
  double bucket_size_mb = 25.0;  // --bucket-size-mb: MiB of f32 gradients per bucket (≥ one parameter)
  int zero_stage = 0;            // --zero: 0 plain DP; 1 optimizer state, 2 + gradients, 3 + parameters sharded
  // ZeRO-2/3: the modules whose parameters are gathered, reduced and freed
  // together (nn::sharding_units of the model, or of each pipeline chunk),
  // in parameter order; together they must hold every parameter once. The
  // replica installs its ParameterHooks on them (and removes them when it goes).
  std::vector<nn::Module*> units{};
  // ZeRO-2/3 (--zero-prefetch): units gathered ahead of their use, and
  // gradient reductions left in flight while backward goes on, at most this
  // many. 0: nothing overlaps, least memory (one unit's values and gradients).
  int prefetch = 1;
  // Nanoseconds on the caller's timeline (e.g. TraceWriter::now_ns); empty:
  // the steady clock.
  std::function<int64_t()> clock{};
  // Called once per bucket communication when it completes (e.g. to write a
  // trace event); empty: nothing.
  std::function<void(const CommEvent&)> on_event{};
  // The group the model's split parameters are spread over (tensor
  // parallelism; null or size 1: none). grad_norm() then counts a split
  // parameter (Parameter::shard.split) on every rank of that group and a
  // replicated one once, and sums over the group, so the norm is the one
  // tp = 1 computes.
  Communicator* model_parallel = nullptr;
  // Which parameters this rank counts in the norm (empty: split ones always,
  // replicated ones on the model-parallel group's rank 0). Pipeline
  // parallelism passes its own rule (a tied copy counts nowhere).
  std::function<bool(const nn::Parameter&)> counts_in_norm{};
  // Parameters whose gradient backward does not complete (empty: none): a
  // tied embedding under pipeline parallelism, summed between the first and
  // last stage after the flush. They sit in buckets of their own after every
  // other, whose reductions still start during backward; theirs start in
  // finish_backward(), which the caller calls once their gradient is whole.
  std::function<bool(const nn::Parameter&)> reduced_after_backward{};
};

// Overlap evidence for the last step's gradient reduction, on `clock`.
struct ReductionStats {
  int buckets = 0;               // buckets reduced
  int launched_in_backward = 0;  // of them, launched from a gradient hook before finish_backward()
  int64_t first_launch_ns = 0;   // when the first bucket's reduction started
  int64_t backward_end_ns = 0;   // when finish_backward() was called (backward had ended)
  int64_t reduction_end_ns = 0;  // when the last bucket's reduction was complete
  int64_t hook_polls = 0;        // communicator polls made from gradient hooks
};

// Where one piece of this rank's optimizer state sits in a logical tensor
// (for checkpoints: the trainer turns these into io::TensorPiece; parallel/
// does not depend on io/).
struct OptimizerStateSlice {
  std::string name;  // "<parameter>.exp_avg", ".exp_avg_sq", ".momentum_buffer" or ".master" (f32)
  const nn::Parameter* parameter = nullptr;  // whose state it is (its shard says which part of the tensor)
  Shape shape;                               // this rank's parameter's shape (a tensor-parallel shard's, if split)
  Tensor* local = nullptr;                   // the optimizer's buffer (reading a checkpoint copies into it)
  // false: `local` is the whole tensor (plain data parallelism); true: it is
  // elements [begin, begin + local->numel()) of the row-major flattening
  // (a ZeRO shard: the parameter's intersection with this rank's pieces).
  bool flat_range = false;
  int64_t begin = 0;
  // Whether this rank is the one that writes it: every rank holds the same
  // replicated state, so rank 0 of the communicator writes it; each rank
  // writes its own shards.
  bool owner = true;
};

class GradientReducer;  // one gradient group's buckets, pieces and units (gradient_reducer.h)

class DataParallel : private nn::ParameterHooks {
 public:
  // Re-points every parameter's grad (and, for ZeRO-1/2, value) to views of
  // the flat buffers, keeping their current contents; installs the gradient
  // hooks; builds the optimizer (over all parameters, or over this rank's
  // shard). Parameters must outlive this object and share one device; with
  // ZeRO also one dtype per group. No communication here, but every rank of
  // a group must build one with the same parameters (names and shapes, same
  // order) and options.
  // One group: every gradient averaged over `comm`.
  DataParallel(std::vector<nn::Parameter*> parameters, Communicator& comm, const nn::OptimizerConfig& optimizer,
               DataParallelOptions options = {});
  // Several (parallel::gradient_groups): each group's gradients averaged, and
  // under ZeRO sharded, over its own communicator, with its own buckets,
  // pieces and units; one optimizer (one step count) over all of them.
  DataParallel(const GradientGroups& groups, const nn::OptimizerConfig& optimizer, DataParallelOptions options = {});
  // Removes the hooks (parameters keep their flat-buffer views).
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Zeroes the flat gradient buffer (the start of an optimizer step).
  void begin_step();
  // Before each micro-batch's backward: `last` says whether its gradients
  // complete the step (then buckets are reduced as they become ready).
  void begin_micro_batch(bool last);
  // After the micro-batch's backward: on the last micro-batch, launches every
  // bucket not launched yet and waits for all of them; no-op otherwise.
  void finish_backward();

  // The global L2 norm of the averaged gradients, identical on every rank,
  // and whether any rank saw an inf or NaN: each group's gradients counted
  // once per distinct copy (plain DP: by the group's rank 0, its gradients
  // being the same on all its ranks; ZeRO: each rank its pieces), summed over
  // the replicas (GradientGroups::replicas: an expert, different on each ep
  // rank, counts on each), then over the model-parallel group when there is
  // one. One small all-reduce each; one host synchronisation.
  nn::GradNorm grad_norm();
  // The optimizer update with the scheduled `lr` and gradients multiplied by
  // `grad_scale` (see nn::Optimizer::step); ZeRO-1/2 then all-gather the
  // updated values into every rank's parameters.
  void step(double lr, float grad_scale = 1.0f);

  nn::Optimizer& optimizer() { return *optimizer_; }
  // The widest group: the one every gradient is averaged over with one group.
  Communicator& communicator() { return *replicas_; }
  int zero_stage() const { return options_.zero_stage; }
  // Bytes of this rank's optimizer state (Optimizer::state_tensors: moments,
  // momentum, f32 masters).
  int64_t optimizer_state_bytes();
  // This rank's optimizer state as slices of the logical per-parameter
  // tensors, in optimizer order. Plain: the whole tensors (owner: rank 0 of
  // the parameter's group, so an expert is written by its ep rank).
  // ZeRO: one flat range per parameter that intersects this rank's pieces;
  // over the ranks they cover every element exactly once, so a checkpoint
  // written under one dp size and --zero setting reads back under any other.
  // After reading masters into them, call optimizer().values_from_masters()
  // and then gather_values() (ZeRO-1/2).
  std::vector<OptimizerStateSlice> optimizer_state_slices();
  // ZeRO-3: the parameter values as this rank's pieces (name: the
  // parameter's; flat ranges, each rank the owner of its own), which
  // checkpoints write and read in place of the (placeholder) values. Other
  // stages: empty (the values are whole in every parameter).
  std::vector<OptimizerStateSlice> value_slices();
  // ZeRO-1/2: all-gathers every rank's pieces of the parameter values (as
  // after a step), e.g. after values_from_masters() on a resumed run; plain
  // and ZeRO-3: nothing. Collective over each group.
  void gather_values();
  // ZeRO-3: gives every parameter its whole value again, each a tensor of its
  // own (as FSDP's full parameters: for tests, export and evaluation after
  // training; the replica takes no further steps). Collective; others: nothing.
  void unshard_values();
  // Elements of the flat buffers (padding included) and bucket count, over the groups.
  int64_t flat_numel() const;
  int bucket_count() const;
  // Whether `parameter` is one of this replica's and waits for finish_backward()
  // (DataParallelOptions::reduced_after_backward).
  bool reduced_after_backward(const nn::Parameter& parameter) const;
  // The first parameter whose reduced gradient (under ZeRO-2/3, this rank's
  // pieces of it) holds an inf or NaN, for the message of a run that stops
  // on non-finite gradients; empty if none on this rank.
  std::string first_non_finite_gradient();
  // The names of each bucket's parameters, in buffer order, group after group
  // (for tests and logs).
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  const ReductionStats& last_reduction() const { return stats_; }
  // One group: "dp=2 zero=1 buckets=3 (25 MiB) flat=1.2M elements, optimizer
  // state 4.8 MB"; several: "zero=1, gradients of dp+ep over 4 ranks:
  // buckets=..., of dp over 2 ranks: ..., optimizer state ...".
  std::string describe();

 private:
  void check_parameters(const GradientGroups& groups) const;
  void install_unit_hooks();
  void collect_origins();
  void combine_reduction_stats();
  void acquire(nn::Module& module, nn::ParameterPhase phase) override;
  void release(nn::Module& module, nn::ParameterPhase phase) noexcept override;
  bool reduced() const;

  DataParallelOptions options_;
  Communicator* replicas_ = nullptr;
  std::vector<std::unique_ptr<GradientReducer>> reducers_;  // one per group, in the groups' order
  std::vector<nn::Module*> hooked_units_;                   // ZeRO-2/3: the modules whose hooks are this
  std::unique_ptr<nn::Optimizer> optimizer_;
  struct StateOwner {
    const nn::Parameter* parameter = nullptr;
    int64_t begin = 0;
    bool flat_range = false, owner = true;
  };
  std::unordered_map<std::string, StateOwner> state_owners_;  // by optimized parameter name
  ReductionStats stats_;
};

// Checks --zero (0 to 3), --zero-prefetch (>= 0) and --bucket-size-mb (> 0);
// throws naming the flag.
void validate(const DataParallelOptions& options);

}  // namespace tessera::parallel
