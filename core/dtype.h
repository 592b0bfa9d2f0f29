// Element types of tensors and the helpers that turn a runtime DType into a
// C++ type inside templated code (dispatch_float, dispatch_index).
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/half.h"

namespace tessera {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8 };

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

constexpr bool is_floating(DType dtype) {
  return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16;
}

// Parses "f32", "bf16", "f16", "i32", "i64", "u8" (also "float32", "bfloat16",
// "float16", "int32", "int64", "uint8"); throws tessera::Error otherwise.
DType parse_dtype(std::string_view text);

template <typename T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::u8;
};
template <typename T>
inline constexpr DType dtype_v = dtype_of<T>::value;

// Lets test frameworks and logs print a DType by name.
inline std::ostream& operator<<(std::ostream& out, DType dtype) {
  return out << dtype_name(dtype);
}

[[noreturn]] void throw_unsupported_dtype(DType dtype, std::string_view what);

// Calls `fn(T{})` with T = float, bf16 or f16 matching `dtype`.
//   dispatch_float(x.dtype(), "gelu", [&](auto tag) { using T = decltype(tag); ... });
template <typename Fn>
decltype(auto) dispatch_float(DType dtype, std::string_view what, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      return fn(float{});
    case DType::bf16:
      return fn(bf16{});
    case DType::f16:
      return fn(f16{});
    default:
      throw_unsupported_dtype(dtype, what);
  }
}

// Calls `fn(T{})` with T the C++ type of any dtype.
template <typename Fn>
decltype(auto) dispatch_any(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: return fn(float{});
    case DType::bf16: return fn(bf16{});
    case DType::f16: return fn(f16{});
    case DType::i32: return fn(int32_t{});
    case DType::i64: return fn(int64_t{});
    case DType::u8: return fn(uint8_t{});
  }
  throw_unsupported_dtype(dtype, "dispatch_any");
}

// `value` converted to the storage type T (through float for bf16 and f16).
template <typename T>
TESSERA_HD T scalar_as(double value) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return T(float(value));
  else
    return T(value);
}

// Calls `fn(T{})` with T = int32_t or int64_t (token ids, targets, indices).
template <typename Fn>
decltype(auto) dispatch_index(DType dtype, std::string_view what, Fn&& fn) {
  switch (dtype) {
    case DType::i32:
      return fn(int32_t{});
    case DType::i64:
      return fn(int64_t{});
    default:
      throw_unsupported_dtype(dtype, what);
  }
}

}  // namespace tessera
