// Elementary functions in f32 for the functors, written so that CPU loops
// vectorise them (glibc's expf/tanhf have no vector variants without
// -ffast-math) while GPU code uses CUDA's own:
//   - exp_f32: e^x. On the host a Cody–Waite reduction plus a polynomial,
//     within about 1 ulp, exact 0, inf and NaN at the ends; expf on a GPU.
//   - TESSERA_HD_INLINE: host-device and always inlined, for helpers called
//     inside vectorised loops.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "core/host_device.h"

// Always inlined, also on the host: these are called inside vectorised loops,
// and a call that is not inlined (GCC's heuristics decline exp_f32 in a
// shared library) leaves the loop scalar, calling through the PLT.
#define TESSERA_HD_INLINE [[gnu::always_inline]] TESSERA_HD

namespace tessera {

TESSERA_HD_INLINE float exp_f32(float x) {
#if TESSERA_ON_DEVICE
  return expf(x);
#else
  // Beyond these bounds e^x is 0 or infinity in f32; clamping keeps n in range
  // (comparisons are false for NaN, which passes through and stays NaN).
  constexpr float kLowest = -104.0f, kHighest = 89.0f;
  x = x < kLowest ? kLowest : x;
  x = x > kHighest ? kHighest : x;
  // n = round(x·log2 e) by the 1.5·2^23 trick: the sum's low mantissa bits hold n.
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5·2^23
  const float shifted = x * kLog2e + kRoundMagic;
  const int32_t n = int32_t(float_bits(shifted) - float_bits(kRoundMagic));
  const float nf = shifted - kRoundMagic;
  // r = x − n·ln2 in two parts (Cody–Waite), |r| ≤ ln2/2.
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float r = (x - nf * kLn2Hi) - nf * kLn2Lo;
  // e^r ≈ 1 + r + r²·P(r) (Cephes expf coefficients).
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  // 2^n as two factors 2^(n/2)·2^(n − n/2), each a normal float for every
  // n in [−150, 129], so gradual underflow and overflow round correctly.
  const int32_t half = n / 2;
  const float scale_a = bits_float(uint32_t(half + 127) << 23);
  const float scale_b = bits_float(uint32_t(n - half + 127) << 23);
  return er * scale_a * scale_b;
#endif
}

}  // namespace tessera
