// KvCache (nn/kv_cache.h): per-layer key/value tensors and the position counter.
#include "nn/kv_cache.h"

#include "core/error.h"
#include "nn/module.h"

namespace tessera::nn {

KvCache::KvCache(Context& context, Device device, DType dtype, int64_t batch, int64_t capacity)
    : context_(context), device_(device), dtype_(dtype), batch_(batch), capacity_(capacity) {
  TESSERA_CHECK(batch > 0 && capacity > 0, "KvCache: batch (", batch, ") and capacity (", capacity,
                ") must be positive");
}

KvCache::Layer& KvCache::layer(const Module& attention, int64_t heads, int64_t head_dim) {
  auto found = layers_.find(&attention);
  if (found == layers_.end()) {
    const Shape shape{batch_, heads, capacity_, head_dim};
    Layer made{context_.empty(shape, dtype_, device_), context_.empty(shape, dtype_, device_)};
    found = layers_.emplace(&attention, std::move(made)).first;
  }
  const Tensor& keys = found->second.keys;
  TESSERA_CHECK(keys.size(1) == heads && keys.size(3) == head_dim, attention.name(), ": the KV cache holds ",
                keys.size(1), " heads of ", keys.size(3), ", asked for ", heads, " of ", head_dim);
  return found->second;
}

void KvCache::advance(int64_t tokens) {
  TESSERA_CHECK(tokens >= 0 && position_ + tokens <= capacity_, "KvCache: ", position_, " + ", tokens,
                " tokens exceed the capacity of ", capacity_);
  position_ += tokens;
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (const auto& [module, layer] : layers_) total += layer.keys.nbytes() + layer.values.nbytes();
  return total;
}

}  // namespace tessera::nn
