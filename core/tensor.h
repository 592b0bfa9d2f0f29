// Tensor: a contiguous, row-major array of one dtype on one device, viewing a
// shared Storage at a byte offset. Copying a Tensor copies the view, not the
// data (like a shared_ptr). Views: slices and selections along the first
// dimension, and reshapes. Data movement: to(device), copy_, fill_, and random
// initialisation from the counter-based RNG.
//
// A tensor belongs to the Context that allocated it (ctx.empty(...)); work on
// it runs on that context's compute stream for its device. Tensors must not
// outlive their context.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/shape.h"
#include "core/storage.h"

namespace tessera {

class Tensor {
 public:
  Tensor() = default;  // undefined: holds no storage
  Tensor(std::shared_ptr<Storage> storage, size_t offset_bytes, Shape shape, DType dtype);
  // An undefined tensor that still knows its shape and dtype (no storage):
  // what a ZeRO-3 parameter's value is while its unit is not gathered, so
  // code that counts or describes parameters keeps working and code that
  // reads data fails (data of an undefined tensor).
  static Tensor placeholder(Shape shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t size(int dim) const { return shape_[dim]; }
  int ndim() const { return shape_.ndim(); }
  int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  Device device() const;
  Context& context() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  size_t offset_bytes() const { return offset_bytes_; }
  bool shares_storage_with(const Tensor& other) const { return storage_ && storage_ == other.storage_; }

  void* data_ptr() const;
  template <typename T>
  T* data() const {
    TESSERA_CHECK(dtype_ == dtype_v<T>, "tensor holds ", dtype_name(dtype_), ", accessed as ", dtype_name(dtype_v<T>));
    return static_cast<T*>(data_ptr());
  }

  // Views (no copy).
  Tensor slice(int64_t begin, int64_t end) const;        // rows [begin, end) of the first dimension
  Tensor select(int64_t index) const;                    // row `index`, first dimension dropped
  Tensor reshape(std::span<const int64_t> sizes) const;  // one size may be -1
  Tensor reshape(std::initializer_list<int64_t> sizes) const {
    return reshape(std::span<const int64_t>(sizes.begin(), sizes.size()));
  }
  Tensor view(const Shape& shape) const;  // same number of elements, exact shape
  Tensor flatten() const { return view(Shape{numel()}); }

  // Data movement; all run on the context's compute stream and return when the
  // data can be read by the caller (copies to the host are synchronous).
  Tensor to(Device device) const;       // a copy on `device` (or *this if already there)
  Tensor clone() const;                 // a copy on the same device
  Tensor& copy_(const Tensor& source);  // same dtype and number of elements; any devices
  Tensor& fill_(double value);
  Tensor& uniform_(Generator& generator, float low, float high, uint64_t stream = 0);
  Tensor& normal_(Generator& generator, float mean, float stddev, uint64_t stream = 0);
  // Random values as if this tensor were elements [first_index, first_index +
  // numel) of a larger one: how a shard draws exactly its slice of a global tensor.
  Tensor& uniform_at_(uint64_t seed, uint64_t stream, uint64_t first_index, float low, float high);
  Tensor& normal_at_(uint64_t seed, uint64_t stream, uint64_t first_index, float mean, float stddev);

  // Host copies of the contents, for tests, logging and I/O.
  template <typename T>
  std::vector<T> to_vector() const;
  std::vector<double> to_doubles() const;                  // any dtype, converted
  std::string to_string(int64_t max_elements = 16) const;  // "Tensor(f32 [2, 3] cpu: 1, 2, ...)"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

template <typename T>
std::vector<T> Tensor::to_vector() const {
  TESSERA_CHECK(dtype_ == dtype_v<T>, "to_vector: tensor holds ", dtype_name(dtype_), ", asked for ",
                dtype_name(dtype_v<T>));
  const Tensor host = to(Device::cpu());
  const T* begin = host.data<T>();
  return std::vector<T>(begin, begin + numel());
}

}  // namespace tessera
