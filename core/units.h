// Quantities as people read them in messages and listings: byte counts with
// binary units ("1.5 MiB"), lists in prose ("1, 2 or 4"). Header-only; used
// by checkpoint errors, `tessera checkpoint`, `export` and `generate`.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

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

// "a", "a and b", "a, b and c" (`last`: the word before the last item).
inline std::string human_list(const std::vector<std::string>& items, const std::string& last = "and") {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i)
    text += (i == 0 ? "" : i + 1 == items.size() ? " " + last + " " : ", ") + items[i];
  return text;
}

}  // namespace tessera
