// split_qkv / join_qkv (kernels/ops.h) as index functors shared by the CPU and
// CUDA backends: one index per element of q and kv together, [B·T] tokens ×
// (H + 2G) head rows × Dh, mapped through QkvLayout to its place in the
// layer's packed projections (either layout). Pure copies (join rounds an f32
// gradient to qkv's dtype).
#pragma once

#include <cstdint>

#include "core/half.h"
#include "kernels/functors/attention.h"

namespace tessera {

// Where element i of [q | kv] (per token: H query rows, then G·2 key/value rows,
// each Dh long) lives in one token's projections, and in q or kv.
struct QkvSplitIndex {
  QkvLayout layout;
  TESSERA_HD int64_t rows_per_token() const { return layout.heads + 2 * layout.groups; }
  // Fills the element's offsets: in qkv, and in q (is_query) or kv.
  TESSERA_HD void locate(int64_t i, int64_t& packed, int64_t& split, bool& is_query) const {
    const int64_t dh = layout.head_dim, row_elements = rows_per_token() * dh;
    const int64_t token = i / row_elements, within = i % row_elements, row = within / dh, d = within % dh;
    is_query = row < layout.heads;
    if (is_query) {
      packed = token * layout.token_stride + layout.query(row) + d;
      split = (token * layout.heads + row) * dh + d;
    } else {
      const int64_t g = (row - layout.heads) / 2, slot = (row - layout.heads) % 2;
      packed = token * layout.token_stride + (slot == 0 ? layout.key(g) : layout.value(g)) + d;
      split = ((token * layout.groups + g) * 2 + slot) * dh + d;
    }
  }
};

template <typename T>
struct QkvSplit {
  QkvSplitIndex index;
  const T* qkv;
  T* q;
  T* kv;
  TESSERA_HD void operator()(int64_t i) const {
    int64_t packed = 0, split = 0;
    bool is_query = false;
    index.locate(i, packed, split, is_query);
    (is_query ? q : kv)[split] = qkv[packed];
  }
};

// G: the gradients' dtype (f32 or T).
template <typename G, typename T>
struct QkvJoin {
  QkvSplitIndex index;
  const G* grad_q;
  const G* grad_kv;
  T* grad_qkv;
  TESSERA_HD void operator()(int64_t i) const {
    int64_t packed = 0, split = 0;
    bool is_query = false;
    index.locate(i, packed, split, is_query);
    grad_qkv[packed] = from_float<T>(to_float((is_query ? grad_q : grad_kv)[split]));
  }
};

// The layout of qkv [B, T, 3, H, Dh] (grouped false) or [B, T, G, R + 2, Dh].
inline QkvLayout qkv_layout_of(int64_t dim2, int64_t dim3, int64_t head_dim, bool grouped) {
  return grouped ? grouped_qkv_layout(dim2, dim3 - 2, head_dim) : packed_qkv_layout(dim3, head_dim);
}

}  // namespace tessera
