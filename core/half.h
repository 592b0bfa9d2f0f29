// 16-bit floating point storage types: bf16 (bfloat16) and f16 (IEEE half).
// Both are plain 16-bit values that convert to and from float with
// round-to-nearest-even; all arithmetic is done in float. CPU and GPU round
// identically:
//   - bf16 uses the same bit manipulation everywhere;
//   - f16 uses the portable bit manipulation on the device and in host code
//     that nvcc compiles, and the compiler's _Float16 (F16C / AVX512-FP16
//     instructions, which loops vectorise) in host code the host compiler
//     compiles. The two give the same bits for every input
//     (tests/core/test_half.cpp checks the portable code against _Float16).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#if !defined(__CUDACC__) && defined(__FLT16_MANT_DIG__)
#define TESSERA_HOST_FLOAT16 1
#else
#define TESSERA_HOST_FLOAT16 0
#endif

#include "core/host_device.h"

namespace tessera {

TESSERA_HD uint32_t float_bits(float value) {
#if TESSERA_ON_DEVICE
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

TESSERA_HD float bits_float(uint32_t bits) {
#if TESSERA_ON_DEVICE
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  TESSERA_HD explicit bf16(float value) : bits(from_float_bits(value)) {}
  TESSERA_HD explicit operator float() const { return bits_float(uint32_t(bits) << 16); }

  static TESSERA_HD bf16 from_bits(uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
  // Round to nearest even; NaN stays a (quiet) NaN.
  static TESSERA_HD uint16_t from_float_bits(float value) {
    uint32_t u = float_bits(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
};

struct f16 {
  uint16_t bits = 0;

  f16() = default;
  TESSERA_HD explicit f16(float value) : bits(from_float_bits(value)) {}
  TESSERA_HD explicit operator float() const { return to_float_value(bits); }

  static TESSERA_HD uint16_t from_float_bits(float value) {
#if TESSERA_HOST_FLOAT16
    return std::bit_cast<uint16_t>(static_cast<_Float16>(value));
#else
    return from_float_bits_portable(value);
#endif
  }
  static TESSERA_HD float to_float_value(uint16_t h) {
#if TESSERA_HOST_FLOAT16
    return static_cast<float>(std::bit_cast<_Float16>(h));
#else
    return to_float_value_portable(h);
#endif
  }

  static TESSERA_HD f16 from_bits(uint16_t b) {
    f16 h;
    h.bits = b;
    return h;
  }

  // IEEE binary32 -> binary16, round to nearest even, with subnormals,
  // overflow to infinity and NaN preserved.
  static TESSERA_HD uint16_t from_float_bits_portable(float value) {
    const uint32_t u = float_bits(value);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
    if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);                          // rounds to >= 65520: infinity
    if (abs < 0x38800000u) {                                                          // below 2^-14: subnormal or zero
      if (abs < 0x33000000u) return uint16_t(sign);  // below half the smallest subnormal
      const uint32_t exponent = abs >> 23;           // 102..112
      const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
      const uint32_t shift = 126u - exponent;  // 14..24
      uint32_t half = mantissa >> shift;
      const uint32_t rest = mantissa & ((1u << shift) - 1u);
      const uint32_t halfway = 1u << (shift - 1u);
      if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
      return uint16_t(sign | half);
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round mantissa to 10 bits
    rounded -= 0x38000000u;                                // rebias exponent 127 -> 15
    return uint16_t(sign | (rounded >> 13));
  }

  static TESSERA_HD float to_float_value_portable(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
      // Subnormal (or zero): value = mantissa * 2^-24, exact in float.
      const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
      return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
};

// Uniform access for templated kernels: load any storage type as float,
// store float into any storage type.
TESSERA_HD float to_float(float v) {
  return v;
}
TESSERA_HD float to_float(bf16 v) {
  return float(v);
}
TESSERA_HD float to_float(f16 v) {
  return float(v);
}

template <typename T>
TESSERA_HD T from_float(float v) {
  return T(v);
}
template <>
TESSERA_HD float from_float<float>(float v) {
  return v;
}

}  // namespace tessera
