// The tensor-parallel layers of the Llama family (Llama 2/3, Mistral, Qwen),
// usable by any model built on them (biases optional: `bias`, off by default
// as in the Llama; rotary embeddings off with rotary_base 0, for a model
// with learned positions and G < H):
//
//   ParallelGroupedAttention  grouped-query attention with rotary position
//       embeddings: qkv column-parallel with no bias, its output features in
//       Megatron's grouped layout [G, R+2, Dh] (per key/value group g: its R =
//       H/G query heads, then its key, then its value), split by whole groups
//       (G divisible by tp; fewer groups than ranks is refused: a group's key
//       and value would have to be replicated), so a rank's activations are
//       [B, T, G/K, R+2, Dh] and attention needs no communication; the query
//       and key slots rotated (ops::rotary_forward, Hugging Face's half-split
//       pairs) at each token's global position; ops::grouped_attention_*
//       (no repeated K/V; dropout `attention_dropout` on the probabilities,
//       each head's mask that of the tp = 1 layer: nn::attention_dropout);
//       proj row-parallel with no bias.
//   ParallelGatedMlp  SwiGLU: fc column-parallel [2F, C] (rows: gate, then
//       up), split so that a rank holds the same F/K rows of each ([gate |
//       up] per token), ops::swiglu, proj row-parallel; no biases.
//
// Both keep the names and initial values of the tp = 1 layers (shards of the
// logical tensors), as every tensor-parallel layer does.
#pragma once

#include <cstdint>
#include <string>

#include "parallel/ring_attention.h"
#include "parallel/tensor_parallel.h"

namespace tessera::parallel {

class ParallelGroupedAttention : public nn::Module {
 public:
  ParallelGroupedAttention(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden,
                           int64_t heads, int64_t groups, float rotary_base, float dropout,
                           float attention_dropout = 0.0f, bool bias = false);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  ColumnParallelLinear& qkv() { return *qkv_; }
  RowParallelLinear& proj() { return *proj_; }

 private:
  // positions [T] (i64) of `tokens` tokens starting at `first`, on the layer's device.
  Tensor positions(int64_t first, int64_t tokens) const;
  Tensor attend_with_cache(const Tensor& rotated, nn::Saved& saved, const nn::Pass& pass);
  Tensor attend_over_ring(const Tensor& rotated, const Tensor& where, nn::Saved& saved, const nn::Pass& pass);
  Tensor ring_backward(const Tensor& grad_out, nn::Saved& saved);
  int64_t hidden_, local_groups_, per_group_, head_dim_;  // per_group_: R query heads
  int64_t first_head_;                                    // the whole layer's index of this rank's first query head
  float rotary_base_, attention_dropout_;
  Communicator* context_ = nullptr;  // context parallelism: the cp group (null: whole sequences)
  ColumnParallelLinear* qkv_;
  RowParallelLinear* proj_;
  TensorParallelDropout* dropout_;
};

class ParallelGatedMlp : public nn::Module {
 public:
  ParallelGatedMlp(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden,
                   int64_t ffn_hidden, float dropout, bool bias = false);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  ColumnParallelLinear& fc() { return *fc_; }
  RowParallelLinear& proj() { return *proj_; }

 private:
  ColumnParallelLinear* fc_;
  RowParallelLinear* proj_;
  TensorParallelDropout* dropout_;
};

}  // namespace tessera::parallel
