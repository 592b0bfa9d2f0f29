// ParallelTransformerBlock: the pre-norm decoder block every language model
// of the house is made of, split over a tensor-parallel group, with the
// choices of its nn::ModelConfig (nn::DecoderChoices, Megatron's switches):
//
//   x += attn(norm(x));  x += mlp(norm(x))
//
//   norm  nn::LayerNorm (GPT-2's, with its bias) or nn::RMSNorm (--normalization),
//         epsilon --norm-epsilon;
//   attn  ParallelSelfAttention (GPT-2's qkv layout [3, H, Dh]) or, with
//         rotary embeddings or G < H key/value groups, ParallelGroupedAttention
//         (Megatron's grouped layout; rotary when chosen);
//   mlp   ParallelMlp (fused GELU) or ParallelGatedMlp (--swiglu), or in the
//         layers --moe-layer-freq picks (with --num-experts) a
//         MixtureOfExperts (parallel/moe.h: its experts over the ep group);
//   biases in every linear layer unless --disable-bias-linear.
//
// Children "<name>.ln1", "<name>.attn", "<name>.ln2", "<name>.mlp";
// recomputation as every nn::PreLnBlock's. Under sequence parallelism its
// input and output are [B, T/K, C], and the gradients each rank holds only a
// part of (the norms', the row-parallel layers' biases) are summed over the
// group after its backward.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "nn/models.h"
#include "parallel/moe.h"
#include "parallel/tensor_parallel.h"

namespace tessera::parallel {

class ParallelTransformerBlock : public nn::PreLnBlock {
 public:
  // Block `layer` of the model (whether its MLP has experts: ModelConfig::moe_layer).
  ParallelTransformerBlock(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                           const nn::ModelConfig& model, int64_t layer = 0);
  // GPT-2's block of these sizes.
  ParallelTransformerBlock(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden,
                           int64_t heads, int64_t ffn_hidden, float dropout, float attention_dropout, bool recompute);
  nn::Module& attn() { return *attn_; }
  nn::Module& mlp() { return *mlp_; }

 private:
  void before_backward() override;
  void after_backward() override;

  nn::Module* attn_;
  nn::Module* mlp_;
  std::unique_ptr<SequenceParallelGradients> partial_;  // sequence parallelism only
};

// A norm of the model's choice (nn::LayerNorm or nn::RMSNorm, --norm-epsilon) over `dim` features.
// The mixture of experts' settings of the model's flags.
MoeConfig moe_config(const nn::ModelConfig& model);

std::unique_ptr<nn::Module> make_norm(const nn::ModelSpec& spec, std::string name, int64_t dim,
                                      const nn::ModelConfig& model);

}  // namespace tessera::parallel
