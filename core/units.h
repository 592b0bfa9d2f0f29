// Quantities as people read them in messages and listings: byte counts with
// binary units ("1.5 MiB"). Header-only; used by checkpoint errors and
// `tessera checkpoint`.
#pragma once

#include <cstdio>
#include <string>

namespace tessera {

// "0 B", "512 B", "1.5 KiB", "3.0 GiB" (powers of 1024, one decimal above bytes).
inline std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

}  // namespace tessera
