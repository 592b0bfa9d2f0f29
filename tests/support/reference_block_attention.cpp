// The double reference of blockwise causal attention with global positions
// (see reference_block_attention.h): explicit score rows, explicit softmax.
#include "tests/support/reference_block_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace tessera::testing {
namespace {

double score(const BlockProblem& p, const std::vector<double>& q, const std::vector<double>& kv, int64_t b, int64_t t,
             int64_t h, int64_t s) {
  double dot = 0.0;
  for (int64_t d = 0; d < p.head_dim; ++d) dot += q[p.q_index(b, t, h, d)] * kv[p.kv_index(b, s, p.group_of(h), 0, d)];
  return p.scale * dot;
}

bool visible(const BlockProblem& p, int64_t t, int64_t s) {
  return p.k_pos[size_t(s)] <= p.q_pos[size_t(t)];
}

}  // namespace

BlockReference reference_block_attention(const BlockProblem& p, const std::vector<double>& q,
                                         const std::vector<double>& kv) {
  BlockReference ref{std::vector<double>(size_t(p.batch * p.queries() * p.heads * p.head_dim), 0.0),
                     std::vector<double>(size_t(p.batch * p.heads * p.queries()))};
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t t = 0; t < p.queries(); ++t) {
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t s = 0; s < p.keys(); ++s)
          if (visible(p, t, s)) max = std::max(max, score(p, q, kv, b, t, h, s));
        double& lse = ref.lse[p.lse_index(b, h, t)];
        lse = max;
        if (std::isinf(max)) continue;
        double sum = 0.0;
        for (int64_t s = 0; s < p.keys(); ++s)
          if (visible(p, t, s)) sum += std::exp(score(p, q, kv, b, t, h, s) - max);
        lse = max + std::log(sum);
        for (int64_t s = 0; s < p.keys(); ++s) {
          if (!visible(p, t, s)) continue;
          const double prob = std::exp(score(p, q, kv, b, t, h, s) - lse);
          for (int64_t d = 0; d < p.head_dim; ++d)
            ref.out[p.q_index(b, t, h, d)] += prob * kv[p.kv_index(b, s, p.group_of(h), 1, d)];
        }
      }
  return ref;
}

BlockGradients reference_block_backward(const BlockProblem& p, const std::vector<double>& q,
                                        const std::vector<double>& kv, const std::vector<double>& grad_out,
                                        const std::vector<double>& final_out, const std::vector<double>& final_lse) {
  BlockGradients grads{std::vector<double>(q.size(), 0.0), std::vector<double>(kv.size(), 0.0)};
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t t = 0; t < p.queries(); ++t) {
        double delta = 0.0;
        for (int64_t d = 0; d < p.head_dim; ++d)
          delta += grad_out[p.q_index(b, t, h, d)] * final_out[p.q_index(b, t, h, d)];
        const int64_t g = p.group_of(h);
        for (int64_t s = 0; s < p.keys(); ++s) {
          if (!visible(p, t, s)) continue;
          const double prob = std::exp(score(p, q, kv, b, t, h, s) - final_lse[p.lse_index(b, h, t)]);
          double dp = 0.0;
          for (int64_t d = 0; d < p.head_dim; ++d)
            dp += grad_out[p.q_index(b, t, h, d)] * kv[p.kv_index(b, s, g, 1, d)];
          const double ds = prob * (dp - delta);
          for (int64_t d = 0; d < p.head_dim; ++d) {
            grads.q[p.q_index(b, t, h, d)] += p.scale * ds * kv[p.kv_index(b, s, g, 0, d)];
            grads.kv[p.kv_index(b, s, g, 0, d)] += p.scale * ds * q[p.q_index(b, t, h, d)];
            grads.kv[p.kv_index(b, s, g, 1, d)] += prob * grad_out[p.q_index(b, t, h, d)];
          }
        }
      }
  return grads;
}

std::vector<int64_t> consecutive_positions(int64_t first, int64_t count) {
  std::vector<int64_t> positions(static_cast<size_t>(count));
  std::iota(positions.begin(), positions.end(), first);
  return positions;
}

std::vector<double> tokens_at(const std::vector<double>& values, int64_t batch, int64_t seq_len,
                              const std::vector<int64_t>& positions) {
  const int64_t per_token = int64_t(values.size()) / (batch * seq_len);
  std::vector<double> held;
  for (int64_t b = 0; b < batch; ++b)
    for (const int64_t t : positions) {
      const auto first = values.begin() + (b * seq_len + t) * per_token;
      held.insert(held.end(), first, first + per_token);
    }
  return held;
}

std::vector<double> mark_empty_rows(std::vector<double> lse) {
  for (double& v : lse)
    if (std::isinf(v) && v < 0) v = -1e30;
  return lse;
}

}  // namespace tessera::testing
