// CpuBackend: blockwise causal attention with global positions (context
// parallelism's ring; ops::attention_block_*). The forward and backward run
// the tiles of kernels/cpu/attention_tiles.h, the training attention's
// blocked kernel, with visibility by the tokens' global positions (a tile
// pair no query sees is skipped) and f32 outputs: the forward stores the
// block's out and logsumexp, the backward adds the block's terms to grad_q
// and grad_kv. No two tasks write the same output, so the results are
// deterministic. The merge runs the shared functor, a row per index.
#include "kernels/functors/block_attention.h"

#include <algorithm>

#include "core/context.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

using namespace cpu_attention;

// A call's layout (BlockRows) in the terms of the tile code: queries, out
// and grad_out [B, Tq, H, Dh], keys and values from kv [B, Tk, G, 2, Dh].
struct BlockLayout {
  BlockRows rows;
  int64_t padded_dim;  // head_dim rounded up to kLanes

  int64_t batch() const { return rows.batch; }
  int64_t queries() const { return rows.queries; }
  int64_t keys() const { return rows.keys; }
  int64_t heads() const { return rows.heads; }
  int64_t groups() const { return rows.groups; }
  int64_t head_dim() const { return rows.head_dim; }
  int64_t group_of(int64_t h) const { return rows.group_of(h); }
  int64_t query_stride() const { return rows.heads * rows.head_dim; }
  int64_t kv_stride() const { return rows.groups * 2 * rows.head_dim; }
  int64_t out_stride() const { return query_stride(); }
  int64_t query_offset(int64_t b, int64_t t, int64_t h) const { return rows.query_offset(b, t, h); }
  int64_t key_offset(int64_t b, int64_t s, int64_t g) const { return rows.key_offset(b, s, g); }
  int64_t value_offset(int64_t b, int64_t s, int64_t g) const { return rows.value_offset(b, s, g); }
  int64_t out_offset(int64_t b, int64_t t, int64_t h) const { return rows.query_offset(b, t, h); }
  int64_t stats_offset(int64_t b, int64_t h, int64_t t) const { return rows.stats_offset(b, h, t); }
};

BlockLayout layout_of(const Tensor& q, const Tensor& kv) {
  const BlockRows rows = block_rows_of(q.shape(), kv.shape());
  return BlockLayout{rows, round_up(rows.head_dim, kLanes)};
}

TilePositions positions_of(const Tensor& q_positions, const Tensor& k_positions) {
  return TilePositions(q_positions.data<int64_t>(), q_positions.numel(), k_positions.data<int64_t>(),
                       k_positions.numel());
}

}  // namespace

void CpuBackend::attention_block_forward(const Tensor& q, const Tensor& kv, const Tensor& q_positions,
                                         const Tensor& k_positions, Tensor& out, Tensor& logsumexp, float scale) {
  const BlockLayout g = layout_of(q, kv);
  const TilePositions positions = positions_of(q_positions, k_positions);
  dispatch_float(q.dtype(), "attention_block_forward", [&](auto tag) {
    using T = decltype(tag);
    const ForwardOperands<T, float> x{q.data<T>(), kv.data<T>(), out.data<float>(), logsumexp.data<float>()};
    run_forward_tiles(q.context(), g, positions, x, attention_scale(scale, g.head_dim()), ops::AttentionDropout{});
  });
}

void CpuBackend::attention_block_merge(const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out,
                                       Tensor& logsumexp) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / out.size(3));
  cpu_for_each_index(block_rows_of(out.shape()).query_rows(), block_merge(block_out, block_logsumexp, out, logsumexp),
                     grain);
}

void CpuBackend::attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,
                                          const Tensor& logsumexp, const Tensor& q_positions, const Tensor& k_positions,
                                          Tensor& grad_q, Tensor& grad_kv, float scale) {
  const BlockLayout g = layout_of(q, kv);
  const TilePositions positions = positions_of(q_positions, k_positions);
  const BlockRows& rows = g.rows;
  Tensor delta = q.context().empty(Shape{rows.batch, rows.heads, rows.queries}, DType::f32);
  dispatch_float(q.dtype(), "attention_block_backward", [&](auto tag) {
    using T = decltype(tag);
    const AttentionDelta<T> delta_op{grad_out.data<T>(), out.data<T>(), delta.data<float>(),
                                     rows.queries,       rows.heads,    rows.head_dim};
    cpu_for_each_index(rows.query_rows(), delta_op, std::max<int64_t>(1, (int64_t(1) << 14) / rows.head_dim));
    const BackwardOperands<T, float> x{grad_out.data<T>(),      q.data<T>(),         kv.data<T>(),
                                       logsumexp.data<float>(), delta.data<float>(), grad_q.data<float>(),
                                       grad_kv.data<float>()};
    run_backward_tiles<true>(q.context(), g, positions, x, attention_scale(scale, g.head_dim()),
                             ops::AttentionDropout{});
  });
}

}  // namespace tessera
