// MixtureOfExperts (see moe.h): the router, the dispatch plan, the experts
// on their contiguous rows, the combine, and the auxiliary losses.
#include "parallel/moe.h"

#include <bit>
#include <cmath>
#include <utility>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"

namespace tessera::parallel {

MoePlan moe_plan(const std::vector<int32_t>& experts, int64_t num_experts, int64_t capacity) {
  MoePlan plan;
  plan.chosen.assign(size_t(num_experts), 0);
  std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(num_experts));
  for (size_t pair = 0; pair < experts.size(); ++pair) {
    const int32_t e = experts[pair];
    TESSERA_CHECK(e >= 0 && e < num_experts, "moe: choice ", pair, " names expert ", e, " of ", num_experts);
    ++plan.chosen[size_t(e)];
    if (capacity <= 0 || int64_t(by_expert[size_t(e)].size()) < capacity) by_expert[size_t(e)].push_back(int32_t(pair));
  }
  plan.slot_of.assign(experts.size(), -1);
  plan.offsets.push_back(0);
  for (const std::vector<int32_t>& pairs : by_expert) {
    for (const int32_t pair : pairs) {
      plan.slot_of[size_t(pair)] = int32_t(plan.pairs.size());
      plan.pairs.push_back(pair);
    }
    plan.offsets.push_back(int64_t(plan.pairs.size()));
  }
  return plan;
}

namespace {

// Saved::tensors of a forward, by position.
enum SavedTensor : size_t { kProbs, kExperts, kWeights, kLogsumexp, kPairs, kSlotOf, kOutputs, kSavedTensors };

// A float kept exactly among Saved::scalars.
int64_t float_scalar(float value) {
  return int64_t(std::bit_cast<uint32_t>(value));
}
float scalar_float(int64_t value) {
  return std::bit_cast<float>(uint32_t(value));
}

// An expert no row reached runs no backward; its gradients (nothing added)
// are complete all the same, as on the ranks whose rows reached it, so a
// data-parallel replica's buckets and units fill alike on every rank.
void report_gradients_complete(nn::Module& expert) {
  for (nn::Parameter* p : expert.parameters())
    if (p->on_grad_ready) p->on_grad_ready(*p);
}

}  // namespace

struct MixtureOfExperts::Routing {
  std::vector<Tensor> routed;  // probs, experts, weights, logsumexp
  MoePlan plan;
  std::vector<double> chosen;  // per expert: the choices naming it over the sequence's ranks
  double tokens = 0;           // the tokens over the sequence's ranks
};

// Sums `values` over the ranks that hold parts of the same sequences.
void MixtureOfExperts::sum_over_token_groups(std::vector<double>& values) const {
  if (token_groups_.empty()) return;
  const std::vector<float> narrow(values.begin(), values.end());  // f32: counts exact below 2^24
  Tensor sums = context().from_vector(Shape{int64_t(values.size())}, narrow, Device::cpu());
  for (Communicator* group : token_groups_) group->all_reduce(sums, ReduceOp::sum)->wait();
  const std::vector<float> summed = sums.to_vector<float>();
  values.assign(summed.begin(), summed.end());
}

