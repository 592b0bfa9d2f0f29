// DataParallel (data_parallel.h): a replica over one GradientReducer per
// gradient group (one without expert parallelism), the optimizer over all of
// their parameters or pieces, the module hooks ZeRO-2/3 install on the
// sharding units (each unit's call passed to every group holding part of it,
// in group order on every rank), the global gradient norm over the groups,
// and the optimizer-state slices checkpoints write.
#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <sstream>

#include "core/context.h"
#include "parallel/gradient_reducer.h"

namespace tessera::parallel {

void validate(const DataParallelOptions& options) {
  TESSERA_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3, "--zero must be 0 (plain data parallelism), 1 ",
                "(optimizer state sharded over the data-parallel ranks), 2 (and gradients) or 3 (and parameters, ",
                "as FSDP), got ", options.zero_stage);
  TESSERA_CHECK(options.prefetch >= 0, "--zero-prefetch must be 0 (no overlap) or more units, got ", options.prefetch);
  TESSERA_CHECK(std::isfinite(options.bucket_size_mb) && options.bucket_size_mb > 0.0,
                "--bucket-size-mb must be a positive number of MiB, got ", options.bucket_size_mb);
}

DataParallel::DataParallel(std::vector<nn::Parameter*> parameters, Communicator& comm,
                           const nn::OptimizerConfig& optimizer, DataParallelOptions options)
    : DataParallel(GradientGroups{{GradientGroup{{"dp"}, &comm, std::move(parameters)}}, &comm}, optimizer,
                   std::move(options)) {}

DataParallel::DataParallel(const GradientGroups& groups, const nn::OptimizerConfig& optimizer,
                           DataParallelOptions options)
    : options_(std::move(options)), replicas_(groups.replicas) {
  validate(options_);
  check_parameters(groups);
  for (const GradientGroup& group : groups.groups)
    reducers_.push_back(
        std::make_unique<GradientReducer>(group.parameters, *group.communicator, options_, replicas_->size()));
  std::vector<nn::Parameter*> optimized;
  for (const auto& reducer : reducers_)
    optimized.insert(optimized.end(), reducer->optimized().begin(), reducer->optimized().end());
  optimizer_ = std::make_unique<nn::Optimizer>(optimized, optimizer);
  collect_origins();
  install_unit_hooks();
}

void DataParallel::check_parameters(const GradientGroups& groups) const {
  TESSERA_CHECK(!groups.groups.empty() && groups.replicas != nullptr,
                "data parallel: no gradient groups (parallel::gradient_groups makes them)");
  std::set<const nn::Parameter*> seen;
  for (const GradientGroup& group : groups.groups) {
    TESSERA_CHECK(group.communicator != nullptr, "data parallel: a gradient group has no communicator");
    for (const nn::Parameter* p : group.parameters)
      TESSERA_CHECK(p == nullptr || seen.insert(p).second, "data parallel: parameter '", p->name,
                    "' is passed twice (in two gradient groups, or twice in one)");
  }
}

void DataParallel::collect_origins() {
  // Each optimized parameter's model parameter; plain DP's whole tensors are
  // written by their group's rank 0, ZeRO's pieces by the rank holding them.
  for (const auto& reducer : reducers_) {
    const bool writes_replicated = reducer->communicator().rank() == 0;
    for (size_t i = 0; i < reducer->optimized().size(); ++i) {
      const GradientReducer::Origin& origin = reducer->origins()[i];
      state_owners_[reducer->optimized()[i]->name] =
          StateOwner{origin.parameter, origin.begin, origin.flat_range, origin.flat_range || writes_replicated};
    }
  }
}

void DataParallel::install_unit_hooks() {
  if (options_.zero_stage < 2) return;
  std::set<const nn::Module*> seen;
  for (nn::Module* module : options_.units) {
    TESSERA_CHECK(module != nullptr, "data parallel: a null sharding unit was passed");
    TESSERA_CHECK(seen.insert(module).second, "data parallel: unit '", module->name(), "' is passed twice");
    TESSERA_CHECK(module->parameter_hooks() == nullptr, "data parallel: unit '", module->name(),
                  "' already has parameter hooks; is the model wrapped by two DataParallel objects at once?");
    for (const nn::Parameter* p : module->parameters())
      TESSERA_CHECK(std::any_of(reducers_.begin(), reducers_.end(), [p](const auto& r) { return r->holds(*p); }),
                    "data parallel: unit '", module->name(), "' holds parameter '", p->name,
                    "', which is not one of the replica's parameters");
  }
  for (nn::Module* module : options_.units) {
    module->set_parameter_hooks(this);
    hooked_units_.push_back(module);
  }
}

