// KvCache: the keys and values every attention layer has computed for the
// tokens generated so far, so that generating the next token runs the model
// on that token alone (ops::attention_with_cache) instead of on the whole
// prefix again. One cache per sequence batch; a forward with the cache in its
// Pass (Pass::kv_cache) is inference only (nothing is kept for a backward):
//
//   KvCache cache(ctx, device, dtype, batch, capacity);
//   Pass pass;  pass.kv_cache = &cache;
//   logits = model.forward(prompt_ids, saved, pass);  cache.advance(prompt length);
//   logits = model.forward(next_id, saved, pass);     cache.advance(1);   ...
//
// Position embeddings read position() as the first new token's position.
// Each attention layer's tensors [B, H, capacity, Dh] (H: the heads this rank
// holds under tensor parallelism) are made on its first use.
#pragma once

#include <cstdint>
#include <map>

#include "core/context.h"
#include "core/tensor.h"

namespace tessera::nn {

class Module;

class KvCache {
 public:
  KvCache(Context& context, Device device, DType dtype, int64_t batch, int64_t capacity);

  int64_t position() const { return position_; }  // tokens cached so far
  int64_t capacity() const { return capacity_; }  // the longest sequence the cache holds
  int64_t batch() const { return batch_; }

  struct Layer {
    Tensor keys, values;  // [B, H, capacity, Dh]
  };
  // `attention`'s keys and values, allocated on first use for `heads` heads of `head_dim`.
  Layer& layer(const Module& attention, int64_t heads, int64_t head_dim);

  // After a forward over `tokens` new tokens: they are cached.
  void advance(int64_t tokens);
  // Forgets every token (the tensors are kept for the next sequence).
  void reset() { position_ = 0; }
  // Bytes the layers' tensors hold.
  int64_t bytes() const;

 private:
  Context& context_;
  Device device_;
  DType dtype_;
  int64_t batch_, capacity_, position_ = 0;
  std::map<const Module*, Layer> layers_;
};

}  // namespace tessera::nn
