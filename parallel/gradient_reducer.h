// GradientReducer: one gradient group's part of a DataParallel replica (see
// data_parallel.h for the whole story): the parameters whose gradients are
// averaged over one communicator, their flat buffers and buckets, the
// reductions launched from their gradient hooks, ZeRO's pieces and
// pseudo-parameters over that communicator's ranks, and under ZeRO-2/3 their
// part of every sharding unit. It holds no optimizer: DataParallel builds one
// over every reducer's optimized() parameters, so a replica whose parameters
// are averaged over different groups (expert parallelism: dense parameters
// over dp, cp and ep, experts over dp and cp) keeps one optimizer, one step
// count and one set of checkpoint names.
//
// Every rank of the communicator must build its reducer with the same
// parameters (names and shapes, same order) and options, and drive it
// identically: then every collective below is issued in the same order on
// every rank without any extra agreement.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "nn/module.h"
#include "nn/parameter.h"
#include "parallel/communicator.h"
#include "parallel/data_parallel.h"  // the options, slices and statistics it shares with DataParallel

namespace tessera::parallel {

class GradientReducer {
 public:
  // Where an optimized parameter comes from: the model parameter and the first
  // element it covers (ZeRO: a flat range of the row-major flattening).
  struct Origin {
    const nn::Parameter* parameter = nullptr;
    int64_t begin = 0;
    bool flat_range = false;
  };

  // Re-points the parameters' gradients (and ZeRO-1/2 values) to views of
  // the flat buffers keeping their contents, installs the gradient hooks and,
  // under ZeRO, creates this rank's pieces. ZeRO-2/3: options.units lists the
  // model's units; each that holds parameters of this group becomes one of
  // this reducer's (those parameters only); the caller installs the module
  // hooks and forwards acquire()/release() for has_unit() modules.
  // `replicas`: the ranks whose samples make the global batch (the widest
  // group's size): an expert's gradient on its rank already sums every ep
  // rank's samples' contributions, so its group's average is scaled by
  // comm.size() / replicas to be the average over all of them.
  GradientReducer(std::vector<nn::Parameter*> parameters, Communicator& comm, const DataParallelOptions& options,
                  int replicas);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // What the optimizer updates for this group: the parameters themselves, or
  // under ZeRO this rank's pieces of them; and where each comes from.
  const std::vector<nn::Parameter*>& optimized() const { return optimized_; }
  const std::vector<Origin>& origins() const { return origins_; }

  void begin_step();
  void begin_micro_batch(bool last);
  // On the last micro-batch: launches every reduction backward left (call
  // finish_backward() of every reducer after every reducer's launch_rest()).
  void launch_rest();
  void finish_backward();
  bool reduced() const { return reduced_; }
  bool unsharded() const { return unsharded_; }
  // The buffer this rank's reduced gradients live in (for the norm's context and device).
  const Tensor& gradient_buffer() const { return shards_optimizer() ? shard_grads_ : flat_grads_; }
  // Sum of squares of this rank's reduced gradients that `counted` accepts
  // (plain: whole parameters, the same on every rank; ZeRO: this rank's pieces).
  double gradient_sum_squares(const std::function<bool(const nn::Parameter&)>& counted);
  void gather_values();
  void unshard_values();
  std::vector<OptimizerStateSlice> value_slices();
  std::string first_non_finite_gradient();
  bool holds(const nn::Parameter& parameter) const;
  bool reduced_after_backward(const nn::Parameter& parameter) const;

  // ZeRO-2/3: whether `module` is one of this reducer's units, and its hooks.
  bool has_unit(const nn::Module& module) const { return unit_index_.count(&module) > 0; }
  void acquire(nn::Module& module, nn::ParameterPhase phase);
  void release(nn::Module& module, nn::ParameterPhase phase) noexcept;