MixtureOfExperts::MixtureOfExperts(const nn::ModelSpec& spec, std::string name, int64_t hidden, MoeConfig config,
                                   float dropout, TensorParallelism tp)
    : Module(spec, std::move(name)), hidden_(hidden), config_(config) {
  TESSERA_CHECK(config_.num_experts >= 1, this->name(), ": --num-experts must be at least 1, got ",
                config_.num_experts);
  TESSERA_CHECK(config_.top_k >= 1 && config_.top_k <= config_.num_experts, this->name(), ": --moe-router-topk ",
                config_.top_k, " must be from 1 to --num-experts ", config_.num_experts);
  TESSERA_CHECK(config_.ffn_hidden >= 1, this->name(), ": --moe-ffn-hidden-size must be positive, got ",
                config_.ffn_hidden);
  TESSERA_CHECK(config_.capacity_factor >= 0 && config_.aux_loss_coeff >= 0 && config_.z_loss_coeff >= 0, this->name(),
                ": --moe-expert-capacity-factor, --moe-aux-loss-coeff and --moe-z-loss-coeff must not be negative");
  if (tp.experts && tp.experts->size() > 1)
    exchange_ = std::make_unique<ExpertExchange>(*tp.experts, config_.num_experts);
  if (tp.sequence_parallel && tp.size() > 1) token_groups_.push_back(tp.group);
  if (tp.context_size() > 1) token_groups_.push_back(tp.context);
  context_ranks_ = tp.context_size();
  router_ = &add_child<ColumnParallelLinear>(spec, child_name("router"), TensorParallelism{}, hidden,
                                             config_.num_experts, false);
  const int64_t first = exchange_ ? exchange_->first_expert() : 0;
  const int64_t held = exchange_ ? exchange_->local_experts() : config_.num_experts;
  for (int64_t e = first; e < first + held; ++e) {
    experts_.push_back(&add_child<ParallelGatedMlp>(spec, child_name("experts." + std::to_string(e)),
                                                    TensorParallelism{}, hidden, config_.ffn_hidden, 0.0f));
    if (exchange_)  // held by one rank of the ep group: its replicas are on the data axes only
      for (nn::Parameter* p : experts_.back()->parameters()) p->gradient_axes = {"dp", "cp"};
  }
  dropout_ = &add_child<TensorParallelDropout>(spec, child_name("dropout"), TensorParallelism{}, dropout);
}

MixtureOfExperts::~MixtureOfExperts() = default;

int64_t MixtureOfExperts::capacity(int64_t tokens) const {
  if (config_.capacity_factor <= 0) return 0;
  const double share = double(tokens * config_.top_k) / double(config_.num_experts);
  return std::max<int64_t>(1, int64_t(std::ceil(config_.capacity_factor * share)));
}

// The router's logits (f32), its choices, and the plan; the losses' values.
MixtureOfExperts::Routing MixtureOfExperts::route(const Tensor& tokens, nn::Saved& saved, const nn::Pass& pass) {
  const int64_t n = tokens.size(0), e = config_.num_experts, k = config_.top_k;
  const Tensor scores = router_->forward(tokens.view(Shape{1, n, hidden_}), saved.child(0), pass);
  Tensor logits = scores.view(Shape{n, e});
  if (logits.dtype() != DType::f32) {
    Tensor wide = context().empty(logits.shape(), DType::f32, logits.device());
    ops::cast(logits, wide);
    logits = wide;
  }
  Routing r;
  Context& ctx = context();
  r.routed = {ctx.empty(Shape{n, e}, DType::f32, logits.device()), ctx.empty(Shape{n, k}, DType::i32, logits.device()),
              ctx.empty(Shape{n, k}, DType::f32, logits.device()), ctx.empty(Shape{n}, DType::f32, logits.device())};
  ops::moe_route(logits, r.routed[kProbs], r.routed[kExperts], r.routed[kWeights], r.routed[kLogsumexp]);
  r.plan = moe_plan(r.routed[kExperts].to_vector<int32_t>(), e, capacity(n));
  // The losses' values (the load-balancing loss over the choices before
  // capacity), over the sequence's ranks: per expert its choices and summed
  // probability, then the tokens and the summed lse².
  const std::vector<float> probs = r.routed[kProbs].to_vector<float>(), lse = r.routed[kLogsumexp].to_vector<float>();
  std::vector<double> sums(size_t(2 * e + 2), 0.0);
  for (int64_t x = 0; x < e; ++x) sums[size_t(x)] = double(r.plan.chosen[size_t(x)]);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t x = 0; x < e; ++x) sums[size_t(e + x)] += probs[size_t(t * e + x)];
    sums[size_t(2 * e + 1)] += double(lse[size_t(t)]) * lse[size_t(t)];
  }
  sums[size_t(2 * e)] = double(n);
  sum_over_token_groups(sums);
  r.tokens = sums[size_t(2 * e)];
  double balance = 0.0;
  for (int64_t x = 0; x < e; ++x) balance += sums[size_t(x)] * sums[size_t(e + x)];
  r.chosen.assign(sums.begin(), sums.begin() + e);
  stats_.aux_loss = config_.aux_loss_coeff * double(e) / (r.tokens * r.tokens * double(k)) * balance;
  stats_.z_loss = config_.z_loss_coeff * sums[size_t(2 * e + 1)] / r.tokens;
  stats_.tokens_per_expert.clear();
  for (int64_t x = 0; x < e; ++x)
    stats_.tokens_per_expert.push_back(r.plan.offsets[size_t(x + 1)] - r.plan.offsets[size_t(x)]);
  stats_.dropped = n * k - int64_t(r.plan.pairs.size());
  return r;
}

