// GradientReducer's ZeRO-2/3 side (see data_parallel.h): the sharding units
// (each unit's parameters of this reducer's group) and their hooks. Before a
// unit runs, its values are gathered from every rank's pieces (ZeRO-3) and,
// for its backward, a gradient buffer is allocated; after it runs the values
// are freed; once backward has completed every gradient of the unit, the
// buffer is reduce-scattered into this rank's pieces and freed when that
// completes. The next unit is gathered ahead (prefetch) so its all-gather
// overlaps this unit's compute.
//
// Every rank of the group runs the same model code, so every rank acquires,
// prefetches, evicts and reduces the same units in the same order: the
// collectives below match without any extra agreement.
#include <algorithm>
#include <limits>

#include "core/allocator.h"
#include "core/context.h"
#include "kernels/ops.h"
#include "parallel/gradient_reducer.h"  // the class these functions belong to

namespace tessera::parallel {
namespace {

constexpr size_t kNone = std::numeric_limits<size_t>::max();

void erase_value(std::vector<size_t>& values, size_t value) {
  values.erase(std::remove(values.begin(), values.end(), value), values.end());
}

}  // namespace

void GradientReducer::build_units() {
  TESSERA_CHECK(!options_.units.empty(), "data parallel: --zero ", options_.zero_stage,
                " needs the model's sharding units (DataParallelOptions::units, e.g. nn::sharding_units(model))");
  std::unordered_map<const nn::Parameter*, size_t> index;
  for (size_t i = 0; i < parameters_.size(); ++i) index[parameters_[i]] = i;
  unit_of_parameter_.assign(parameters_.size(), kNone);
  // A unit may hold parameters of other groups (a block's experts): those are
  // their reducers'; a unit with none of this group's is not this reducer's.
  for (nn::Module* module : options_.units) {
    bool holds_any = false;
    for (nn::Parameter* p : module->parameters()) {
      const auto found = index.find(p);
      if (found == index.end()) continue;
      holds_any = true;
      TESSERA_CHECK(unit_of_parameter_[found->second] == kNone, "data parallel: parameter '", p->name,
                    "' is in two sharding units ('", units_[unit_of_parameter_[found->second]].module->name(),
                    "' and '", module->name(), "')");
      unit_of_parameter_[found->second] = units_.size();
    }
    if (!holds_any) continue;
    unit_index_.emplace(module, units_.size());
    units_.emplace_back();
    units_.back().module = module;
    units_.back().bucket = kNone;
  }
  for (size_t i = 0; i < parameters_.size(); ++i)
    TESSERA_CHECK(unit_of_parameter_[i] != kNone, "data parallel: parameter '", parameters_[i]->name,
                  "' is in no sharding unit; --zero ", options_.zero_stage,
                  " needs every parameter in one (nn::sharding_units of the model lists them)");
}

void GradientReducer::assign_unit_buckets() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Unit& unit = units_[unit_of_parameter_[buckets_[b].parameters.front()]];
    TESSERA_CHECK(unit.bucket == kNone, "data parallel: unit '", unit.module->name(),
                  "' holds a parameter reduced after backward (a tied embedding) and others; such a parameter ",
                  "must be a unit of its own");
    unit.bucket = b;
  }
}

GradientReducer::Unit& GradientReducer::unit_of(const nn::Module& module) {
  const auto found = unit_index_.find(&module);
  TESSERA_CHECK(found != unit_index_.end(), "data parallel: module '", module.name(), "' is not a sharding unit");
  return units_[found->second];
}

void GradientReducer::acquire(nn::Module& module, nn::ParameterPhase phase) {
  Unit& unit = unit_of(module);
  const size_t u = size_t(&unit - units_.data());
  if (phase == nn::ParameterPhase::weight_gradient) {  // the W step: a gradient buffer, no values
    prepare_gradients(u);
    progress_units();
    return;
  }
  if (unit.holds++ == 0) {
    unit.use_start_ns = now();
    unit.phase = phase;
  }
  if (phase == nn::ParameterPhase::backward) prepare_gradients(u);
  if (shards_values() && !unsharded_) {
    if (unit.prefetched) {
      unit.prefetched = false;
      erase_value(prefetched_, u);
    }
    if (!unit.values.defined()) gather_unit(u);
    wait_gathered(u);
    // The B step walks the units backward, as a one-call backward does.
    prefetch_after(u, phase == nn::ParameterPhase::input_gradient ? nn::ParameterPhase::backward : phase);
  }
  progress_units();
}

