// DataParallel: one model replicated on the ranks of a data-parallel
// communicator, its gradients averaged over them with communication that
// overlaps backward, and the optimizer step (plain, or ZeRO-1 with the
// optimizer state sharded over the ranks).
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

class DataParallel : private nn::ParameterHooks {
 public:
  // Re-points every parameter's grad (and, for ZeRO-1, value) to views of the
  // flat buffers, keeping their current contents; installs the gradient hooks;
  // builds the optimizer (over all parameters, or over this rank's shard).
  // Parameters must outlive this object and share one device; with ZeRO-1 also
  // one dtype. No communication here, but every rank of `comm` must build one
  // with the same parameters (names and shapes, same order) and options.
  DataParallel(std::vector<nn::Parameter*> parameters, Communicator& comm, const nn::OptimizerConfig& optimizer,
               DataParallelOptions options = {});
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

  // The global L2 norm of the averaged gradients, identical on every rank
  // (one small all-reduce: plain DP takes the max of the ranks' identical
  // sums, ZeRO-1 sums the shards' sums of squares; one more over the
  // model-parallel group when there is one), and whether any rank saw an
  // inf or NaN. One host synchronisation.
  nn::GradNorm grad_norm();
  // The optimizer update with the scheduled `lr` and gradients multiplied by
  // `grad_scale` (see nn::Optimizer::step); ZeRO-1 then all-gathers the
  // updated values into every rank's parameters.
  void step(double lr, float grad_scale = 1.0f);

  nn::Optimizer& optimizer() { return *optimizer_; }
  Communicator& communicator() { return comm_; }
  int zero_stage() const { return options_.zero_stage; }
  // Bytes of this rank's optimizer state (Optimizer::state_tensors: moments,
  // momentum, f32 masters).
  int64_t optimizer_state_bytes();
  // This rank's optimizer state as slices of the logical per-parameter
  // tensors, in optimizer order. Plain: the whole tensors (owner: rank 0).
  // ZeRO-1: one flat range per parameter that intersects this rank's pieces;
  // over the ranks they cover every element exactly once, so a checkpoint
  // written under one dp size and --zero setting reads back under any other.
  // After reading masters into them, call optimizer().values_from_masters()
  // and then gather_values() (ZeRO-1).
  std::vector<OptimizerStateSlice> optimizer_state_slices();
  // ZeRO-3: the parameter values as this rank's pieces (name: the
  // parameter's; flat ranges, each rank the owner of its own), which
  // checkpoints write and read in place of the (placeholder) values. Other
  // stages: empty (the values are whole in every parameter).
  std::vector<OptimizerStateSlice> value_slices();
  // ZeRO-1/2: all-gathers every rank's pieces of the parameter values (as
  // after a step), e.g. after values_from_masters() on a resumed run; plain
  // and ZeRO-3: nothing. Collective over the communicator.
  void gather_values();
  // ZeRO-3: gives every parameter its whole value again, each a tensor of its
  // own (as FSDP's full parameters: for tests, export and evaluation after
  // training; the replica takes no further steps). Collective; others: nothing.
  void unshard_values();
  // Elements of the flat buffers (padding included) and bucket count.
  int64_t flat_numel() const { return flat_numel_; }
  int bucket_count() const { return int(buckets_.size()); }
  // Whether `parameter` is one of this replica's and waits for finish_backward()
  // (DataParallelOptions::reduced_after_backward).
  bool reduced_after_backward(const nn::Parameter& parameter) const;
  // The first parameter whose reduced gradient (under ZeRO-2/3, this rank's
  // pieces of it) holds an inf or NaN, for the message of a run that stops
  // on non-finite gradients; empty if none on this rank.
  std::string first_non_finite_gradient();
  // The names of each bucket's parameters, in buffer order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  const ReductionStats& last_reduction() const { return stats_; }
  // "dp=2 zero=1 buckets=3 (25 MiB) flat=1.2M elements, optimizer state 4.8 MB"
  std::string describe();

 private:
  struct Bucket {
    std::vector<size_t> parameters;  // indices into parameters_, buffer order
    int64_t begin = 0, numel = 0;    // range of the flat buffers (padded for ZeRO)
    int64_t shard_begin = 0;         // ZeRO: this rank's piece in shard_grads_ / shard_values_
    int ready = 0;                   // parameters whose gradient is complete this step (ZeRO-2/3: micro-batch)
    bool launched = false, completed = false, in_backward = false;
    int64_t start_ns = 0;
    CommHandle handle;
  };
  // ZeRO-2/3: one sharding unit's live state (its bucket holds its parameters).
  struct Unit {
    nn::Module* module = nullptr;
    size_t bucket = 0;
    int holds = 0;                // acquires not yet released
    int64_t use_start_ns = 0;     // when the outermost acquire began
    nn::ParameterPhase phase = nn::ParameterPhase::forward;
    Tensor values;                // ZeRO-3: the gathered values (undefined when freed)
    CommHandle gather;            // ZeRO-3: the all-gather filling `values`, until seen complete
    int64_t gather_start_ns = 0;
    bool prefetched = false;      // gathered ahead and not used yet
    Tensor grads;                 // the whole f32 gradient, from backward's start to its reduction
    Tensor reduced;               // where the reduce-scatter writes (a temporary when adding in)
    CommHandle reduction;         // in flight
    bool written_this_step = false;  // this rank's pieces hold a reduction of this step already
  };

