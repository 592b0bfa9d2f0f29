// Rotary position embedding (RoPE) of the grouped projections qkv
// [B, T, G, R + 2, Dh] (see ops::rotary_forward), as one index functor both
// backends run: an item is (b, t, i) for a pair i < Dh/2, whose angle, cosine
// and sine are computed once and applied to the pair in every query and key
// slot of every group; the value slot is copied. launch_rotary builds it for
// a call's tensors.
//
// Pairs are half-split, as Hugging Face's rotate_half: element i goes with
// element i + Dh/2 (not the interleaved (2i, 2i + 1) of the RoFormer paper and
// Meta's reference code, whose checkpoints transformers permutes on
// conversion), so Hugging Face Llama weights load as they are.
//
// The angle follows transformers' LlamaRotaryEmbedding step by step in f32:
// inv_freq_i = 1 / base^(f32(2i) / Dh) (see rotary_inverse_frequency), angle
// = f32(position)·inv_freq_i, then the cosine and sine of that f32 angle. An
// angle formed in double would be closer to the true one but would differ
// from transformers' by up to about position·2^−24 radians, more than the f32
// rounding of the outputs; matching its arithmetic keeps logits equal to
// transformers' within f32 rounding. (transformers then rounds cos and sin to
// the activation dtype; here the rotation is done in f32 and only its result
// is rounded.)
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "core/host_device.h"
#include "core/tensor.h"
#include "kernels/functors/float_math.h"

namespace tessera {

// base^(−2i/Dh), as transformers' inv_freq: the exponent an f32 quotient, the
// power rounded to f32 (computed in double and rounded once, which is what
// torch's f32 pow returns but for rare last-bit cases, and the same on host
// and device, whose powf differ by an ulp or two), then its f32 reciprocal.
TESSERA_HD float rotary_inverse_frequency(int64_t i, int64_t head_dim, float base) {
  const float exponent = float(2 * i) / float(head_dim);
  return 1.0f / float(pow(double(base), double(exponent)));
}

// out = the rotation of in by direction·angle (direction +1: forward; −1: the
// backward, the transpose). An index functor over n = (b·T + t)·Dh/2 + i;
// in and out [B, T, G, R + 2, Dh] may be the same tensor. Its parts serve a
// launcher that walks the pairs otherwise (the CPU's: the angles of each
// (t, i) once, then the pairs of a slot in a vectorised loop over i):
// angle(t, i) gives the cosine and the signed sine, rotate and copy_value
// move one pair of the slot starting at element `slot`.
template <typename T, typename Index>
struct RotaryPairs {
  const T* in;
  T* out;
  const Index* positions;                   // [T]
  int64_t tokens, groups, slots, head_dim;  // T, G, R + 2, Dh
  float base, direction;

  TESSERA_HD_INLINE void angle(int64_t t, int64_t i, float& c, float& s) const {
    const float a = float(positions[t]) * rotary_inverse_frequency(i, head_dim, base);
    c = cosf(a);
    s = direction * sinf(a);
  }
  TESSERA_HD_INLINE void rotate(int64_t slot, int64_t i, float c, float s) const {
    const int64_t at = slot + i, half = head_dim / 2;
    const float x1 = to_float(in[at]), x2 = to_float(in[at + half]);
    out[at] = from_float<T>(x1 * c - x2 * s);
    out[at + half] = from_float<T>(x2 * c + x1 * s);
  }
  TESSERA_HD_INLINE void copy_value(int64_t slot, int64_t i) const {
    out[slot + i] = in[slot + i];
    out[slot + i + head_dim / 2] = in[slot + i + head_dim / 2];
  }
  // The first element of slot `slot` of group g of token (b·T + t).
  TESSERA_HD_INLINE int64_t slot_start(int64_t token, int64_t g, int64_t slot) const {
    return ((token * groups + g) * slots + slot) * head_dim;
  }

  TESSERA_HD void operator()(int64_t n) const {
    const int64_t half = head_dim / 2, i = n % half, token = n / half;
    float c, s;
    angle(token % tokens, i, c, s);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t slot = 0; slot + 1 < slots; ++slot) rotate(slot_start(token, g, slot), i, c, s);  // queries, key
      copy_value(slot_start(token, g, slots - 1), i);
    }
  }
};

// in → out [B, T, G, R + 2, Dh] rotated by direction·angle (+1 forward, −1
// backward): calls launch(pairs, functor) with the RotaryPairs functor of the
// tensors' dtypes, for the backend's index loop.
template <typename Launch>
void launch_rotary(const Tensor& in, const Tensor& positions, Tensor& out, float base, float direction, const char* op,
                   Launch&& launch) {
  const int64_t tokens = in.size(1), groups = in.size(2), slots = in.size(3), head_dim = in.size(4);
  const int64_t pairs = in.size(0) * tokens * (head_dim / 2);
  dispatch_float(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(positions.dtype(), op, [&](auto index_tag) {
      using Index = decltype(index_tag);
      launch(pairs, RotaryPairs<T, Index>{in.data<T>(), out.data<T>(), positions.data<Index>(), tokens, groups, slots,
                                          head_dim, base, direction});
    });
  });
}

}  // namespace tessera