  Communicator& communicator() { return comm_; }
  int64_t flat_numel() const { return flat_numel_; }
  int bucket_count() const { return int(buckets_.size()); }
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  const ReductionStats& last_reduction() const { return stats_; }
  // "buckets=3 (25 MiB) flat=1.2M elements" / "units=4 (prefetch 1) flat=..."
  std::string describe() const;

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
  // ZeRO-2/3: one sharding unit's live state (its bucket holds its parameters of this group).
  struct Unit {
    nn::Module* module = nullptr;
    size_t bucket = 0;
    int holds = 0;             // acquires not yet released
    int64_t use_start_ns = 0;  // when the outermost acquire began
    nn::ParameterPhase phase = nn::ParameterPhase::forward;
    Tensor values;      // ZeRO-3: the gathered values (undefined when freed)
    CommHandle gather;  // ZeRO-3: the all-gather filling `values`, until seen complete
    int64_t gather_start_ns = 0;
    bool prefetched = false;         // gathered ahead and not used yet
    Tensor grads;                    // the whole f32 gradient, from backward's start to its reduction
    Tensor reduced;                  // where the reduce-scatter writes (a temporary when adding in)
    CommHandle reduction;            // in flight
    bool written_this_step = false;  // this rank's pieces hold a reduction of this step already
  };

  // Construction, in this order.
  void check_parameters() const;
  void lay_out_buckets();      // bucket_of_, offset_, buckets_, flat_numel_, deferred_
  void create_flat_buffers();  // flat gradients (not ZeRO-2/3), flat values (ZeRO-1/2); views
  void create_shards();        // ZeRO: the pieces and their pseudo-parameters (optimized_)

  void on_grad_ready(size_t index);
  // ZeRO-2/3 (gradient_reducer_units.cpp).
  void build_units();
  void assign_unit_buckets();  // after the layout: each unit's bucket
  Unit& unit_of(const nn::Module& module);
  void gather_unit(size_t unit);           // launches the all-gather of a freed unit's values
  void wait_gathered(size_t unit);         // until its values are there; points the parameters at them
  void free_values(size_t unit) noexcept;  // back to placeholders
  void prefetch_after(size_t unit, nn::ParameterPhase phase);
  void allocate_gradients(size_t unit);
  void prepare_gradients(size_t unit);  // its gradient buffer, after the previous reduction finished
  void launch_unit_reduction(size_t unit, bool in_backward);
  void finish_unit_reduction(size_t unit);
  void progress_units();  // polls; completes what is done
  void wait_reductions_above(int in_flight);
  void launch_held_units();
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
  float replica_share_ = 1.0f;     // comm_.size() / replicas: 1 for the widest group
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<bool> ready_;        // per parameter, this step
  std::vector<bool> deferred_;     // per parameter: reduced after backward (options_.reduced_after_backward)
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;  // buckets [0, next_launch_) are launched
  bool last_micro_batch_ = true;
  bool reduced_ = false;        // this step's gradients are averaged (finish_backward ran)
  bool rest_launched_ = false;  // launch_rest() ran this step
  int64_t flat_numel_ = 0;
  Tensor flat_grads_;                                         // [flat_numel_] f32
  Tensor flat_values_;                                        // ZeRO-1/2: [flat_numel_] model dtype
  Tensor shard_grads_;                                        // ZeRO: this rank's pieces of the gradients (f32)
  Tensor shard_values_;                                       // ZeRO-3: this rank's pieces of the values
  std::vector<int64_t> offset_;                               // per parameter: first element in the flat layout
  std::vector<Unit> units_;                                   // ZeRO-2/3, in parameter order
  std::vector<size_t> unit_of_parameter_;                     // ZeRO-2/3: per parameter
  std::unordered_map<const nn::Module*, size_t> unit_index_;  // ZeRO-2/3: module -> index into units_
  std::vector<size_t> reductions_in_flight_;                  // ZeRO-2/3: units, oldest first
  std::vector<size_t> prefetched_;                            // ZeRO-3: units gathered ahead, oldest first
  bool unsharded_ = false;                                    // ZeRO-3: unshard_values() ran
  std::vector<std::unique_ptr<nn::Parameter>> shards_;        // ZeRO pseudo-parameters
  struct ShardOrigin {
    size_t parameter = 0;  // index into parameters_
    int64_t begin = 0;     // first element of the parameter the shard covers
  };
  std::vector<ShardOrigin> shard_origins_;  // per shard
  std::vector<nn::Parameter*> optimized_;   // shards (ZeRO) or parameters_
  std::vector<Origin> origins_;             // per optimized_
  ReductionStats stats_;
};

}  // namespace tessera::parallel
