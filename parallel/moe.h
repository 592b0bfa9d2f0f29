// MixtureOfExperts: the MLP of a mixture-of-experts block (Mixtral,
// Megatron-Core's MoE layer). Each token's hidden state goes to the top-k of
// E SwiGLU experts chosen by a linear router, and their outputs are summed
// with the router's weights:
//
//   logits = x·routerᵀ (f32)  →  ops::moe_route: softmax over the E experts,
//   the k most likely, their probabilities renormalised (Mixtral's router)
//   →  a dispatch plan (each expert's tokens contiguous, in token order;
//   choices over an expert's capacity dropped, the later tokens first)
//   →  ops::moe_permute  →  each expert's GEMMs on its rows (experts.<e>, a
//   ParallelGatedMlp: fc [2F, C] = [w1; w3], proj [C, F] = w2)  →
//   ops::moe_combine with the weights  →  dropout (the MLP's, --hidden-dropout).
//
// Its own losses, added to the model's (their gradients scaled like the
// loss's, nn::Pass::loss_gradient_scale):
//   load balancing (Switch Transformer; Megatron-Core's): coeff · E/(N²·K) ·
//     Σ_e n_e·Σ_t p_te, with n_e the choices of expert e (before capacity)
//     and p the router's whole softmax, over the layer's N tokens;
//   z-loss (ST-MoE): coeff · mean_t logsumexp(logits_t)².
// Capacity (MoeConfig::capacity_factor > 0): each expert keeps at most
// ceil(factor · N·K / E) of the choices that name it, in token order (the
// first tokens of the micro-batch; Megatron's "position" drop policy); 0:
// dropless, every choice kept.
//
// The plan is built on the host from the chosen experts (one device-to-host
// copy of [N, K] indices per forward, as every dropless MoE must know its
// counts). Under expert parallelism (an ep group of P ranks) each rank
// holds E/P experts and routes its own tokens; their slots travel to the
// experts' ranks and back (parallel::ExpertExchange), forward and backward.
// The losses are over the micro-batch's tokens on this rank (Megatron-Core's
// per-micro-batch auxiliary loss), counting a sequence split over ranks
// whole: under sequence parallelism (the tp group) and context parallelism
// (the cp group) their counts, probabilities and token numbers are summed
// over those groups first.
//
// Under tensor parallelism the experts are not split: every tp rank holds
// the router and its experts whole. Without sequence parallelism the tp
// ranks hold the same tokens and compute the same (their gradients agree);
// with it each routes its own part of the sequence, and the router's and
// experts' gradients are partial sums, which the block sums over the group
// (SequenceParallelGradients).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "parallel/expert_exchange.h"
#include "parallel/llama_layers.h"
#include "parallel/tensor_parallel.h"

namespace tessera::parallel {

struct MoeConfig {
  int64_t num_experts = 8;     // --num-experts
  int64_t top_k = 2;           // --moe-router-topk
  int64_t ffn_hidden = 0;      // --moe-ffn-hidden-size: each expert's F
  double capacity_factor = 0;  // --moe-expert-capacity-factor (0: dropless)
  double aux_loss_coeff = 0;   // --moe-aux-loss-coeff
  double z_loss_coeff = 0;     // --moe-z-loss-coeff
};

// What one forward routed: the losses' values and the load per expert.
struct MoeStats {
  double aux_loss = 0, z_loss = 0;         // with their coefficients
  std::vector<int64_t> tokens_per_expert;  // choices kept per expert
  int64_t dropped = 0;                     // choices dropped over capacity
};

// What a step's micro-batches routed through one layer, added up in each
// backward (once per micro-batch, also under recomputation).
struct MoeStepStats {
  std::vector<int64_t> tokens_per_expert;  // choices kept per expert
  int64_t dropped = 0;                     // choices dropped over capacity
  double aux_loss = 0, z_loss = 0;         // summed over the micro-batches, with their coefficients
  int micro_batches = 0;
};

// Where each choice goes: pairs[m] = t·K + j for the M kept slots, grouped by
// expert in token order; slot_of[t·K + j] = m or −1; offsets[e] the first
// slot of expert e (offsets[E] = M); chosen[e] the choices naming e before
// capacity (the load-balancing loss counts them).
struct MoePlan {
  std::vector<int32_t> pairs, slot_of;
  std::vector<int64_t> offsets, chosen;
};
// The plan of N tokens' choices `experts` [N·K] over E experts, each keeping
// at most `capacity` (≤ 0: no limit).
MoePlan moe_plan(const std::vector<int32_t>& experts, int64_t num_experts, int64_t capacity);

class MixtureOfExperts : public nn::Module {
 public:
  // tp.experts: the ep group (null or one rank: every expert here); this
  // rank then holds experts [r·E/P, (r+1)·E/P), named by their global index.
  // tp.group under sequence parallelism and tp.context: the ranks the
  // losses' statistics are summed over (see above).
  MixtureOfExperts(const nn::ModelSpec& spec, std::string name, int64_t hidden, MoeConfig config, float dropout,
                   TensorParallelism tp = {});
  ~MixtureOfExperts() override;
  // input [..., C] → [..., C]
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;

  // ZeRO-2/3 gather, reduce and free the router and the experts together
  // (an expert no token reaches runs no forward; the unit does): the
  // data-parallel replica splits the unit by gradient group.
  bool shards_as_one_unit() const override { return true; }

  const MoeConfig& config() const { return config_; }
  const MoeStats& last_stats() const { return stats_; }
  // The step's figures so far, and a fresh start for the next step.
  MoeStepStats take_step_stats();
  ColumnParallelLinear& router() { return *router_; }
  // This rank's experts, in order (all of them without expert parallelism).
  const std::vector<ParallelGatedMlp*>& experts() const { return experts_; }

 private:
  struct Routing;
  Routing route(const Tensor& tokens, nn::Saved& saved, const nn::Pass& pass);
  Tensor experts_forward(const Tensor& slots, const MoePlan& plan, nn::Saved& saved, const nn::Pass& pass);
  Tensor run_experts(const Tensor& rows, const std::vector<int64_t>& offsets, nn::Saved& saved, const nn::Pass& pass);
  Tensor experts_backward(const Tensor& grad_slots, const MoePlan& plan, nn::Saved& saved);
  Tensor run_experts_backward(const Tensor& grad_rows, const std::vector<int64_t>& offsets, nn::Saved& saved);
  Tensor router_backward(const Tensor& grad_weights, const std::vector<Tensor>& routed, const MoePlan& plan,
                         double tokens, float gradient_scale, nn::Saved& saved);
  int64_t capacity(int64_t tokens) const;
  void sum_over_token_groups(std::vector<double>& values) const;
  void add_to_step_stats(const std::vector<int64_t>& offsets, int64_t choices, double aux_loss, double z_loss);

  int64_t hidden_;
  MoeConfig config_;
  std::unique_ptr<ExpertExchange> exchange_;  // expert parallelism (null: every expert here)
  ColumnParallelLinear* router_;
  std::vector<ParallelGatedMlp*> experts_;
  TensorParallelDropout* dropout_;           // --hidden-dropout on the combined output
  std::vector<Communicator*> token_groups_;  // tp under sequence parallelism, cp: one sequence's ranks
  int context_ranks_ = 1;                    // cp: the losses' gradients count this many times
  MoeStats stats_;
  MoeStepStats step_stats_;
};

// The mixture-of-experts layers of `root`, in parameter order.
std::vector<MixtureOfExperts*> mixtures_of_experts(nn::Module& root);

}  // namespace tessera::parallel