void GradientReducer::prepare_gradients(size_t u) {
  Unit& unit = units_[u];
  if (unit.reduction) finish_unit_reduction(u);  // the previous micro-batch's, still in flight
  if (!unit.grads.defined()) allocate_gradients(u);
}

void GradientReducer::release(nn::Module& module, nn::ParameterPhase phase) noexcept {
  const auto found = unit_index_.find(&module);
  if (found == unit_index_.end() || phase == nn::ParameterPhase::weight_gradient) return;
  const size_t u = found->second;
  Unit& unit = units_[u];
  if (--unit.holds > 0) return;
  if (shards_values() && !unsharded_) free_values(u);
  try {
    unit_event(phase == nn::ParameterPhase::forward ? "forward" : "backward", "compute", u, unit.use_start_ns, 0);
  } catch (const std::exception&) {
    // The trace callback failed; the use itself is over either way.
  }
}

void GradientReducer::gather_unit(size_t u) {
  Unit& unit = units_[u];
  const Bucket& bucket = buckets_[unit.bucket];
  {
    const MemoryUseScope use(MemoryUse::parameters);
    unit.values = shard_values_.context().empty(Shape{bucket.numel}, shard_values_.dtype(), shard_values_.device());
  }
  const Tensor send = shard_values_.slice(bucket.shard_begin, bucket.shard_begin + piece_numel(bucket));
  unit.gather_start_ns = now();
  unit.gather = comm_.all_gather(send, unit.values);
}

void GradientReducer::wait_gathered(size_t u) {
  Unit& unit = units_[u];
  const Bucket& bucket = buckets_[unit.bucket];
  if (unit.gather) {
    unit.gather->wait();
    unit.gather.reset();
    unit_event("all_gather", "comm", u, unit.gather_start_ns,
               piece_numel(bucket) * int64_t(unit.values.element_size()));
  }
  for (size_t k : bucket.parameters) {
    nn::Parameter& p = *parameters_[k];
    const int64_t at = offset_[k] - bucket.begin;
    p.value = unit.values.slice(at, at + p.value.numel()).view(p.value.shape());
  }
}

void GradientReducer::free_values(size_t u) noexcept {
  Unit& unit = units_[u];
  for (size_t k : buckets_[unit.bucket].parameters) {
    nn::Parameter& p = *parameters_[k];
    p.value = Tensor::placeholder(p.value.shape(), p.value.dtype());
  }
  unit.values = Tensor();
}

void GradientReducer::prefetch_after(size_t u, nn::ParameterPhase phase) {
  const bool forward = phase == nn::ParameterPhase::forward;
  for (int ahead = 1; ahead <= options_.prefetch; ++ahead) {
    if (!forward && u < size_t(ahead)) return;
    const size_t next = forward ? u + size_t(ahead) : u - size_t(ahead);
    if (next >= units_.size()) return;
    if (units_[next].values.defined()) continue;  // in use, or gathered ahead already
    // At the limit the oldest unit gathered ahead and still unused goes first.
    while (!prefetched_.empty() && int(prefetched_.size()) >= options_.prefetch) {
      const size_t oldest = prefetched_.front();
      prefetched_.erase(prefetched_.begin());
      units_[oldest].prefetched = false;
      wait_gathered(oldest);
      free_values(oldest);
    }
    gather_unit(next);
    units_[next].prefetched = true;
    prefetched_.push_back(next);
  }
}

void GradientReducer::allocate_gradients(size_t u) {
  wait_reductions_above(options_.prefetch);
  Unit& unit = units_[u];
  const Bucket& bucket = buckets_[unit.bucket];
  const Tensor& like = shard_grads_;
  {
    const MemoryUseScope use(MemoryUse::gradients);
    unit.grads = like.context().zeros(Shape{bucket.numel}, DType::f32, like.device());
  }
  for (size_t k : bucket.parameters) {
    nn::Parameter& p = *parameters_[k];
    const int64_t at = offset_[k] - bucket.begin;
    p.grad = unit.grads.slice(at, at + p.grad.numel()).view(p.grad.shape());
  }
}

