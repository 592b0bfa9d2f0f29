// Shape: the sizes of a tensor's dimensions (at most kMaxDims), row-major.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

namespace tessera {

class Shape {
 public:
  static constexpr int kMaxDims = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> sizes);
  explicit Shape(std::span<const int64_t> sizes);

  int ndim() const { return ndim_; }
  int64_t operator[](int dim) const;  // negative dims count from the end
  int64_t numel() const;
  std::span<const int64_t> sizes() const { return {sizes_.data(), size_t(ndim_)}; }
  // Product of all sizes after the first: the number of elements in one "row"
  // of the first dimension.
  int64_t inner_numel() const;

  Shape with_dim(int dim, int64_t size) const;
  std::string to_string() const;  // "[2, 3, 4]"

  friend bool operator==(const Shape& a, const Shape& b);

 private:
  std::array<int64_t, kMaxDims> sizes_{};
  int ndim_ = 0;
};

}  // namespace tessera
