// Mixture-of-experts routing (ops::moe_route / moe_route_backward in
// kernels/ops.h) as row functors shared by the CPU and CUDA backends: one
// index per token, each walking its E router logits (E is tens to a few
// hundred). The router is Mixtral's: the softmax over every expert, the k
// most likely experts (ties: the lower index first), their probabilities
// renormalised to sum to one; this equals Megatron-Core's softmax over the
// top-k logits. The full softmax and its logsumexp are kept for the
// load-balancing and z losses.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "kernels/functors/float_math.h"

namespace tessera {

struct MoeRoute {
  const float* logits;  // [N, E]
  float* probs;         // [N, E]
  int32_t* experts;     // [N, K], most likely first
  float* weights;       // [N, K], summing to 1 per token
  float* logsumexp;     // [N]
  int64_t num_experts, top_k;

  TESSERA_HD void operator()(int64_t token) const {
    const float* l = logits + token * num_experts;
    float* p = probs + token * num_experts;
    float top = l[0];
    for (int64_t e = 1; e < num_experts; ++e) top = l[e] > top ? l[e] : top;
    float sum = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) sum += exp_f32(l[e] - top);
    const float lse = top + logf(sum);
    logsumexp[token] = lse;
    for (int64_t e = 0; e < num_experts; ++e) p[e] = exp_f32(l[e] - lse);
    int32_t* chosen = experts + token * top_k;
    float* w = weights + token * top_k;
    float kept = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        if (taken(chosen, j, e)) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      chosen[j] = int32_t(best);
      w[j] = p[best];
      kept += p[best];
    }
    for (int64_t j = 0; j < top_k; ++j) w[j] /= kept;
  }

  // Whether expert e is among the first j chosen.
  TESSERA_HD static bool taken(const int32_t* chosen, int64_t j, int64_t e) {
    for (int64_t i = 0; i < j; ++i)
      if (chosen[i] == e) return true;
    return false;
  }
};

// d(loss)/d(logits) of one token from the gradients of its weights (g_j),
// of its probabilities (the load-balancing loss's; null: none) and of its
// logsumexp (the z-loss's; null: none). With Z the chosen probabilities'
// sum and G = Σ_j g_j·w_j, the probability of expert i gets
// q_i = grad_probs_i + [i chosen](g_i − G)/Z, and then the softmax's
// d logits_i = p_i·(q_i − Σ_m p_m·q_m) + grad_logsumexp·p_i.
struct MoeRouteBackward {
  const float* probs;           // [N, E]
  const int32_t* experts;       // [N, K]
  const float* weights;         // [N, K]
  const float* grad_weights;    // [N, K]
  const float* grad_probs;      // [N, E] or null
  const float* grad_logsumexp;  // [N] or null
  float* grad_logits;           // [N, E]
  int64_t num_experts, top_k;

  TESSERA_HD void operator()(int64_t token) const {
    const float* p = probs + token * num_experts;
    const int32_t* chosen = experts + token * top_k;
    const float* w = weights + token * top_k;
    const float* g = grad_weights + token * top_k;
    float* out = grad_logits + token * num_experts;
    float kept = 0.0f, mean = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      kept += p[chosen[j]];
      mean += g[j] * w[j];
    }
    // q_i into out, then the softmax's backward in place.
    float dot = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) {
      float q = grad_probs ? grad_probs[token * num_experts + e] : 0.0f;
      for (int64_t j = 0; j < top_k; ++j)
        if (chosen[j] == e) q += (g[j] - mean) / kept;
      out[e] = q;
      dot += p[e] * q;
    }
    const float z = grad_logsumexp ? grad_logsumexp[token] : 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) out[e] = p[e] * (out[e] - dot) + z * p[e];
  }
};

}  // namespace tessera
