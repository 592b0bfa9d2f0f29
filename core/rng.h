// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). A number
// is a pure function of (seed, stream, index): the same seed and index give the
// same value on the CPU and the GPU, in any order of calls and under any split
// of the work. Tensor-parallel initialisation and dropout rely on this: the
// index is the element's position in the global (unsplit) tensor.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace tessera {

struct PhiloxOutput {
  uint32_t v[4];
};

TESSERA_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = uint64_t(a) * uint64_t(b);
  hi = uint32_t(product >> 32);
  lo = uint32_t(product);
}

// Ten rounds of Philox4x32 on counter (c0..c3) with key (k0, k1).
TESSERA_HD PhiloxOutput philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, c0, hi0, lo0);
    philox_mulhilo(kMul1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// Four random 32-bit words for element `index` of random stream `stream`.
TESSERA_HD PhiloxOutput philox_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32_10(uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32), uint32_t(seed),
                       uint32_t(seed >> 32));
}

// Uniform in [0, 1) with 24 random bits (every value exactly representable).
TESSERA_HD float bits_to_unit_float(uint32_t bits) {
  return float(bits >> 8) * (1.0f / 16777216.0f);
}

TESSERA_HD float philox_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return bits_to_unit_float(philox_bits(seed, stream, index).v[0]);
}

// Standard normal by Box-Muller on the first two words (u1 in (0, 1]).
TESSERA_HD float philox_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const PhiloxOutput r = philox_bits(seed, stream, index);
  const float u1 = 1.0f - bits_to_unit_float(r.v[0]);
  const float u2 = bits_to_unit_float(r.v[1]);
  const float radius = sqrtf(-2.0f * logf(u1));
  return radius * cosf(6.283185307179586f * u2);
}

// A seed and a position in its sequence. Each use takes a range of indices
// (`take(n)` returns its start and moves past it), so successive draws differ
// and a run can save and restore the generator exactly (seed, offset).
struct Generator {
  uint64_t seed = 0;
  uint64_t offset = 0;

  uint64_t take(uint64_t count) {
    const uint64_t start = offset;
    offset += count;
    return start;
  }
};

}  // namespace tessera
