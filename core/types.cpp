// Parsing and printing of the small value types: DType, Shape, Device.
#include <algorithm>
#include <cctype>
#include <charconv>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/shape.h"

namespace tessera {

DType parse_dtype(std::string_view text) {
  struct Name {
    std::string_view name;
    DType dtype;
  };
  static constexpr Name kNames[] = {{"f32", DType::f32},     {"float32", DType::f32},   {"fp32", DType::f32},
                                    {"bf16", DType::bf16},   {"bfloat16", DType::bf16}, {"f16", DType::f16},
                                    {"float16", DType::f16}, {"fp16", DType::f16},      {"i32", DType::i32},
                                    {"int32", DType::i32},   {"i64", DType::i64},       {"int64", DType::i64},
                                    {"u8", DType::u8},       {"uint8", DType::u8}};
  for (const auto& entry : kNames)
    if (entry.name == text) return entry.dtype;
  TESSERA_THROW("unknown dtype '", text, "'; use one of f32, bf16, f16, i32, i64, u8");
}

Shape::Shape(std::initializer_list<int64_t> sizes) : Shape(std::span<const int64_t>(sizes.begin(), sizes.size())) {}

Shape::Shape(std::span<const int64_t> sizes) {
  TESSERA_CHECK(sizes.size() <= size_t(kMaxDims), "a shape has at most ", kMaxDims, " dimensions, got ", sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    TESSERA_CHECK(sizes[i] >= 0, "shape sizes must be non-negative, dimension ", i, " is ", sizes[i]);
    sizes_[i] = sizes[i];
  }
  ndim_ = int(sizes.size());
}

int64_t Shape::operator[](int dim) const {
  const int d = dim < 0 ? dim + ndim_ : dim;
  TESSERA_CHECK(d >= 0 && d < ndim_, "dimension ", dim, " is out of range for shape ", to_string());
  return sizes_[size_t(d)];
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= sizes_[size_t(i)];
  return n;
}

int64_t Shape::inner_numel() const {
  int64_t n = 1;
  for (int i = 1; i < ndim_; ++i) n *= sizes_[size_t(i)];
  return n;
}

Shape Shape::with_dim(int dim, int64_t size) const {
  const int d = dim < 0 ? dim + ndim_ : dim;
  TESSERA_CHECK(d >= 0 && d < ndim_, "dimension ", dim, " is out of range for shape ", to_string());
  Shape out = *this;
  out.sizes_[size_t(d)] = size;
  return out;
}

std::string Shape::to_string() const {
  std::string out = "[";
  for (int i = 0; i < ndim_; ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes_[size_t(i)]);
  }
  return out + "]";
}

bool operator==(const Shape& a, const Shape& b) {
  return a.ndim_ == b.ndim_ && std::equal(a.sizes_.begin(), a.sizes_.begin() + a.ndim_, b.sizes_.begin());
}

std::string Device::to_string() const {
  switch (type) {
    case DeviceType::cpu:
      return "cpu";
    case DeviceType::cuda:
      return "cuda:" + std::to_string(index);
    case DeviceType::emulated:
      return "emu:" + std::to_string(index);
  }
  return "?";
}

Device parse_device(std::string_view text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda" || text == "gpu") return Device::cuda(0);
  if (text == "emu") return Device::emulated(0);
  for (std::string_view prefix : {"cuda:", "gpu:", "emu:"}) {
    if (text.starts_with(prefix)) {
      const std::string_view digits = text.substr(prefix.size());
      int index = -1;
      const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
      if (ec == std::errc() && end == digits.data() + digits.size() && index >= 0)
        return prefix == "emu:" ? Device::emulated(index) : Device::cuda(index);
    }
  }
  TESSERA_THROW("unknown device '", text,
                "'; use cpu, cuda or cuda:N (emu or emu:N: the emulated accelerator of the tests)");
}

}  // namespace tessera
