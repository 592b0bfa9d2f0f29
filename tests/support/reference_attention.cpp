// The double-precision attention reference of reference_attention.h.
#include "tests/support/reference_attention.h"

#include <algorithm>
#include <cmath>

namespace tessera::testing {
namespace {

// q, k, v of every query head [B, H, T, Dh], copied out of qkv: a grouped
// layout's key and value once per head of the group (repeat_kv).
struct Heads {
  std::vector<double> q, k, v;
};

size_t head_index(const AttentionProblem& p, int64_t b, int64_t h, int64_t t, int64_t d) {
  return size_t(((b * p.heads + h) * p.seq_len + t) * p.head_dim + d);
}

Heads per_head(const AttentionProblem& p, const std::vector<double>& qkv) {
  const size_t n = size_t(p.batch * p.heads * p.seq_len * p.head_dim);
  Heads x{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t t = 0; t < p.seq_len; ++t)
        for (int64_t d = 0; d < p.head_dim; ++d) {
          x.q[head_index(p, b, h, t, d)] = qkv[p.qkv_index(b, t, 0, h, d)];
          x.k[head_index(p, b, h, t, d)] = qkv[p.qkv_index(b, t, 1, h, d)];
          x.v[head_index(p, b, h, t, d)] = qkv[p.qkv_index(b, t, 2, h, d)];
        }
  return x;
}

double multiplier(const AttentionMask& mask, int64_t b, int64_t h, int64_t t, int64_t s) {
  return mask ? mask(b, h, t, s) : 1.0;
}

}  // namespace

AttentionReference reference_attention(const AttentionProblem& p, const std::vector<double>& qkv,
                                       const AttentionMask& mask) {
  const int64_t T = p.seq_len, D = p.head_dim, H = p.heads;
  const Heads x = per_head(p, qkv);
  AttentionReference ref{std::vector<double>(size_t(p.batch * T * H * D)), std::vector<double>(size_t(p.batch * H * T)),
                         std::vector<double>(size_t(p.batch * H * T * T), 0.0)};
  std::vector<double> scores(static_cast<size_t>(T));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        double max = -INFINITY;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += x.q[head_index(p, b, h, t, d)] * x.k[head_index(p, b, h, s, d)];
          scores[size_t(s)] = p.scale * dot;
          max = std::max(max, scores[size_t(s)]);
        }
        double sum = 0;
        for (int64_t s = 0; s <= t; ++s) sum += std::exp(scores[size_t(s)] - max);
        double* probs = &ref.probs[size_t(((b * H + h) * T + t) * T)];
        for (int64_t s = 0; s <= t; ++s) probs[s] = std::exp(scores[size_t(s)] - max) / sum;
        ref.lse[p.lse_index(b, h, t)] = max + std::log(sum);
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t s = 0; s <= t; ++s)
            acc += probs[s] * multiplier(mask, b, h, t, s) * x.v[head_index(p, b, h, s, d)];
          ref.out[p.out_index(b, t, h, d)] = acc;
        }
      }
  return ref;
}

std::vector<double> reference_attention_backward(const AttentionProblem& p, const std::vector<double>& qkv,
                                                 const std::vector<double>& grad_out,
                                                 const std::vector<double>& stored_out, const AttentionMask& mask) {
  const int64_t T = p.seq_len, D = p.head_dim, H = p.heads;
  const AttentionReference ref = reference_attention(p, qkv, mask);
  const Heads x = per_head(p, qkv);
  Heads grad{std::vector<double>(x.q.size(), 0.0), std::vector<double>(x.q.size(), 0.0),
             std::vector<double>(x.q.size(), 0.0)};
  std::vector<double> dp(static_cast<size_t>(T));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const double* probs = &ref.probs[size_t(((b * H + h) * T + t) * T)];
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += grad_out[p.out_index(b, t, h, d)] * x.v[head_index(p, b, h, s, d)];
          dp[size_t(s)] = dot * multiplier(mask, b, h, t, s);
        }
        double row = 0;
        for (int64_t d = 0; d < D; ++d) row += grad_out[p.out_index(b, t, h, d)] * stored_out[p.out_index(b, t, h, d)];
        for (int64_t s = 0; s <= t; ++s) {
          const double ds = probs[s] * (dp[size_t(s)] - row);
          const double dropped = probs[s] * multiplier(mask, b, h, t, s);
          for (int64_t d = 0; d < D; ++d) {
            grad.q[head_index(p, b, h, t, d)] += p.scale * ds * x.k[head_index(p, b, h, s, d)];
            grad.k[head_index(p, b, h, s, d)] += p.scale * ds * x.q[head_index(p, b, h, t, d)];
            grad.v[head_index(p, b, h, s, d)] += dropped * grad_out[p.out_index(b, t, h, d)];
          }
        }
      }
  // Each head's gradients into the elements it read: a group's key and value
  // collect the sum over the group's heads.
  std::vector<double> grad_qkv(qkv.size(), 0.0);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) {
          grad_qkv[p.qkv_index(b, t, 0, h, d)] += grad.q[head_index(p, b, h, t, d)];
          grad_qkv[p.qkv_index(b, t, 1, h, d)] += grad.k[head_index(p, b, h, t, d)];
          grad_qkv[p.qkv_index(b, t, 2, h, d)] += grad.v[head_index(p, b, h, t, d)];
        }
  return grad_qkv;
}

std::vector<double> stored_output_rounding(const AttentionProblem& p, const std::vector<double>& qkv,
                                           const std::vector<double>& grad_out, const std::vector<double>& stored_out,
                                           const AttentionMask& mask) {
  std::vector<double> change = reference_attention_backward(p, qkv, grad_out, stored_out, mask);
  const std::vector<double> exact =
      reference_attention_backward(p, qkv, grad_out, reference_attention(p, qkv, mask).out, mask);
  for (size_t i = 0; i < change.size(); ++i) change[i] -= exact[i];
  return change;
}

}  // namespace tessera::testing