void GradientReducer::launch_unit_reduction(size_t u, bool in_backward) {
  Unit& unit = units_[u];
  Bucket& bucket = buckets_[unit.bucket];
  TESSERA_CHECK(unit.grads.defined() && !unit.reduction, "data parallel: unit '", unit.module->name(),
                "' completed its gradients without a backward holding them (a backward outside the unit's calls?)");
  const int64_t piece = piece_numel(bucket);
  Tensor shard = shard_grads_.slice(bucket.shard_begin, bucket.shard_begin + piece);
  if (unit.written_this_step) {  // a later micro-batch: reduce into a temporary, then add
    const MemoryUseScope use(MemoryUse::gradients);
    unit.reduced = shard.context().empty(Shape{piece}, DType::f32, shard.device());
  } else {
    unit.reduced = shard;
  }
  unit.written_this_step = true;
  bucket.start_ns = now();
  bucket.in_backward = in_backward;
  if (stats_.buckets == 0) stats_.first_launch_ns = bucket.start_ns;
  ++stats_.buckets;
  if (in_backward) ++stats_.launched_in_backward;
  unit.reduction = comm_.reduce_scatter(unit.grads, unit.reduced, ReduceOp::avg);
  bucket.ready = 0;
  for (size_t k : bucket.parameters) ready_[k] = false;
  reductions_in_flight_.push_back(u);
}

void GradientReducer::finish_unit_reduction(size_t u) {
  Unit& unit = units_[u];
  Bucket& bucket = buckets_[unit.bucket];
  unit.reduction->wait();
  unit.reduction.reset();
  erase_value(reductions_in_flight_, u);
  if (!unit.reduced.shares_storage_with(shard_grads_)) {
    Tensor shard = shard_grads_.slice(bucket.shard_begin, bucket.shard_begin + piece_numel(bucket));
    ops::axpy(replica_share_, unit.reduced, shard);
  } else if (replica_share_ != 1.0f) {
    ops::scale_(unit.reduced, replica_share_);
  }
  unit_event("reduce_scatter", "comm", u, bucket.start_ns, bucket.numel * 4, bucket.in_backward);
  for (size_t k : bucket.parameters) {
    nn::Parameter& p = *parameters_[k];
    p.grad = Tensor::placeholder(p.grad.shape(), DType::f32);
  }
  unit.grads = Tensor();
  unit.reduced = Tensor();
}

void GradientReducer::progress_units() {
  comm_.poll();
  ++stats_.hook_polls;
  for (const size_t u : std::vector<size_t>(reductions_in_flight_))
    if (units_[u].reduction->test()) finish_unit_reduction(u);
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    if (unit.gather && unit.gather->test()) {
      unit.gather.reset();
      unit_event("all_gather", "comm", u, unit.gather_start_ns,
                 piece_numel(buckets_[unit.bucket]) * int64_t(unit.values.element_size()));
    }
  }
}

void GradientReducer::wait_reductions_above(int in_flight) {
  progress_units();
  while (int(reductions_in_flight_.size()) > in_flight) finish_unit_reduction(reductions_in_flight_.front());
}

void GradientReducer::launch_held_units() {
  // What backward left: units reduced after backward (the tied embedding) and
  // any whose gradients are still held, in bucket order on every rank.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const size_t u = unit_of_parameter_[buckets_[b].parameters.front()];
    if (units_[u].grads.defined() && !units_[u].reduction) launch_unit_reduction(u, false);
  }
}

void GradientReducer::finish_units_backward() {
  while (!reductions_in_flight_.empty()) finish_unit_reduction(reductions_in_flight_.front());
  // Units gathered ahead and not used: the step is about to change their values.
  for (const size_t u : prefetched_) {
    units_[u].prefetched = false;
    wait_gathered(u);
    free_values(u);
  }
  prefetched_.clear();
  stats_.reduction_end_ns = now();
  reduced_ = true;
}

void GradientReducer::unshard_values() {
  if (!shards_values() || unsharded_) return;
  for (const size_t u : prefetched_) {
    units_[u].prefetched = false;
    wait_gathered(u);
    free_values(u);
  }
  prefetched_.clear();
  const MemoryUseScope use(MemoryUse::parameters);
  for (size_t u = 0; u < units_.size(); ++u) {
    TESSERA_CHECK(units_[u].holds == 0, "data parallel: unshard_values() while unit '", units_[u].module->name(),
                  "' is in use");
    gather_unit(u);
    wait_gathered(u);
    for (size_t k : buckets_[units_[u].bucket].parameters) parameters_[k]->value = parameters_[k]->value.clone();
    units_[u].values = Tensor();
  }
  unsharded_ = true;
}

void GradientReducer::unit_event(const char* name, const char* category, size_t u, int64_t start, int64_t bytes,
                                 bool in_backward) {
  if (!options_.on_event) return;
  CommEvent event;
  event.launched_in_backward = in_backward;
  event.name = name;
  event.category = category;
  event.unit = true;
  event.bucket = int(u);
  event.bytes = bytes;
  event.start_ns = start;
  event.end_ns = now();
  options_.on_event(event);
}

}  // namespace tessera::parallel
