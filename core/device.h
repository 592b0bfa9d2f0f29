// Device: where a tensor's memory lives (the host, or one CUDA device).
#pragma once

#include <compare>
#include <string>
#include <string_view>

namespace tessera {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::cpu, 0}; }
  static constexpr Device cuda(int index) { return {DeviceType::cuda, index}; }

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string to_string() const;  // "cpu", "cuda:1"

  friend auto operator<=>(const Device&, const Device&) = default;
};

// Parses "cpu", "cuda" (= cuda:0) and "cuda:N"; throws tessera::Error otherwise.
Device parse_device(std::string_view text);

}  // namespace tessera