// This rank's experts on their rows of `rows` [R, C] (expert l: rows
// [offsets[l], offsets[l + 1])); the outputs [R, C].
Tensor MixtureOfExperts::run_experts(const Tensor& rows, const std::vector<int64_t>& offsets, nn::Saved& saved,
                                     const nn::Pass& pass) {
  Tensor outputs = context().empty(rows.shape(), rows.dtype(), rows.device());
  for (size_t l = 0; l < experts_.size(); ++l) {
    const int64_t begin = offsets[l], end = offsets[l + 1];
    if (begin == end) continue;  // no token chose it (or all were dropped)
    const Tensor y =
        experts_[l]->forward(rows.slice(begin, end).view(Shape{1, end - begin, hidden_}), saved.child(1 + l), pass);
    Tensor into = outputs.slice(begin, end);
    into.copy_(y.view(into.shape()));
  }
  return outputs;
}

// The experts' outputs for `slots` [M, C] (grouped by expert, plan.offsets):
// run here, or, under expert parallelism, on the ranks that hold them.
Tensor MixtureOfExperts::experts_forward(const Tensor& slots, const MoePlan& plan, nn::Saved& saved,
                                         const nn::Pass& pass) {
  if (!exchange_) return run_experts(slots, plan.offsets, saved, pass);
  const Tensor rows = exchange_->dispatch(slots, plan.offsets);
  return exchange_->combine(run_experts(rows, exchange_->local_offsets(), saved, pass));
}

Tensor MixtureOfExperts::forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) {
  TESSERA_CHECK(input.ndim() >= 2 && input.shape()[-1] == hidden_, name(), ": the input must be [..., ", hidden_,
                "], got ", input.shape().to_string());
  saved.clear();
  const int64_t n = input.numel() / hidden_;
  const Tensor tokens = input.view(Shape{n, hidden_});
  Routing r = route(tokens, saved, pass);
  Context& ctx = context();
  const Tensor pairs = ctx.from_vector(Shape{int64_t(r.plan.pairs.size())}, r.plan.pairs, input.device());
  const Tensor slot_of = ctx.from_vector(Shape{n, config_.top_k}, r.plan.slot_of, input.device());
  Tensor slots = ctx.empty(Shape{pairs.size(0), hidden_}, input.dtype(), input.device());
  ops::moe_permute(tokens, pairs, config_.top_k, slots);
  const Tensor outputs = experts_forward(slots, r.plan, saved, pass);
  Tensor out = ctx.empty(tokens.shape(), input.dtype(), input.device());
  ops::moe_combine(outputs, slot_of, r.routed[kWeights], out);
  const Tensor y = dropout_->forward(out.view(input.shape()), saved.child(1 + experts_.size()), pass);
  if (!pass.kv_cache) {
    saved.tensors = {r.routed[kProbs], r.routed[kExperts], r.routed[kWeights], r.routed[kLogsumexp], pairs, slot_of,
                     outputs};
    saved.push_shape(input.shape());
    saved.scalars.push_back(float_scalar(pass.loss_gradient_scale));
    saved.scalars.insert(saved.scalars.end(), r.plan.offsets.begin(), r.plan.offsets.end());
    for (const double chosen : r.chosen) saved.scalars.push_back(int64_t(chosen));  // counts: exact
    saved.scalars.push_back(int64_t(r.tokens));
    saved.scalars.push_back(std::bit_cast<int64_t>(stats_.aux_loss));  // for the step's figures
    saved.scalars.push_back(std::bit_cast<int64_t>(stats_.z_loss));
  }
  return y;
}