  // Construction, in this order.
  void check_parameters() const;
  void lay_out_buckets();               // bucket_of_, offset_, buckets_, flat_numel_, deferred_
  void create_flat_buffers();           // flat gradients (not ZeRO-2/3), flat values (ZeRO-1/2); views
  std::vector<nn::Parameter*> create_shards();  // ZeRO: the pieces and their pseudo-parameters, for the optimizer

  void on_grad_ready(size_t index);
  // ZeRO-2/3 (data_parallel_units.cpp).
  void build_units();
  void assign_unit_buckets();  // after the layout: each unit's bucket
  void acquire(nn::Module& module, nn::ParameterPhase phase) override;
  void release(nn::Module& module, nn::ParameterPhase phase) noexcept override;
  Unit& unit_of(const nn::Module& module);
  void gather_unit(size_t unit);           // launches the all-gather of a freed unit's values
  void wait_gathered(size_t unit);         // until its values are there; points the parameters at them
  void free_values(size_t unit) noexcept;  // back to placeholders
  void prefetch_after(size_t unit, nn::ParameterPhase phase);
  void allocate_gradients(size_t unit);
  void launch_unit_reduction(size_t unit, bool in_backward);
  void finish_unit_reduction(size_t unit);
  void progress_units();                   // polls; completes what is done
  void wait_reductions_above(int in_flight);
  void finish_units_backward();
  void unit_event(const char* name, const char* category, size_t unit, int64_t start, int64_t bytes,
                  bool in_backward = false);
  bool units_mode() const { return options_.zero_stage >= 2; }
  bool shards_values() const { return options_.zero_stage == 3; }
  bool shards_optimizer() const { return options_.zero_stage >= 1; }
  void launch(size_t bucket, bool in_backward);
  void launch_ready_in_order(bool in_backward);
  void check_completions();
  void complete(Bucket& bucket, size_t index);
  int64_t now() const;
  int64_t piece_numel(const Bucket& bucket) const { return bucket.numel / comm_.size(); }

  std::vector<nn::Parameter*> parameters_;
  Communicator& comm_;
  DataParallelOptions options_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<bool> ready_;        // per parameter, this step
  std::vector<bool> deferred_;     // per parameter: reduced after backward (options_.reduced_after_backward)
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;  // buckets [0, next_launch_) are launched
  bool last_micro_batch_ = true;
  bool reduced_ = false;  // this step's gradients are averaged (finish_backward ran)
  int64_t flat_numel_ = 0;
  Tensor flat_grads_;                                   // [flat_numel_] f32
  Tensor flat_values_;                                  // ZeRO-1: [flat_numel_] model dtype
  Tensor shard_grads_;                                  // ZeRO: this rank's pieces of the gradients (f32)
  Tensor shard_values_;                                 // ZeRO-3: this rank's pieces of the values
  std::vector<int64_t> offset_;                         // per parameter: first element in the flat layout
  std::vector<Unit> units_;                             // ZeRO-2/3, in parameter order
  std::vector<size_t> unit_of_parameter_;               // ZeRO-2/3: per parameter
  std::unordered_map<const nn::Module*, size_t> unit_index_;  // ZeRO-2/3: module -> index into units_
  std::vector<size_t> reductions_in_flight_;            // ZeRO-2/3: units, oldest first
  std::vector<size_t> prefetched_;                      // ZeRO-3: units gathered ahead, oldest first
  bool unsharded_ = false;                              // ZeRO-3: unshard_values() ran
  std::vector<std::unique_ptr<nn::Parameter>> shards_;  // ZeRO-1 pseudo-parameters
  struct ShardOrigin {
    size_t parameter = 0;  // index into parameters_
    int64_t begin = 0;     // first element of the parameter the shard covers
  };
  std::vector<ShardOrigin> shard_origins_;  // per shard
  std::unique_ptr<nn::Optimizer> optimizer_;
  ReductionStats stats_;
};

// Checks --zero (0 to 3), --zero-prefetch (>= 0) and --bucket-size-mb (> 0);
// throws naming the flag.
void validate(const DataParallelOptions& options);

}  // namespace tessera::parallel
