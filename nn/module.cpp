// Module and Saved: parameter creation and naming, the parameter walk, the
// train/eval switch, and the initialisers that make a parameter's values a
// function of (seed, name, element index) only.
#include "nn/module.h"

#include "core/allocator.h"
#include "core/context.h"
#include "kernels/ops.h"

namespace tessera::nn {

Saved& Saved::child(size_t index) {
  if (children.size() <= index) children.resize(index + 1);
  return children[index];
}

void Saved::clear() {
  tensors.clear();
  scalars.clear();
  children.clear();
}

void Saved::push_shape(const Shape& shape) {
  scalars.push_back(shape.ndim());
  for (const int64_t s : shape.sizes()) scalars.push_back(s);
}

Shape Saved::shape_at(size_t position) const {
  const int64_t ndim = scalars.at(position);
  TESSERA_CHECK(position + 1 + size_t(ndim) <= scalars.size(), "Saved: no shape of ", ndim, " dimensions at ",
                position);
  return Shape(std::span<const int64_t>(scalars.data() + position + 1, size_t(ndim)));
}

void check_saved(const Module& module, const Saved& saved, size_t tensors, size_t scalars) {
  TESSERA_CHECK(saved.tensors.size() >= tensors && saved.scalars.size() >= scalars, module.name(),
                ": backward without a matching forward (the Saved passed in holds no state for this call)");
}

Module::Module(const ModelSpec& spec, std::string name) : spec_(spec), name_(std::move(name)) {
  TESSERA_CHECK(spec_.context != nullptr, "module '", name_,
                "': ModelSpec.context is null; pass the Context that will own the parameters");
  TESSERA_CHECK(is_floating(spec_.dtype), "module '", name_, "': the model dtype must be f32, bf16 or f16, got ",
                dtype_name(spec_.dtype));
}

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  for (const auto& p : parameters_) out.push_back(p.get());
  for (const auto& child : children_) {
    const std::vector<Parameter*> inner = child->parameters();
    out.insert(out.end(), inner.begin(), inner.end());
  }
  return out;
}

ParametersInUse::ParametersInUse(Module& module, ParameterPhase phase) : module_(module), phase_(phase) {
  if (ParameterHooks* hooks = module_.parameter_hooks()) hooks->acquire(module_, phase_);
}

ParametersInUse::~ParametersInUse() {
  if (ParameterHooks* hooks = module_.parameter_hooks()) hooks->release(module_, phase_);
}

Tensor Module::forward(const Tensor& input, Saved& saved, const Pass& pass) {
  const ParametersInUse in_use(*this, ParameterPhase::forward);
  return forward_impl(input, saved, pass);
}

Tensor Module::backward(const Tensor& grad_output, Saved& saved) {
  if (later_) return backward_input_half(grad_output, saved);
  Tensor grad_input;
  {
    const ParametersInUse in_use(*this, ParameterPhase::backward);
    grad_input = backward_impl(grad_output, saved);
  }
  report_gradients_ready();
  return grad_input;
}

void Module::report_gradients_ready() {
  for (const auto& p : parameters_)
    if (p->on_grad_ready) p->on_grad_ready(*p);
}

// The B step: the hooks' weight-gradient acquire first in the W list, then
// what backward_impl leaves there, then the gradient-ready hooks and the
// release. A module that does not split its own backward computes its
// parameters' gradients now, into zeroed buffers of their own that the W
// step adds in (their .grad is put back at once: under ZeRO-2/3 it is
// another buffer by then).
Tensor Module::backward_input_half(const Tensor& grad_output, Saved& saved) {
  WeightGradients& later = *later_;
  if (hooks_) later.add([this] { hooks_->acquire(*this, ParameterPhase::weight_gradient); });
  std::vector<Tensor> kept_grads;
  const bool own_buffers = !splits_backward() && !parameters_.empty();
  if (own_buffers)
    for (const auto& p : parameters_) {
      kept_grads.push_back(p->grad);
      p->grad = context().zeros(p->grad.shape(), DType::f32, spec_.device);
    }
  Tensor grad_input;
  {
    const ParametersInUse in_use(*this, ParameterPhase::input_gradient);
    grad_input = backward_impl(grad_output, saved);
  }
  if (own_buffers) {
    std::vector<std::pair<Parameter*, Tensor>> computed;
    for (size_t i = 0; i < parameters_.size(); ++i) {
      computed.emplace_back(parameters_[i].get(), parameters_[i]->grad);
      parameters_[i]->grad = kept_grads[i];
    }
    later.add([computed] {
      for (const auto& [p, grad] : computed) ops::axpy(1.0f, grad, p->grad);
    });
  }
  later.add([this] {
    report_gradients_ready();
    if (hooks_) hooks_->release(*this, ParameterPhase::weight_gradient);
  });
  return grad_input;
}

void Module::defer_weight_gradients(WeightGradients* later) {
  later_ = later;
  for (const auto& child : children_) child->defer_weight_gradients(later);
}

void Module::add_weight_gradients(std::function<void()> work) {
  if (later_)
    later_->add(std::move(work));
  else
    work();
}

void WeightGradients::run() {
  std::vector<std::function<void()>> work;
  work.swap(work_);
  for (const auto& piece : work) piece();
}

std::vector<Module*> Module::children() const {
  std::vector<Module*> out;
  for (const auto& child : children_) out.push_back(child.get());
  return out;
}

namespace {

void collect_units(Module& module, std::vector<Module*>& units) {
  if (module.shards_as_one_unit() || module.has_own_parameters()) {
    if (!module.parameters().empty()) units.push_back(&module);
    return;
  }
  for (Module* child : module.children()) collect_units(*child, units);
}

}  // namespace

std::vector<Module*> sharding_units(Module& root) {
  std::vector<Module*> units;
  collect_units(root, units);
  return units;
}

void Module::train(bool training) {
  training_ = training;
  for (const auto& child : children_) child->train(training);
}

Parameter& Module::add_parameter(const std::string& local, const Shape& shape, bool weight_decay) {
  const std::string full = child_name(local);
  for (const auto& p : parameters_)
    TESSERA_CHECK(p->name != full, "module '", name_, "': parameter '", full, "' is created twice");
  Context& ctx = context();
  auto p = std::make_unique<Parameter>();
  p->name = full;
  if (spec_.shapes_only) {
    p->value = Tensor::placeholder(shape, spec_.dtype);
    p->grad = Tensor::placeholder(shape, DType::f32);
  } else {
    {
      const MemoryUseScope use(MemoryUse::parameters);
      p->value = ctx.empty(shape, spec_.dtype, spec_.device);
    }
    const MemoryUseScope use(MemoryUse::gradients);
    p->grad = ctx.zeros(shape, DType::f32, spec_.device);
  }
  p->weight_decay = weight_decay;
  p->shard.global_shape = shape;
  parameters_.push_back(std::move(p));
  return *parameters_.back();
}

void Module::init_normal(Parameter& p, float stddev) {
  if (spec_.shapes_only) return;
  init_shard_normal(p, spec_.seed, 0.0f, stddev);
}

void Module::init_uniform(Parameter& p, float bound) {
  if (spec_.shapes_only) return;
  init_shard_uniform(p, spec_.seed, -bound, bound);
}

void Module::init_constant(Parameter& p, float value) {
  if (spec_.shapes_only) return;
  p.value.fill_(double(value));
}

}  // namespace tessera::nn