// This rank's experts' backward on their rows of `grad_rows` [R, C]; the
// gradient of their inputs [R, C].
Tensor MixtureOfExperts::run_experts_backward(const Tensor& grad_rows, const std::vector<int64_t>& offsets,
                                              nn::Saved& saved) {
  Tensor grads = context().empty(grad_rows.shape(), grad_rows.dtype(), grad_rows.device());
  for (size_t l = 0; l < experts_.size(); ++l) {
    const int64_t begin = offsets[l], end = offsets[l + 1];
    if (begin == end) {
      add_weight_gradients([expert = experts_[l]] { report_gradients_complete(*expert); });
      continue;
    }
    const Tensor dx =
        experts_[l]->backward(grad_rows.slice(begin, end).view(Shape{1, end - begin, hidden_}), saved.child(1 + l));
    Tensor into = grads.slice(begin, end);
    into.copy_(dx.view(into.shape()));
  }
  return grads;
}

// The gradient of the slots' inputs from that of their outputs [M, C]: the
// exchange's two halves swapped (each is the other's adjoint) around the
// experts' backward; the dispatch's counts are the forward's.
Tensor MixtureOfExperts::experts_backward(const Tensor& grad_slots, const MoePlan& plan, nn::Saved& saved) {
  if (!exchange_) return run_experts_backward(grad_slots, plan.offsets, saved);
  const Tensor grad_rows = exchange_->dispatch(grad_slots, plan.offsets);
  return exchange_->combine(run_experts_backward(grad_rows, exchange_->local_offsets(), saved));
}

// The router's backward: the weights' gradient through ops::moe_route_backward
// with the load-balancing and z losses' gradients (scaled like the loss's),
// then the router's linear layer; the gradient of its input [N, C].
Tensor MixtureOfExperts::router_backward(const Tensor& grad_weights, const std::vector<Tensor>& routed,
                                         const MoePlan& plan, double tokens, float gradient_scale, nn::Saved& saved) {
  const int64_t n = routed[kProbs].size(0), e = config_.num_experts, k = config_.top_k;
  Context& ctx = context();
  const Device device = grad_weights.device();
  // With N the tokens and n_e the choices over the sequence's ranks:
  // d(balance)/d(p_te) = coeff·E/(N²K)·n_e for every token; d(z)/d(lse_t) = coeff·2·lse_t/N.
  std::vector<float> per_expert(size_t(n * e));
  // Gradients are averaged over the cp ranks, each holding its part of the
  // sequence's: the model's loss is each rank's mean, these losses are the
  // whole sequence's on every rank, so their parts count C times.
  const double scale = double(gradient_scale) * double(context_ranks_);
  const double balance = config_.aux_loss_coeff * double(e) / (tokens * tokens * double(k)) * scale;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t x = 0; x < e; ++x) per_expert[size_t(t * e + x)] = float(balance * double(plan.chosen[size_t(x)]));
  std::vector<float> lse = routed[kLogsumexp].to_vector<float>();
  for (float& v : lse) v = float(config_.z_loss_coeff * 2.0 * double(v) / tokens * scale);
  const Tensor grad_probs = ctx.from_vector(Shape{n, e}, per_expert, device);
  const Tensor grad_lse = ctx.from_vector(Shape{n}, lse, device);
  Tensor grad_logits = ctx.empty(Shape{n, e}, DType::f32, device);
  ops::moe_route_backward(routed[kProbs], routed[kExperts], routed[kWeights], grad_weights, &grad_probs, &grad_lse,
                          grad_logits);
  if (spec().dtype != DType::f32) {
    Tensor narrow = ctx.empty(grad_logits.shape(), spec().dtype, device);
    ops::cast(grad_logits, narrow);
    grad_logits = narrow;
  }
  return router_->backward(grad_logits.view(Shape{1, n, e}), saved.child(0)).view(Shape{n, hidden_});
}

