// GradientReducer (gradient_reducer.h): one gradient group's flat gradient
// (and, for ZeRO-1/2, value) buffers and their buckets, the gradient hooks
// that launch each bucket's reduction during backward, ZeRO's pieces and
// their pseudo-parameters, and this rank's share of the gradient norm.
#include "parallel/gradient_reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "core/allocator.h"
#include "core/context.h"
#include "kernels/ops.h"

namespace tessera::parallel {
namespace {

// Each parameter's first element is aligned to 16 elements (64 bytes of f32)
// in the flat buffers, as a freshly allocated tensor would be.
constexpr int64_t kAlignElements = 16;

int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

GradientReducer::GradientReducer(std::vector<nn::Parameter*> parameters, Communicator& comm,
                                 const DataParallelOptions& options, int replicas)
    : parameters_(std::move(parameters)),
      comm_(comm),
      options_(options),
      replica_share_(float(double(comm.size()) / double(replicas))) {
  TESSERA_CHECK(replicas >= comm.size() && replicas % comm.size() == 0, "data parallel: a gradient group of ",
                comm.size(), " ranks (", comm.name(), ") within ", replicas,
                " replicas; the replicas must be a multiple of every group");
  check_parameters();
  if (units_mode()) build_units();
  lay_out_buckets();
  if (units_mode()) assign_unit_buckets();
  create_flat_buffers();
  if (shards_optimizer()) {
    create_shards();
  } else {
    optimized_ = parameters_;
    for (const nn::Parameter* p : parameters_) origins_.push_back({p, 0, false});
  }
  // ZeRO-3: the whole values are dropped (their memory returns) once every
  // rank's pieces are in shard_values_.
  if (shards_values())
    for (nn::Parameter* p : parameters_) p->value = Tensor::placeholder(p->value.shape(), p->value.dtype());

  ready_.assign(parameters_.size(), false);
  for (size_t i = 0; i < parameters_.size(); ++i)
    parameters_[i]->on_grad_ready = [this, i](nn::Parameter&) { on_grad_ready(i); };
}

void GradientReducer::check_parameters() const {
  TESSERA_CHECK(!parameters_.empty(), "data parallel: the model has no parameters to train");
  const nn::Parameter& first = *parameters_.front();
  TESSERA_CHECK(first.value.defined(), "data parallel: parameter '", first.name, "' has no value");
  const Device device = first.value.device();
  const DType dtype = first.value.dtype();
  std::set<std::string> names;
  for (const nn::Parameter* p : parameters_) {
    TESSERA_CHECK(p != nullptr, "data parallel: a null parameter pointer was passed");
    TESSERA_CHECK(names.insert(p->name).second, "data parallel: parameter '", p->name, "' is passed twice");
    TESSERA_CHECK(
        p->value.defined() && p->grad.defined() && p->grad.dtype() == DType::f32 && p->grad.numel() == p->value.numel(),
        "data parallel: parameter '", p->name, "' needs a value and an f32 gradient of the same size");
    TESSERA_CHECK(p->value.device() == device && p->grad.device() == device, "data parallel: parameter '", p->name,
                  "' is on ", p->value.device().to_string(), " but '", first.name, "' on ", device.to_string(),
                  "; one data-parallel replica lives on one device");
    TESSERA_CHECK(!shards_optimizer() || p->value.dtype() == dtype, "data parallel: --zero ", options_.zero_stage,
                  " keeps all parameters in one flat layout, but '", p->name, "' holds ", dtype_name(p->value.dtype()),
                  " and '", first.name, "' ", dtype_name(dtype));
    TESSERA_CHECK(!p->on_grad_ready, "data parallel: parameter '", p->name,
                  "' already has a gradient hook; is the model wrapped by two DataParallel objects at once?");
  }
}

void GradientReducer::lay_out_buckets() {
  // Buckets of whole parameters in reverse order (the order backward
  // completes them); parameters reduced after backward in buckets of their
  // own, last, so they hold back no other bucket. ZeRO-2/3: one bucket per unit.
  deferred_.assign(parameters_.size(), false);
  std::vector<size_t> order, later;
  for (size_t k = parameters_.size(); k-- > 0;) {
    deferred_[k] = options_.reduced_after_backward && options_.reduced_after_backward(*parameters_[k]);
    (deferred_[k] ? later : order).push_back(k);
  }
  const size_t backward_count = order.size();
  order.insert(order.end(), later.begin(), later.end());
  const int64_t bucket_limit = std::max<int64_t>(1, int64_t(options_.bucket_size_mb * 1024.0 * 1024.0 / 4.0));
  offset_.assign(parameters_.size(), 0);
  bucket_of_.assign(parameters_.size(), 0);
  int64_t cursor = 0;
  for (size_t position = 0; position < order.size(); ++position) {
    const size_t k = order[position];
    if (buckets_.empty() || buckets_.back().numel > 0) {  // numel > 0: the last bucket is closed
      buckets_.emplace_back();
      buckets_.back().begin = cursor;
    }
    Bucket& bucket = buckets_.back();
    cursor = align_up(cursor, kAlignElements);
    offset_[k] = cursor;
    cursor += parameters_[k]->value.numel();
    bucket.parameters.push_back(k);
    bucket_of_[k] = buckets_.size() - 1;
    const bool group_ends = position + 1 == order.size() || position + 1 == backward_count;
    const bool unit_ends = units_mode() && (position + 1 == order.size() ||
                                            unit_of_parameter_[order[position + 1]] != unit_of_parameter_[k]);
    if (units_mode() ? unit_ends || group_ends : cursor - bucket.begin >= bucket_limit || group_ends) {
      int64_t numel = std::max<int64_t>(cursor - bucket.begin, 1);
      if (shards_optimizer()) numel = align_up(numel, comm_.size());  // equal pieces, one per rank
      bucket.numel = numel;
      cursor = align_up(bucket.begin + numel, kAlignElements);
    }
  }
  flat_numel_ = cursor;
}

void GradientReducer::create_flat_buffers() {
  // The flat gradients, then the views (keeping what the gradients held);
  // ZeRO-2/3 have none: a unit's gradients exist only while its backward
  // needs them (allocate_gradients).
  const Tensor& first = parameters_.front()->value;
  Context& ctx = first.context();
  if (!units_mode()) {
    const MemoryUseScope use(MemoryUse::gradients);
    flat_grads_ = ctx.zeros(Shape{flat_numel_}, DType::f32, first.device());
  }
  if (shards_optimizer() && !shards_values()) {
    const MemoryUseScope use(MemoryUse::parameters);
    flat_values_ = ctx.zeros(Shape{flat_numel_}, first.dtype(), first.device());
  }
  for (size_t i = 0; i < parameters_.size(); ++i) {
    nn::Parameter& p = *parameters_[i];
    const int64_t n = p.value.numel();
    if (units_mode()) {
      p.grad = Tensor::placeholder(p.value.shape(), DType::f32);
    } else {
      Tensor grad = flat_grads_.slice(offset_[i], offset_[i] + n).view(p.value.shape());
      grad.copy_(p.grad);
      p.grad = grad;
    }
    if (flat_values_.defined()) {
      Tensor value = flat_values_.slice(offset_[i], offset_[i] + n).view(p.value.shape());
      value.copy_(p.value);
      p.value = value;
    }
  }
}

void GradientReducer::create_shards() {
  const Tensor& first = parameters_.front()->value;
  Context& ctx = first.context();
  int64_t shard_total = 0;
  for (Bucket& bucket : buckets_) {
    bucket.shard_begin = shard_total;
    shard_total += piece_numel(bucket);
  }
  {
    const MemoryUseScope use(MemoryUse::gradients);
    shard_grads_ = ctx.zeros(Shape{shard_total}, DType::f32, first.device());
  }
  {
    const MemoryUseScope use(MemoryUse::parameters);
    // ZeRO-1/2 update their pieces inside the flat values (gathered in place);
    // ZeRO-3 keeps only its pieces.
    if (shards_values()) shard_values_ = ctx.zeros(Shape{shard_total}, first.dtype(), first.device());
  }
  // One pseudo-parameter per intersection of a parameter with this rank's piece of a bucket.
  const int rank = comm_.rank();
  for (Bucket& bucket : buckets_) {
    const int64_t piece = piece_numel(bucket);
    const int64_t piece_begin = bucket.begin + int64_t(rank) * piece, piece_end = piece_begin + piece;
    for (size_t index : bucket.parameters) {
      const nn::Parameter& p = *parameters_[index];
      const int64_t begin = std::max(offset_[index], piece_begin);
      const int64_t end = std::min(offset_[index] + p.value.numel(), piece_end);
      if (end <= begin) continue;
      auto shard = std::make_unique<nn::Parameter>();
      shard->name = p.name + ".shard" + std::to_string(rank);
      const int64_t at = bucket.shard_begin + (begin - piece_begin);
      if (shards_values()) {  // the piece moves out of the parameter (a placeholder once all are moved)
        shard->value = shard_values_.slice(at, at + (end - begin));
        shard->value.copy_(p.value.view(Shape{p.value.numel()}).slice(begin - offset_[index], end - offset_[index]));
      } else {
        shard->value = flat_values_.slice(begin, end);
      }
      shard->grad = shard_grads_.slice(at, at + (end - begin));
      shard->weight_decay = p.weight_decay;
      optimized_.push_back(shard.get());
      shards_.push_back(std::move(shard));
      shard_origins_.push_back({index, begin - offset_[index]});
      origins_.push_back({&p, begin - offset_[index], true});
    }
  }
}

GradientReducer::~GradientReducer() {
  for (nn::Parameter* p : parameters_) p->on_grad_ready = nullptr;
  for (Unit& unit : units_) {
    for (CommHandle* handle : {&unit.gather, &unit.reduction}) {
      try {
        if (*handle) (*handle)->wait();
      } catch (const std::exception&) {
      }
      handle->reset();
    }
  }
  // Unfinished handles wait in their destructors; they must not throw here.
  for (Bucket& bucket : buckets_) {
    try {
      if (bucket.handle) bucket.handle->wait();
    } catch (const std::exception&) {
    }
    bucket.handle.reset();
  }
}

int64_t GradientReducer::now() const {
  return options_.clock ? options_.clock() : steady_ns();
}

void GradientReducer::begin_step() {
  for (Bucket& bucket : buckets_) {
    TESSERA_CHECK(!bucket.handle, "data parallel: begin_step() while a bucket's reduction is still in flight; ",
                  "call finish_backward() after the last micro-batch's backward");
    bucket.ready = 0;
    bucket.launched = bucket.completed = bucket.in_backward = false;
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_launch_ = 0;
  last_micro_batch_ = true;
  reduced_ = false;
  rest_launched_ = false;
  stats_ = ReductionStats{};
  if (units_mode()) {
    for (Unit& unit : units_) {
      TESSERA_CHECK(!unit.reduction && !unit.grads.defined(), "data parallel: begin_step() while unit ",
                    unit.module->name(), "'s gradients are still held; call finish_backward() after the last ",
                    "micro-batch's backward");
      unit.written_this_step = false;
    }
    shard_grads_.fill_(0.0);
  } else {
    flat_grads_.fill_(0.0);
  }
}

void GradientReducer::begin_micro_batch(bool last) {
  TESSERA_CHECK(next_launch_ == 0 && !reduced_, "data parallel: a micro-batch began after the step's gradients were ",
                "reduced; call begin_step() before the next step");
  last_micro_batch_ = last;
  if (units_mode()) return;  // every micro-batch is reduced, a unit as its backward completes
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& bucket : buckets_) bucket.ready = 0;
}

void GradientReducer::on_grad_ready(size_t index) {
  if (units_mode() && !reduced_ && !deferred_[index]) {
    TESSERA_CHECK(!ready_[index], "data parallel: parameter '", parameters_[index]->name,
                  "' reported a complete gradient twice in one backward (a module used twice in one forward?)");
    ready_[index] = true;
    Bucket& bucket = buckets_[bucket_of_[index]];
    if (++bucket.ready == int(bucket.parameters.size())) launch_unit_reduction(unit_of_parameter_[index], true);
    progress_units();
    return;
  }
  if (!last_micro_batch_ || reduced_ || deferred_[index]) return;
  TESSERA_CHECK(!ready_[index], "data parallel: parameter '", parameters_[index]->name,
                "' reported a complete gradient twice in one backward (a module used twice in one forward?); its ",
                "bucket may already be reduced");
  ready_[index] = true;
  Bucket& bucket = buckets_[bucket_of_[index]];
  if (++bucket.ready == int(bucket.parameters.size())) launch_ready_in_order(true);
  if (next_launch_ > 0) {
    comm_.poll();
    ++stats_.hook_polls;
    check_completions();
  }
}

void GradientReducer::launch_ready_in_order(bool in_backward) {
  while (next_launch_ < buckets_.size() &&
         buckets_[next_launch_].ready == int(buckets_[next_launch_].parameters.size()))
    launch(next_launch_++, in_backward);
}

void GradientReducer::launch(size_t index, bool in_backward) {
  Bucket& bucket = buckets_[index];
  bucket.launched = true;
  bucket.in_backward = in_backward;
  bucket.start_ns = now();
  if (stats_.buckets == 0) stats_.first_launch_ns = bucket.start_ns;
  ++stats_.buckets;
  if (in_backward) ++stats_.launched_in_backward;
  Tensor grads = flat_grads_.slice(bucket.begin, bucket.begin + bucket.numel);
  if (shards_optimizer()) {
    Tensor piece = shard_grads_.slice(bucket.shard_begin, bucket.shard_begin + piece_numel(bucket));
    bucket.handle = comm_.reduce_scatter(grads, piece, ReduceOp::avg);
  } else {
    bucket.handle = comm_.all_reduce(grads, ReduceOp::avg);
  }
}

void GradientReducer::check_completions() {
  for (size_t i = 0; i < next_launch_; ++i) {
    Bucket& bucket = buckets_[i];
    if (bucket.handle && !bucket.completed && bucket.handle->test()) complete(bucket, i);
  }
}

void GradientReducer::complete(Bucket& bucket, size_t index) {
  bucket.completed = true;
  if (replica_share_ != 1.0f) {
    Tensor averaged = shards_optimizer()
                          ? shard_grads_.slice(bucket.shard_begin, bucket.shard_begin + piece_numel(bucket))
                          : flat_grads_.slice(bucket.begin, bucket.begin + bucket.numel);
    ops::scale_(averaged, replica_share_);
  }
  if (!options_.on_event) return;
  CommEvent event;
  event.name = shards_optimizer() ? "reduce_scatter" : "all_reduce";
  event.bucket = int(index);
  event.bytes = bucket.numel * 4;
  event.start_ns = bucket.start_ns;
  event.end_ns = now();
  event.launched_in_backward = bucket.in_backward;
  options_.on_event(event);
}

void GradientReducer::launch_rest() {
  if (!last_micro_batch_ || reduced_ || rest_launched_) return;
  rest_launched_ = true;
  stats_.backward_end_ns = now();
  if (units_mode()) {
    launch_held_units();
    return;
  }
  while (next_launch_ < buckets_.size()) launch(next_launch_++, false);
}

void GradientReducer::finish_backward() {
  if (!last_micro_batch_ || reduced_) return;
  launch_rest();  // unless the caller did
  if (units_mode()) {
    finish_units_backward();
    return;
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& bucket = buckets_[i];
    bucket.handle->wait();
    if (!bucket.completed) complete(bucket, i);
    bucket.handle.reset();
  }
  stats_.reduction_end_ns = now();
  reduced_ = true;
}

double GradientReducer::gradient_sum_squares(const std::function<bool(const nn::Parameter&)>& counted) {
  TESSERA_CHECK(reduced_, "data parallel: grad_norm() before finish_backward() of the step's last micro-batch");
  std::vector<nn::Parameter*> local;
  for (size_t i = 0; i < optimized_.size(); ++i)
    if (counted(*origins_[i].parameter)) local.push_back(optimized_[i]);
  return local.empty() ? 0.0 : double(nn::grad_sum_squares(local).to_vector<float>()[0]);
}

void GradientReducer::gather_values() {
  if (!flat_values_.defined()) return;  // plain (values whole), ZeRO-3 (gathered per unit when used)
  const int rank = comm_.rank();
  std::vector<CommHandle> handles(buckets_.size());
  std::vector<int64_t> starts(buckets_.size());
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& bucket = buckets_[i];
    const int64_t piece = piece_numel(bucket);
    const int64_t own = bucket.begin + int64_t(rank) * piece;
    // In place: this rank's piece is block `rank` of the bucket (Communicator::all_gather).
    const Tensor send = flat_values_.slice(own, own + piece);
    Tensor values = flat_values_.slice(bucket.begin, bucket.begin + bucket.numel);
    starts[i] = now();
    handles[i] = comm_.all_gather(send, values);
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    handles[i]->wait();
    if (options_.on_event) {
      CommEvent event;
      event.name = "all_gather";
      event.bucket = int(i);
      event.bytes = piece_numel(buckets_[i]) * int64_t(flat_values_.element_size());
      event.start_ns = starts[i];
      event.end_ns = now();
      options_.on_event(event);
    }
  }
}

std::vector<OptimizerStateSlice> GradientReducer::value_slices() {
  std::vector<OptimizerStateSlice> out;
  if (!shards_values()) return out;
  for (size_t i = 0; i < shards_.size(); ++i) {
    const nn::Parameter& parameter = *parameters_[shard_origins_[i].parameter];
    OptimizerStateSlice slice;
    slice.name = parameter.name;
    slice.parameter = &parameter;
    slice.shape = parameter.value.shape();
    slice.local = &shards_[i]->value;
    slice.flat_range = true;
    slice.begin = shard_origins_[i].begin;
    slice.owner = true;
    out.push_back(std::move(slice));
  }
  return out;
}

std::string GradientReducer::first_non_finite_gradient() {
  const auto finite = [](const Tensor& grad) {
    Tensor out = grad.context().empty(Shape{1}, DType::f32, grad.device());
    ops::sum_squares(grad, out);
    return std::isfinite(out.to_vector<float>()[0]);
  };
  if (units_mode()) {  // no whole gradients: this rank's pieces
    for (size_t i = 0; i < shards_.size(); ++i)
      if (!finite(shards_[i]->grad)) return parameters_[shard_origins_[i].parameter]->name;
    return "";
  }
  for (const nn::Parameter* p : parameters_)
    if (!finite(p->grad)) return p->name;
  return "";
}

bool GradientReducer::reduced_after_backward(const nn::Parameter& parameter) const {
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (parameters_[i] == &parameter) return deferred_[i];
  return false;
}

std::vector<std::vector<std::string>> GradientReducer::bucket_parameter_names() const {
  std::vector<std::vector<std::string>> out;
  for (const Bucket& bucket : buckets_) {
    out.emplace_back();
    for (size_t index : bucket.parameters) out.back().push_back(parameters_[index]->name);
  }
  return out;
}

bool GradientReducer::holds(const nn::Parameter& parameter) const {
  return std::find(parameters_.begin(), parameters_.end(), &parameter) != parameters_.end();
}

std::string GradientReducer::describe() const {
  std::ostringstream out;
  if (units_mode())
    out << "units=" << units_.size() << " (prefetch " << options_.prefetch << ")";
  else
    out << "buckets=" << buckets_.size() << " (" << options_.bucket_size_mb << " MiB)";
  out << " flat=" << flat_numel_ << " elements";
  return out.str();
}

}  // namespace tessera::parallel
