// Device: where a tensor's memory lives: the host, one CUDA device, or one
// emulated accelerator.
//
// The emulated accelerator ("emu:N") exists so that the CPU-only test suite can
// run the code that GPU runs take: tensors on it live in host memory and its
// kernels are the CPU backend's, but everything else follows the rules of a
// device (core/emulated_runtime.h): it has streams and events, copies to and
// from the host go through its runtime, host code reaches its bytes only
// through a copy, every thread that touches it must choose it first (as
// cudaSetDevice), and communication of its tensors takes the device channel,
// not the host one. A bug in routing, staging, threads or teardown then fails
// in CI instead of on the first GPU cluster.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

namespace tessera {

enum class DeviceType : uint8_t { cpu, cuda, emulated };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::cpu, 0}; }
  static constexpr Device cuda(int index) { return {DeviceType::cuda, index}; }
  static constexpr Device emulated(int index) { return {DeviceType::emulated, index}; }

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool is_emulated() const { return type == DeviceType::emulated; }
  // Memory the host reaches only through copies, with streams and events of its own.
  bool is_accelerator() const { return type != DeviceType::cpu; }
  std::string to_string() const;  // "cpu", "cuda:1", "emu:0"

  friend auto operator<=>(const Device&, const Device&) = default;
};

// Parses "cpu", "cuda" (= cuda:0), "cuda:N", "emu" (= emu:0) and "emu:N";
// throws tessera::Error otherwise.
Device parse_device(std::string_view text);

}  // namespace tessera
