// Numbers as text that reads back exactly: the shortest form std::to_chars
// gives ("0.1", "1e-05", "12"), for a float as a float (0.1f is "0.1", not the
// double nearest it). Header-only; what settings, checkpoint metadata and
// JSON numbers are written with, so that they parse back to the same value.
#pragma once

#include <charconv>
#include <string>
#include <type_traits>

namespace tessera {

// The shortest text that reads back as the same float (strtof) or double
// (strtod); "nan", "inf", "-inf" for the non-finite.
template <typename Float>
std::string shortest_text(Float value) {
  static_assert(std::is_same_v<Float, float> || std::is_same_v<Float, double>, "shortest_text: float or double");
  char text[64];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::string(text, result.ptr);
}

}  // namespace tessera
