// CpuBackend: causal attention over a sequence's projections, blocked like
// flash attention so that no T×T matrix ever exists: the tile code of
// kernels/cpu/attention_tiles.h (shared with the blockwise attention of
// context parallelism), causal by index, with dropout on the probabilities.
//
// Both layouts of the projections (the GPT's packed [B, T, 3, H, Dh], Llama's
// grouped [B, T, G, R + 2, Dh]) run the same code through QkvLayout; a query
// head reads its group's keys and values in place, never a repeated copy.
//
// Generation's cached attention runs the shared row functor, a row per task.
#include "kernels/functors/attention.h"

#include <algorithm>
#include <cstdint>

#include "core/context.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_backend.h"

namespace tessera {
namespace {

using namespace cpu_attention;

// Where one call's rows live (either qkv layout, see QkvLayout) in the terms
// of the tile code: queries, keys and values all read from qkv, out its own.
struct Layout {
  AttentionRows rows;
  int64_t padded_dim;  // head_dim rounded up to kLanes

  int64_t batch() const { return rows.batch; }
  int64_t queries() const { return rows.seq_len; }
  int64_t keys() const { return rows.seq_len; }
  int64_t heads() const { return rows.qkv.heads; }
  int64_t groups() const { return rows.qkv.groups; }
  int64_t head_dim() const { return rows.qkv.head_dim; }
  int64_t group_of(int64_t h) const { return rows.qkv.group_of(h); }
  int64_t query_stride() const { return rows.qkv.token_stride; }  // token t to t + 1 in qkv
  int64_t kv_stride() const { return rows.qkv.token_stride; }
  int64_t out_stride() const { return heads() * head_dim(); }
  int64_t query_offset(int64_t b, int64_t t, int64_t h) const { return rows.query_offset(b, t, h); }
  int64_t key_offset(int64_t b, int64_t t, int64_t g) const { return rows.key_offset(b, t, g); }
  int64_t value_offset(int64_t b, int64_t t, int64_t g) const { return rows.value_offset(b, t, g); }
  int64_t out_offset(int64_t b, int64_t t, int64_t h) const { return rows.out_offset(b, t, h); }
  int64_t stats_offset(int64_t b, int64_t h, int64_t t) const { return rows.stats_offset(b, h, t); }
};

Layout layout_of(const Tensor& qkv, const QkvLayout& layout) {
  return Layout{AttentionRows{qkv.size(0), qkv.size(1), layout}, round_up(layout.head_dim, kLanes)};
}

void run_forward(const Tensor& qkv, const QkvLayout& layout, Tensor& out, Tensor& logsumexp, float scale,
                 const ops::AttentionDropout& dropout, const char* op) {
  const Layout g = layout_of(qkv, layout);
  const TilePositions positions = TilePositions::causal(g.queries());
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const ForwardOperands<T, T> x{qkv.data<T>(), qkv.data<T>(), out.data<T>(), logsumexp.data<float>()};
    run_forward_tiles(qkv.context(), g, positions, x, attention_scale(scale, g.head_dim()), dropout);
  });
}

// delta = rowsum(dO∘O), then the tiles' backward, storing grad_qkv.
void run_backward(const Tensor& grad_out, const Tensor& qkv, const QkvLayout& layout, const Tensor& out,
                  const Tensor& logsumexp, Tensor& grad_qkv, float scale, const ops::AttentionDropout& dropout,
                  const char* op) {
  const Layout g = layout_of(qkv, layout);
  const TilePositions positions = TilePositions::causal(g.queries());
  Context& ctx = qkv.context();
  Tensor delta = ctx.empty(Shape{g.batch(), g.heads(), g.queries()}, DType::f32);
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = g.batch() * g.queries() * g.heads();
    const AttentionDelta<T> delta_op{grad_out.data<T>(), out.data<T>(), delta.data<float>(),
                                     g.queries(),        g.heads(),     g.head_dim()};
    cpu_for_each_index(rows, delta_op, std::max<int64_t>(1, (int64_t(1) << 14) / g.head_dim()));
    const BackwardOperands<T, T> x{grad_out.data<T>(),  qkv.data<T>(),      qkv.data<T>(),     logsumexp.data<float>(),
                                   delta.data<float>(), grad_qkv.data<T>(), grad_qkv.data<T>()};
    run_backward_tiles<false>(ctx, g, positions, x, attention_scale(scale, g.head_dim()), dropout);
  });
}

// Appends the new keys and values, then one query row per task.
void run_with_cache(const Tensor& qkv, const QkvLayout& layout, Tensor& keys, Tensor& values, int64_t position,
                    Tensor& out, float scale, const char* op) {
  const CacheLayout cache{AttentionRows{qkv.size(0), qkv.size(1), layout}, keys.size(2), position};
  const float s = attention_scale(scale, layout.head_dim);
  dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const int64_t new_keys = qkv.size(0) * cache.new_tokens() * layout.groups * layout.head_dim;
    cpu_for_each_index(new_keys, KvAppend<T>{qkv.data<T>(), keys.data<T>(), values.data<T>(), cache});
    const CachedAttentionRow<T> row{qkv.data<T>(), keys.data<T>(), values.data<T>(), out.data<T>(), cache, s};
    cpu_for_each_index(qkv.size(0) * cache.new_tokens() * layout.heads, row, 1);
  });
}

}  // namespace

void CpuBackend::attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                                   const ops::AttentionDropout& dropout) {
  run_forward(qkv, packed_qkv_layout(qkv.shape()), out, logsumexp, scale, dropout, "attention_forward");
}

void CpuBackend::attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                    const Tensor& logsumexp, Tensor& grad_qkv, float scale,
                                    const ops::AttentionDropout& dropout) {
  run_backward(grad_out, qkv, packed_qkv_layout(qkv.shape()), out, logsumexp, grad_qkv, scale, dropout,
               "attention_backward");
}

void CpuBackend::attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                      float scale) {
  run_with_cache(qkv, packed_qkv_layout(qkv.shape()), keys, values, position, out, scale, "attention_with_cache");
}

void CpuBackend::grouped_attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                                           const ops::AttentionDropout& dropout) {
  run_forward(qkv, grouped_qkv_layout(qkv.shape()), out, logsumexp, scale, dropout, "grouped_attention_forward");
}

void CpuBackend::grouped_attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                            const Tensor& logsumexp, Tensor& grad_qkv, float scale,
                                            const ops::AttentionDropout& dropout) {
  run_backward(grad_out, qkv, grouped_qkv_layout(qkv.shape()), out, logsumexp, grad_qkv, scale, dropout,
               "grouped_attention_backward");
}

void CpuBackend::grouped_attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position,
                                              Tensor& out, float scale) {
  run_with_cache(qkv, grouped_qkv_layout(qkv.shape()), keys, values, position, out, scale,
                 "grouped_attention_with_cache");
}

}  // namespace tessera
