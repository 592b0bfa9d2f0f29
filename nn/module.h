// Module: a layer or a model with an explicit forward and backward (no tape).
//
//   Saved saved;                                  // what this call keeps for its backward
//   Tensor y = module.forward(x, saved, pass);
//   Tensor dx = module.backward(dy, saved);      // adds into every parameter's .grad
//
// What a forward keeps is explicit and per call (a `Saved`), so several
// micro-batches can be in flight (pipeline schedules) and recomputation is a
// policy of the module (keep the input, re-run forward inside backward), not a
// rewrite. Backward may release what `saved` holds as soon as it is used.
//
// Parameters are created at construction with their global name, in the
// model's dtype and device (see ModelSpec), and initialised from (seed, name,
// element index) so the same seed gives the same model under any layout.
//
// A module may carry ParameterHooks (ZeRO-2/3 installs them on each sharding
// unit): forward() and backward() call acquire() before the module's own
// code and release() after it, so parameters can live sharded and be
// gathered (and gradients allocated) only while a unit runs. A module that
// uses another unit's parameters outside that unit's calls (the GPT head's
// tied embedding) holds them with a ParametersInUse of its own.
//
// Backward in two halves (zero-bubble pipeline schedules, parallel/pipeline.h):
// while a module defers weight gradients into a WeightGradients list,
// backward() computes the gradient for the input only (the B step) and
// leaves in the list what adds into the parameters' gradients, each
// parameter's on_grad_ready hook and the parameter hooks' weight-gradient
// acquire and release around them; running the list (the W step) does that
// work in the order a one-call backward would have done it, so gradients are
// the same bit for bit. A module's backward_impl passes its weight-gradient
// work to add_weight_gradients() (run at once in a one-call backward); a
// module whose backward_impl does not (a layer nobody split) has its own
// parameters' gradients computed during B into buffers of its own and added
// at W.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/parameter.h"

namespace tessera::nn {

// What a module kept from one forward call for the matching backward.
struct Saved {
  std::vector<Tensor> tensors;
  std::vector<int64_t> scalars;  // small host values: input shapes, dropout seeds, a recomputed pass
  std::vector<Saved> children;   // sub-modules' state, in the order the parent chooses
  Saved& child(size_t index);    // grows `children` as needed
  void clear();
  // Shapes travel in `scalars` as [ndim, sizes...].
  void push_shape(const Shape& shape);
  Shape shape_at(size_t position) const;  // the shape pushed at scalars[position]
};

// Where one forward call sits in training. Dropout derives its mask from
// (seed, module name, step, micro_batch), so a recomputed forward draws the
// same mask, and every rank/layout draws the same one for the same element.
// With a KV cache (generation, nn/kv_cache.h) the forward is inference only:
// attention appends to the cache and attends to it, positions start at the
// cache's position, and nothing is kept for a backward.
class KvCache;
struct Pass {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t micro_batch = 0;
  KvCache* kv_cache = nullptr;
  // The factor the step applies to this micro-batch's loss gradient (the
  // fp16 loss scale over the micro-batches of a step): a layer that adds a
  // loss of its own (a mixture of experts' auxiliary losses) scales its
  // gradient by it, as the loss's gradient is.
  float loss_gradient_scale = 1.0f;
};

// Where and how a module's parameters live.
struct ModelSpec {
  Context* context = nullptr;
  Device device = Device::cpu();
  DType dtype = DType::f32;  // parameters and activations (compute dtype); grads are f32
  uint64_t seed = 1234;      // initialisation seed
  // Parameters are placeholders (shape and dtype, no memory, no
  // initialisation): the shapes and shards of a model of any size, built in
  // microseconds, for counting it (--estimate-memory). Such a model cannot run.
  bool shapes_only = false;
};

class Module;

// What a use of a module's parameters needs: values (forward), values and
// gradient buffers to add into (backward); in a backward in two halves,
// values only (input_gradient: the B step) and gradient buffers only
// (weight_gradient: the W step).
enum class ParameterPhase { forward, backward, input_gradient, weight_gradient };

// The W steps a backward in two halves left (see the top of this file): work
// in the order it was added.
class WeightGradients {
 public:
  void add(std::function<void()> work) { work_.push_back(std::move(work)); }
  // Runs every piece of work in order and empties the list.
  void run();
  bool empty() const { return work_.empty(); }
  size_t size() const { return work_.size(); }

 private:
  std::vector<std::function<void()>> work_;
};

class ParameterHooks {
 public:
  virtual ~ParameterHooks() = default;
  // Before `module` uses its parameters (they must be usable on return).
  virtual void acquire(Module& module, ParameterPhase phase) = 0;
  // After that use; must not throw (it runs while unwinding too).
  virtual void release(Module& module, ParameterPhase phase) noexcept = 0;
};

// Holds a module's parameters for a scope through its hooks (nothing without hooks).
class ParametersInUse {
 public:
  ParametersInUse(Module& module, ParameterPhase phase);
  ~ParametersInUse();
  ParametersInUse(const ParametersInUse&) = delete;
  ParametersInUse& operator=(const ParametersInUse&) = delete;

