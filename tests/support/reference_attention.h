// The double-precision reference of causal scaled-dot-product attention for
// the kernel tests of both projection layouts (the GPT's packed qkv
// [B, T, 3, H, Dh], Llama's grouped [B, T, G, R + 2, Dh]): the textbook
// computation with the full T×T score matrix of each head, softmaxed
// explicitly over s ≤ t, and its textbook backward. A layout enters only
// through `qkv_index`; for grouped projections it points every query head of
// a group at the group's key and value, so the reference first copies them
// out per head (Hugging Face's repeat_kv) and, in the backward, adds each
// copy's gradient back into its group. Dropout on the probabilities enters
// through an AttentionMask, the multiplier of each probability.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace tessera::testing {

struct AttentionProblem {
  int64_t batch, seq_len, heads, head_dim;  // B, T, H (query heads), Dh
  double scale;                             // the score scale used, e.g. 1/√Dh
  // Index among the flat qkv values of element d of the query (which 0), key
  // (1) or value (2) that query head h uses at token t of sequence b.
  std::function<size_t(int64_t b, int64_t t, int which, int64_t h, int64_t d)> qkv_index;

  size_t out_index(int64_t b, int64_t t, int64_t h, int64_t d) const {  // out [B, T, H, Dh]
    return size_t(((b * seq_len + t) * heads + h) * head_dim + d);
  }
  size_t lse_index(int64_t b, int64_t h, int64_t t) const {  // logsumexp [B, H, T]
    return size_t((b * heads + h) * seq_len + t);
  }
};

// Dropout: the multiplier of probability (t, s) of query head h of sequence
// b, M[b, h, t, s]/(1 − p) (0 or 1/(1 − p)); empty: no dropout (every multiplier 1).
using AttentionMask = std::function<double(int64_t b, int64_t h, int64_t t, int64_t s)>;

struct AttentionReference {
  std::vector<double> out, lse;  // [B, T, H, Dh], [B, H, T]
  std::vector<double> probs;     // [B, H, T, T], zero above the diagonal (undropped)
};

// out = (P∘mask)·V; lse and probs those of the undropped softmax.
AttentionReference reference_attention(const AttentionProblem& problem, const std::vector<double>& qkv,
                                       const AttentionMask& mask = {});

// The gradient with respect to qkv (its layout) of Σ grad_out·out:
//   dV = (P∘mask)ᵀ·dO, dP = (dO·Vᵀ)∘mask, dS = P∘(dP − rowsum(dO∘O)), dQ = scale·dS·K, dK = scale·dSᵀ·Q
// per head, summed into the elements each head read. `stored_out` is the
// forward output as the operator's backward receives it (rounded to the
// dtype): the operator computes rowsum(dO∘O) from it, so the reference does too.
std::vector<double> reference_attention_backward(const AttentionProblem& problem, const std::vector<double>& qkv,
                                                 const std::vector<double>& grad_out,
                                                 const std::vector<double>& stored_out, const AttentionMask& mask = {});

// What reading rowsum(dO∘O) from `stored_out` (the output rounded to the
// operator's dtype) instead of the exact output changes in the gradient:
// reference_attention_backward from stored_out minus from the exact output.
// Central differences of the exact forward plus this are what an operator
// that reads its stored output computes; it matters for bf16/f16 under
// dropout, where 1/(1 − p)·v rounds even in a row of one key.
std::vector<double> stored_output_rounding(const AttentionProblem& problem, const std::vector<double>& qkv,
                                           const std::vector<double>& grad_out, const std::vector<double>& stored_out,
                                           const AttentionMask& mask);

}  // namespace tessera::testing
