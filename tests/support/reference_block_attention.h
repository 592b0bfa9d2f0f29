// The double-precision reference of blockwise causal attention with global
// positions (ops::attention_block_*, parallel::RingAttention), for the kernel
// and MPI tests: the textbook computation over explicit score rows, each
// query head h reading key/value head h / (H/G) (repeat_kv), key s visible to
// query t iff k_pos[s] ≤ q_pos[t]. Whole-sequence causal attention is the
// case q_pos = k_pos = 0, 1, ..., T − 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::testing {

struct BlockProblem {
  int64_t batch, heads, groups, head_dim;  // B, H, G, Dh
  double scale;                            // the score scale used, e.g. 1/√Dh
  std::vector<int64_t> q_pos, k_pos;       // [Tq], [Tk]

  int64_t queries() const { return int64_t(q_pos.size()); }
  int64_t keys() const { return int64_t(k_pos.size()); }
  // q, out, grad_out [B, Tq, H, Dh]; kv [B, Tk, G, 2, Dh] (which: 0 key, 1 value); lse [B, H, Tq].
  size_t q_index(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return size_t(((b * queries() + t) * heads + h) * head_dim + d);
  }
  size_t kv_index(int64_t b, int64_t s, int64_t g, int which, int64_t d) const {
    return size_t((((b * keys() + s) * groups + g) * 2 + which) * head_dim + d);
  }
  size_t lse_index(int64_t b, int64_t h, int64_t t) const { return size_t((b * heads + h) * queries() + t); }
  int64_t group_of(int64_t h) const { return h / (heads / groups); }
};

struct BlockReference {
  std::vector<double> out;  // [B, Tq, H, Dh]; 0 where no key is visible
  std::vector<double> lse;  // [B, H, Tq]; −∞ where no key is visible
};
BlockReference reference_block_attention(const BlockProblem& problem, const std::vector<double>& q,
                                         const std::vector<double>& kv);

// The block's terms of the gradients of Σ grad_out·out, given the FINAL
// output and logsumexp over every block (final_out as the operator stores it):
// P = e^(scale·q·k − lse), dS = P∘(dO·v − rowsum(dO∘final_out)),
// dq = scale·dS·K, dk = scale·dSᵀ·Q, dv = Pᵀ·dO over the visible pairs.
struct BlockGradients {
  std::vector<double> q;   // [B, Tq, H, Dh]
  std::vector<double> kv;  // [B, Tk, G, 2, Dh]
};
BlockGradients reference_block_backward(const BlockProblem& problem, const std::vector<double>& q,
                                        const std::vector<double>& kv, const std::vector<double>& grad_out,
                                        const std::vector<double>& final_out, const std::vector<double>& final_lse);

// first, first + 1, ..., first + count − 1.
std::vector<int64_t> consecutive_positions(int64_t first, int64_t count);

// The tokens at `positions` (in that order) of every sequence of `values`,
// laid out [B, T, per token...]: a rank's share of a whole sequence's tensor
// (of logsumexp [B, H, T] with batch = B·H).
std::vector<double> tokens_at(const std::vector<double>& values, int64_t batch, int64_t seq_len,
                              const std::vector<int64_t>& positions);

// −∞ (a row that saw nothing) replaced by a finite marker, so that rows which
// saw nothing compare equal and NaN still fails (all_close never passes NaN).
std::vector<double> mark_empty_rows(std::vector<double> lse);

}  // namespace tessera::testing
