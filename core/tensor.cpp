// Tensor: views, copies between devices, fills and random initialisation.
#include "core/tensor.h"

#include <cstring>
#include <sstream>

#include "core/context.h"
#include "core/device_runtime.h"
#include "core/fill_functors.h"
#include "core/parallel_for.h"
#include "core/tensor_fill.h"

namespace tessera {

Tensor::Tensor(std::shared_ptr<Storage> storage, size_t offset_bytes, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_bytes_(offset_bytes), shape_(shape), dtype_(dtype) {
  TESSERA_CHECK(storage_ != nullptr, "a tensor needs storage");
  TESSERA_CHECK(offset_bytes_ + nbytes() <= storage_->nbytes(), "tensor view ", shape_.to_string(), " ",
                dtype_name(dtype_), " at byte ", offset_bytes_, " overruns its storage of ", storage_->nbytes(),
                " bytes");
}

Tensor Tensor::placeholder(Shape shape, DType dtype) {
  Tensor out;
  out.shape_ = shape;
  out.dtype_ = dtype;
  return out;
}

Device Tensor::device() const {
  TESSERA_CHECK(defined(), "device() of an undefined tensor");
  return storage_->device();
}

Context& Tensor::context() const {
  TESSERA_CHECK(defined(), "context() of an undefined tensor");
  return storage_->context();
}

void* Tensor::data_ptr() const {
  TESSERA_CHECK(defined(), "data of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_bytes_;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  TESSERA_CHECK(ndim() >= 1, "slice needs at least one dimension, tensor is a scalar");
  TESSERA_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
                ") out of range for first dimension of size ", shape_[0]);
  const size_t row_bytes = size_t(shape_.inner_numel()) * element_size();
  return Tensor(storage_, offset_bytes_ + size_t(begin) * row_bytes, shape_.with_dim(0, end - begin), dtype_);
}

Tensor Tensor::select(int64_t index) const {
  TESSERA_CHECK(ndim() >= 1, "select needs at least one dimension");
  TESSERA_CHECK(0 <= index && index < shape_[0], "select index ", index, " out of range for size ", shape_[0]);
  const auto sizes = shape_.sizes();
  return slice(index, index + 1).view(Shape(sizes.subspan(1)));
}

Tensor Tensor::reshape(std::span<const int64_t> sizes) const {
  std::vector<int64_t> resolved(sizes.begin(), sizes.end());
  int inferred = -1;
  int64_t known = 1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1) {
      TESSERA_CHECK(inferred < 0, "reshape: only one size may be -1");
      inferred = int(i);
    } else {
      TESSERA_CHECK(resolved[i] >= 0, "reshape: invalid size ", resolved[i]);
      known *= resolved[i];
    }
  }
  if (inferred >= 0) {
    TESSERA_CHECK(known > 0 && numel() % known == 0, "reshape: cannot infer -1 for ", numel(), " elements from shape ",
                  shape_.to_string());
    resolved[size_t(inferred)] = numel() / known;
  }
  return view(Shape(resolved));
}

Tensor Tensor::view(const Shape& shape) const {
  TESSERA_CHECK(shape.numel() == numel(), "cannot view ", shape_.to_string(), " (", numel(), " elements) as ",
                shape.to_string());
  return Tensor(storage_, offset_bytes_, shape, dtype_);
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = context().empty(shape_, dtype_, device);
  out.copy_(*this);
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = context().empty(shape_, dtype_, device());
  out.copy_(*this);
  return out;
}