Tensor MixtureOfExperts::backward_impl(const Tensor& grad_output, nn::Saved& saved) {
  nn::check_saved(*this, saved, kSavedTensors);
  const Shape input_shape = saved.shape_at(0);
  const size_t after_shape = size_t(input_shape.ndim()) + 1;
  const float gradient_scale = scalar_float(saved.scalars[after_shape]);
  const int64_t e = config_.num_experts, k = config_.top_k, n = input_shape.numel() / hidden_;
  MoePlan plan;
  const auto scalars = saved.scalars.begin() + long(after_shape) + 1;
  plan.offsets.assign(scalars, scalars + e + 1);
  plan.chosen.assign(scalars + e + 1, scalars + 2 * e + 1);  // over the sequence's ranks
  const double tokens = double(*(scalars + 2 * e + 1));
  add_to_step_stats(plan.offsets, n * k, std::bit_cast<double>(*(scalars + 2 * e + 2)),
                    std::bit_cast<double>(*(scalars + 2 * e + 3)));
  const std::vector<Tensor> routed(saved.tensors.begin(), saved.tensors.begin() + kPairs);
  const Tensor pairs = saved.tensors[kPairs], slot_of = saved.tensors[kSlotOf], outputs = saved.tensors[kOutputs];
  Context& ctx = context();
  const Tensor grad = dropout_->backward(grad_output, saved.child(1 + experts_.size())).view(Shape{n, hidden_});
  Tensor grad_slots = ctx.empty(outputs.shape(), outputs.dtype(), outputs.device());
  Tensor grad_weights = ctx.empty(Shape{n, k}, DType::f32, outputs.device());
  ops::moe_combine_backward(grad, outputs, pairs, slot_of, routed[kWeights], grad_slots, grad_weights);
  const Tensor grad_inputs = experts_backward(grad_slots, plan, saved);
  Tensor dx = ctx.empty(Shape{n, hidden_}, grad_output.dtype(), grad_output.device());
  ops::moe_permute_backward(grad_inputs, slot_of, dx);
  const Tensor from_router = router_backward(grad_weights, routed, plan, tokens, gradient_scale, saved);
  ops::axpy(1.0f, from_router, dx);
  saved.clear();
  return dx.view(input_shape);
}

void MixtureOfExperts::add_to_step_stats(const std::vector<int64_t>& offsets, int64_t choices, double aux_loss,
                                         double z_loss) {
  MoeStepStats& s = step_stats_;
  s.tokens_per_expert.resize(size_t(config_.num_experts), 0);
  for (int64_t x = 0; x < config_.num_experts; ++x) s.tokens_per_expert[size_t(x)] += offsets[size_t(x + 1)] - offsets[size_t(x)];
  s.dropped += choices - offsets.back();
  s.aux_loss += aux_loss;
  s.z_loss += z_loss;
  s.micro_batches += 1;
}

MoeStepStats MixtureOfExperts::take_step_stats() {
  MoeStepStats taken = std::move(step_stats_);
  step_stats_ = MoeStepStats{};
  taken.tokens_per_expert.resize(size_t(config_.num_experts), 0);
  return taken;
}

namespace {

void collect_mixtures(nn::Module& module, std::vector<MixtureOfExperts*>& found) {
  if (auto* moe = dynamic_cast<MixtureOfExperts*>(&module)) {
    found.push_back(moe);
    return;
  }
  for (nn::Module* child : module.children()) collect_mixtures(*child, found);
}

}  // namespace

std::vector<MixtureOfExperts*> mixtures_of_experts(nn::Module& root) {
  std::vector<MixtureOfExperts*> found;
  collect_mixtures(root, found);
  return found;
}

}  // namespace tessera::parallel