DataParallel::~DataParallel() {
  for (nn::Module* module : hooked_units_)
    if (module->parameter_hooks() == this) module->set_parameter_hooks(nullptr);
}

void DataParallel::acquire(nn::Module& module, nn::ParameterPhase phase) {
  bool found = false;
  for (const auto& reducer : reducers_)
    if (reducer->has_unit(module)) {
      reducer->acquire(module, phase);
      found = true;
    }
  TESSERA_CHECK(found, "data parallel: module '", module.name(), "' is not a sharding unit");
}

void DataParallel::release(nn::Module& module, nn::ParameterPhase phase) noexcept {
  for (const auto& reducer : reducers_)
    if (reducer->has_unit(module)) reducer->release(module, phase);
}

void DataParallel::begin_step() {
  for (const auto& reducer : reducers_) reducer->begin_step();
  stats_ = ReductionStats{};
}

void DataParallel::begin_micro_batch(bool last) {
  for (const auto& reducer : reducers_) reducer->begin_micro_batch(last);
}

void DataParallel::finish_backward() {
  // Every group's remaining reductions in flight before any is awaited.
  for (const auto& reducer : reducers_) reducer->launch_rest();
  for (const auto& reducer : reducers_) reducer->finish_backward();
  if (reduced()) combine_reduction_stats();
}

bool DataParallel::reduced() const {
  return std::all_of(reducers_.begin(), reducers_.end(), [](const auto& r) { return r->reduced(); });
}

void DataParallel::combine_reduction_stats() {
  stats_ = ReductionStats{};
  stats_.first_launch_ns = std::numeric_limits<int64_t>::max();
  for (const auto& reducer : reducers_) {
    const ReductionStats& part = reducer->last_reduction();
    stats_.buckets += part.buckets;
    stats_.launched_in_backward += part.launched_in_backward;
    stats_.hook_polls += part.hook_polls;
    if (part.buckets > 0) stats_.first_launch_ns = std::min(stats_.first_launch_ns, part.first_launch_ns);
    stats_.backward_end_ns = std::max(stats_.backward_end_ns, part.backward_end_ns);
    stats_.reduction_end_ns = std::max(stats_.reduction_end_ns, part.reduction_end_ns);
  }
  if (stats_.buckets == 0) stats_.first_launch_ns = 0;
}

nn::GradNorm DataParallel::grad_norm() {
  TESSERA_CHECK(reduced(), "data parallel: grad_norm() before finish_backward() of the step's last micro-batch");
  // Under tensor parallelism a replicated parameter is counted by the
  // group's first rank only; split ones by every rank (their parts).
  Communicator* model_parallel =
      options_.model_parallel && options_.model_parallel->size() > 1 ? options_.model_parallel : nullptr;
  const auto counted = [&](const nn::Parameter& p) {
    if (options_.counts_in_norm) return options_.counts_in_norm(p);
    return !model_parallel || p.shard.split || model_parallel->rank() == 0;
  };
  // Plain DP holds a group's averaged gradients whole on each of its ranks:
  // its rank 0 counts them. ZeRO holds disjoint pieces: each rank its own.
  // Summed over the replicas, each group's parameters count once per copy
  // that differs (an expert on each ep rank). A NaN never travels: the
  // flag says it.
  double sum = 0.0;
  bool finite = true;
  for (const auto& reducer : reducers_) {
    const double part = reducer->gradient_sum_squares(counted);
    finite = finite && std::isfinite(part);
    if (options_.zero_stage >= 1 || reducer->communicator().rank() == 0) sum += part;
  }
  if (replicas_->size() == 1 && !model_parallel) return {std::sqrt(sum), finite};
  const Tensor& any_grads = reducers_.front()->gradient_buffer();
  Tensor both = any_grads.context().from_vector(
      Shape{2}, std::vector<float>{finite ? float(sum) : 0.0f, finite ? 0.0f : 1.0f}, any_grads.device());
  if (replicas_->size() > 1) replicas_->all_reduce(both, ReduceOp::sum)->wait();
  if (model_parallel) model_parallel->all_reduce(both, ReduceOp::sum)->wait();
  const std::vector<float> global = both.to_vector<float>();
  return {std::sqrt(double(global[0])), global[1] == 0.0f && std::isfinite(global[0])};
}