 private:
  Module& module_;
  ParameterPhase phase_;
};

// Throws, naming the module, unless `saved` holds at least the tensors and
// scalars a forward call of it leaves (a backward without its forward).
void check_saved(const Module& module, const Saved& saved, size_t tensors, size_t scalars = 0);

class Module {
 public:
  Module(const ModelSpec& spec, std::string name);
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The module's forward (forward_impl) between its hooks' acquire and release.
  Tensor forward(const Tensor& input, Saved& saved, const Pass& pass);
  // Returns the gradient with respect to the input (an undefined Tensor for
  // inputs without one, e.g. token ids) and adds into parameters' .grad;
  // then calls the on_grad_ready hook of each of this module's own
  // parameters (their gradient is complete for this micro-batch: the
  // data-parallel reducer starts a bucket's all-reduce from there). Between
  // the hooks' acquire and release, like forward().
  Tensor backward(const Tensor& grad_output, Saved& saved);

  // While `later` is set (on this module and every descendant), backward()
  // is the B step of a backward in two halves and leaves its W step in
  // `later` (see the top of this file); null: one-call backward.
  void defer_weight_gradients(WeightGradients* later);
  bool defers_weight_gradients() const { return later_ != nullptr; }
  // Work that adds into parameters' gradients: run now in a one-call
  // backward, kept for the W step in a backward in two halves. It must
  // read a parameter's .grad when it runs (ZeRO-2/3 give it a buffer then).
  void add_weight_gradients(std::function<void()> work);

  // The hooks called around this module's own forward and backward (null: none).
  void set_parameter_hooks(ParameterHooks* hooks) { hooks_ = hooks; }
  ParameterHooks* parameter_hooks() const { return hooks_; }
  // Direct children, in the order added.
  std::vector<Module*> children() const;
  // Whether this module creates parameters itself (not only its children).
  bool has_own_parameters() const { return !parameters_.empty(); }
  // Whether ZeRO-3 gathers this module's parameters as one unit even though
  // they sit in children (a Transformer block); see sharding_units().
  virtual bool shards_as_one_unit() const { return false; }

  // This module's parameters, then its children's (depth first, in the order
  // the children were added): a fixed order for a given architecture.
  std::vector<Parameter*> parameters();
  void train(bool training = true);  // also sets every child's mode
  void eval() { train(false); }
  bool training() const { return training_; }
  const std::string& name() const { return name_; }
  const ModelSpec& spec() const { return spec_; }
  Context& context() const { return *spec_.context; }

 protected:
  // The module's own forward and backward (see forward() and backward()).
  virtual Tensor forward_impl(const Tensor& input, Saved& saved, const Pass& pass) = 0;
  virtual Tensor backward_impl(const Tensor& grad_output, Saved& saved) = 0;
  // Whether backward_impl passes all its work on its own parameters'
  // gradients to add_weight_gradients (otherwise a backward in two halves
  // computes them during B into buffers of their own).
  virtual bool splits_backward() const { return false; }
  // The phase a use of parameters outside their module's own calls takes
  // for the weight-gradient work (the GPT head's tied table): backward in a
  // one-call backward, weight_gradient in the W step.
  ParameterPhase weight_gradient_phase() const {
    return later_ ? ParameterPhase::weight_gradient : ParameterPhase::backward;
  }

  // Creates a parameter named "<this name>.<local>" of `shape` in the spec's
  // dtype/device, with a zeroed f32 gradient (values are left to the caller's
  // initialiser, e.g. init_normal below).
  Parameter& add_parameter(const std::string& local, const Shape& shape, bool weight_decay);
  template <typename M, typename... Args>
  M& add_child(Args&&... args) {
    auto child = std::make_unique<M>(std::forward<Args>(args)...);
    M& ref = *child;
    children_.push_back(std::move(child));
    return ref;
  }
  std::string child_name(const std::string& local) const { return name_.empty() ? local : name_ + "." + local; }
  // Takes `child`, built elsewhere, as the next child (its names unchanged).
  Module& adopt_child(std::unique_ptr<Module> child) {
    children_.push_back(std::move(child));
    return *children_.back();
  }

  // Initialisers: element i of parameter p gets a value drawn from
  // (spec.seed, name_stream(p.name), i).
  void init_normal(Parameter& p, float stddev);
  void init_uniform(Parameter& p, float bound);
  void init_constant(Parameter& p, float value);

 private:
  ModelSpec spec_;
  std::string name_;
  bool training_ = true;
  ParameterHooks* hooks_ = nullptr;
  WeightGradients* later_ = nullptr;
  std::vector<std::unique_ptr<Parameter>> parameters_;
  std::vector<std::unique_ptr<Module>> children_;

  Tensor backward_input_half(const Tensor& grad_output, Saved& saved);
  void report_gradients_ready();
};

// The modules whose parameters ZeRO-2/3 keeps together (gathered, reduced
// and freed as one): walking down from `root`, a module that
// shards_as_one_unit() or holds parameters of its own is a unit with all its
// descendants' parameters; a module with neither is passed through to its
// children. For the GPT: the token and position embeddings, each block and
// the final norm; for the MLP and CNN, each layer with parameters. In
// parameter order; together they hold every parameter once.
std::vector<Module*> sharding_units(Module& root);

}  // namespace tessera::nn
