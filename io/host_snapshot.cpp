// HostSnapshot (io/host_snapshot.h): device pieces packed into a bounded
// pinned staging buffer, copied as one batch per fill, moved into pageable
// host tensors.
#include "io/host_snapshot.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/context.h"
#include "core/device_runtime.h"
#include "core/storage.h"

namespace tessera::io {

std::vector<Tensor> HostSnapshot::copy(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> copies;
  copies.reserve(tensors.size());
  for (const Tensor& tensor : tensors) {
    Tensor host = tensor.context().empty(tensor.shape(), tensor.dtype(), Device::cpu());
    if (tensor.device().is_cpu())
      host.copy_(tensor);
    else
      stage(tensor, host);
    copies.push_back(std::move(host));
  }
  flush();
  return copies;
}

// Queues `device_tensor`'s bytes for `host`, in pieces of at most the buffer's size.
void HostSnapshot::stage(const Tensor& device_tensor, Tensor& host) {
  const Device device = device_tensor.device();
  if (staging_.defined() && staging_device_ != device) {
    flush();
    staging_ = Tensor();
  }
  if (!staging_.defined()) {
    Context& ctx = device_tensor.context();
    const std::shared_ptr<Allocator> pinned(std::shared_ptr<void>(), &ctx.pinned_allocator(device));
    staging_ = Tensor(std::make_shared<Storage>(ctx, pinned, size_t(kSnapshotStagingBytes), nullptr), 0,
                      Shape{kSnapshotStagingBytes}, DType::u8);
    staging_device_ = device;
  }
  const auto* source = static_cast<const std::byte*>(device_tensor.data_ptr());
  auto* target = static_cast<std::byte*>(host.data_ptr());
  for (int64_t done = 0, total = int64_t(device_tensor.nbytes()); done < total;) {
    if (used_ == kSnapshotStagingBytes) flush();
    const int64_t bytes = std::min(total - done, kSnapshotStagingBytes - used_);
    pending_.push_back({source + done, target + done, bytes, used_});
    used_ += bytes;
    done += bytes;
  }
}

// The pending copies: device to staging on the device's compute stream (after
// the work queued there), one synchronisation, staging to their host tensors.
void HostSnapshot::flush() {
  if (pending_.empty()) return;
  Context& ctx = staging_.context();
  DeviceRuntime& runtime = device_runtime(staging_device_);
  runtime.set_device(staging_device_.index);
  const Stream& stream = ctx.compute_stream(staging_device_);
  auto* buffer = static_cast<std::byte*>(staging_.data_ptr());
  for (const Pending& copy : pending_)
    runtime.memcpy_async(buffer + copy.offset, copy.device, size_t(copy.bytes), stream.native_handle());
  stream.synchronize();
  for (const Pending& copy : pending_) std::memcpy(copy.host, buffer + copy.offset, size_t(copy.bytes));
  pending_.clear();
  used_ = 0;
}

}  // namespace tessera::io