void DataParallel::step(double lr, float grad_scale) {
  TESSERA_CHECK(reduced(), "data parallel: step() before finish_backward() of the step's last micro-batch");
  TESSERA_CHECK(std::none_of(reducers_.begin(), reducers_.end(), [](const auto& r) { return r->unsharded(); }),
                "data parallel: step() after unshard_values(); the sharded values are no longer used");
  optimizer_->step(lr, grad_scale);
  gather_values();
}

void DataParallel::gather_values() {
  for (const auto& reducer : reducers_) reducer->gather_values();
}

void DataParallel::unshard_values() {
  for (const auto& reducer : reducers_) reducer->unshard_values();
}

int64_t DataParallel::optimizer_state_bytes() {
  int64_t bytes = 0;
  for (const auto& [name, tensor] : optimizer_->state_tensors()) bytes += int64_t(tensor->nbytes());
  return bytes;
}

std::vector<OptimizerStateSlice> DataParallel::optimizer_state_slices() {
  std::vector<OptimizerStateSlice> out;
  for (auto& [state_name, tensor] : optimizer_->state_tensors()) {
    // "<optimizer parameter>.<state>", the state's name having no dot.
    const size_t dot = state_name.rfind('.');
    const auto found = dot == std::string::npos ? state_owners_.end() : state_owners_.find(state_name.substr(0, dot));
    TESSERA_CHECK(found != state_owners_.end(), "data parallel: optimizer state '", state_name,
                  "' belongs to no parameter");
    const StateOwner& origin = found->second;
    OptimizerStateSlice slice;
    slice.name = origin.parameter->name + state_name.substr(dot);
    slice.parameter = origin.parameter;
    slice.shape = origin.parameter->value.shape();
    slice.local = tensor;
    slice.flat_range = origin.flat_range;
    slice.begin = origin.begin;
    slice.owner = origin.owner;
    out.push_back(std::move(slice));
  }
  return out;
}

std::vector<OptimizerStateSlice> DataParallel::value_slices() {
  std::vector<OptimizerStateSlice> out;
  for (const auto& reducer : reducers_) {
    std::vector<OptimizerStateSlice> part = reducer->value_slices();
    out.insert(out.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  }
  return out;
}

int64_t DataParallel::flat_numel() const {
  int64_t numel = 0;
  for (const auto& reducer : reducers_) numel += reducer->flat_numel();
  return numel;
}

int DataParallel::bucket_count() const {
  int count = 0;
  for (const auto& reducer : reducers_) count += reducer->bucket_count();
  return count;
}

bool DataParallel::reduced_after_backward(const nn::Parameter& parameter) const {
  return std::any_of(reducers_.begin(), reducers_.end(),
                     [&](const auto& r) { return r->reduced_after_backward(parameter); });
}

std::string DataParallel::first_non_finite_gradient() {
  for (const auto& reducer : reducers_)
    if (std::string name = reducer->first_non_finite_gradient(); !name.empty()) return name;
  return "";
}

std::vector<std::vector<std::string>> DataParallel::bucket_parameter_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& reducer : reducers_) {
    std::vector<std::vector<std::string>> part = reducer->bucket_parameter_names();
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

std::string DataParallel::describe() {
  std::ostringstream out;
  if (reducers_.size() == 1) {
    out << "dp=" << replicas_->size() << " zero=" << options_.zero_stage << " " << reducers_.front()->describe();
  } else {
    out << "zero=" << options_.zero_stage;
    for (size_t g = 0; g < reducers_.size(); ++g)
      out << (g == 0 ? ", gradients of " : ", of ") << reducers_[g]->communicator().name() << " over "
          << reducers_[g]->communicator().size() << " ranks: " << reducers_[g]->describe();
  }
  out << ", optimizer state " << optimizer_state_bytes() << " bytes on this rank";
  return out.str();
}

}  // namespace tessera::parallel