Tensor& Tensor::copy_(const Tensor& source) {
  TESSERA_CHECK(source.dtype_ == dtype_, "copy_: dtype ", dtype_name(source.dtype_), " into ", dtype_name(dtype_),
                "; use ops::cast to convert");
  TESSERA_CHECK(source.numel() == numel(), "copy_: ", source.numel(), " elements into ", numel());
  if (nbytes() == 0 || data_ptr() == source.data_ptr()) return *this;
  const Device from = source.device(), to = device();
  if (from.is_cpu() && to.is_cpu()) {
    char* dst = static_cast<char*>(data_ptr());
    const char* src = static_cast<const char*>(source.data_ptr());
    parallel_for(int64_t(nbytes()), int64_t(1) << 22,
                 [&](int64_t begin, int64_t end) { std::memcpy(dst + begin, src + begin, size_t(end - begin)); });
    return *this;
  }
  // Order the copy after queued work on the device side(s), then make the
  // result visible to the host when the host is involved.
  TESSERA_CHECK(from.is_cpu() || to.is_cpu() || from.type == to.type, "copy_: from ", from.to_string(), " to ",
                to.to_string(), ": devices of different kinds; copy through the host");
  Context& ctx = context();
  const Device dev = to.is_accelerator() ? to : from;
  DeviceRuntime& runtime = device_runtime(dev);
  if (from.is_accelerator() && to.is_accelerator() && from != to) {
    runtime.set_device(from.index);
    ctx.synchronize(from);
  }
  const Stream& stream = ctx.compute_stream(dev);
  runtime.set_device(dev.index);
  runtime.memcpy_async(data_ptr(), source.data_ptr(), nbytes(), stream.native_handle());
  if (from.is_cpu() || to.is_cpu()) stream.synchronize();
  return *this;
}

Tensor& Tensor::fill_(double value) {
  if (numel() == 0) return *this;
  const Device dev = device();
  if (dev.is_cuda()) {
    detail::cuda_fill_constant(data_ptr(), dtype_, numel(), value, dev.index,
                               context().compute_stream(dev).native_handle());
    return *this;
  }
  dispatch_any(dtype_, [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(numel(), FillConstant<T>{static_cast<T*>(data_ptr()), scalar_as<T>(value)});
  });
  return *this;
}

Tensor& Tensor::uniform_(Generator& generator, float low, float high, uint64_t stream) {
  return uniform_at_(generator.seed, stream, generator.take(uint64_t(numel())), low, high);
}

Tensor& Tensor::normal_(Generator& generator, float mean, float stddev, uint64_t stream) {
  return normal_at_(generator.seed, stream, generator.take(uint64_t(numel())), mean, stddev);
}

Tensor& Tensor::uniform_at_(uint64_t seed, uint64_t stream, uint64_t first_index, float low, float high) {
  const Device dev = device();
  if (dev.is_cuda()) {
    detail::cuda_fill_uniform(data_ptr(), dtype_, numel(), seed, stream, first_index, low, high, dev.index,
                              context().compute_stream(dev).native_handle());
    return *this;
  }
  dispatch_float(dtype_, "uniform_", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(numel(), FillUniform<T>{static_cast<T*>(data_ptr()), seed, stream, first_index, low, high},
                       1 << 12);
  });
  return *this;
}

Tensor& Tensor::normal_at_(uint64_t seed, uint64_t stream, uint64_t first_index, float mean, float stddev) {
  const Device dev = device();
  if (dev.is_cuda()) {
    detail::cuda_fill_normal(data_ptr(), dtype_, numel(), seed, stream, first_index, mean, stddev, dev.index,
                             context().compute_stream(dev).native_handle());
    return *this;
  }
  dispatch_float(dtype_, "normal_", [&](auto tag) {
    using T = decltype(tag);
    cpu_for_each_index(numel(), FillNormal<T>{static_cast<T*>(data_ptr()), seed, stream, first_index, mean, stddev},
                       1 << 12);
  });
  return *this;
}

std::vector<double> Tensor::to_doubles() const {
  const Tensor host = to(Device::cpu());
  std::vector<double> out(static_cast<size_t>(numel()));
  dispatch_any(dtype_, [&](auto tag) {
    using T = decltype(tag);
    const T* data = host.data<T>();
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
        out[i] = double(float(data[i]));
      else
        out[i] = double(data[i]);
    }
  });
  return out;
}

std::string Tensor::to_string(int64_t max_elements) const {
  std::ostringstream out;
  out << "Tensor(" << dtype_name(dtype_) << " " << shape_.to_string();
  if (!defined()) return out.str() + " undefined)";
  out << " " << device().to_string() << ":";
  const std::vector<double> values = to_doubles();
  for (int64_t i = 0; i < std::min<int64_t>(max_elements, numel()); ++i) out << (i ? ", " : " ") << values[size_t(i)];
  if (numel() > max_elements) out << ", ...";
  return out.str() + ")";
}

}  // namespace tessera
