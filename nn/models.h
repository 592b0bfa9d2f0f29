// Models: the configuration the CLI fills (ModelConfig, validated with
// messages that name the flag), and what the models are. They are built on
// the models/ floor (models/registry.h: one file and one registry row each):
//
//   mlp  InputCast → Flatten → [Linear + fused ReLU]* → Linear(num_classes)
//        parameters "layers.<i>.weight/bias"; PyTorch's Linear init
//        (uniform ±1/√fan_in for weights and biases).
//   cnn  (LeNet-style, for 28×28-ish images) InputCast → conv1 5×5·32 pad 2 →
//        ReLU → maxpool 2 → conv2 5×5·64 pad 2 → ReLU → maxpool 2 → Flatten →
//        fc1 1024 + fused ReLU → fc2 num_classes; PyTorch's default init.
//   gpt  (models/decoder.h with GPT-2's choices, over the layers of parallel/)
//        ids [B, T] (i32/i64) → wte [V, C] + wpe [T, C] → dropout → blocks.<i>
//        (pre-LN blocks) → ln_f → logits [B, T, V] = x·wteᵀ (tied:
//        wte gets gradients from both uses). GPT-2 init: normal(0, 0.02) for
//        weights and embeddings, zero biases, unit norm weights, and the
//        residual projections (attn.proj, mlp.proj) normal(0, 0.02/√(2·layers)).
//
// Weight decay is on for matrices and embeddings, off for biases and norm weights.
// Inputs of mlp/cnn are [N, C, H, W] (or [N, C·H·W] for the mlp) in any
// floating dtype; logits come out in the model's compute dtype.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nn/layers.h"
#include "nn/model_kind.h"
#include "nn/module.h"

namespace tessera::nn {


struct ModelConfig {
  ModelKind kind = ModelKind::mlp;  // --model

  // mlp: hidden layer widths (--hidden 1024,1024).
  std::vector<int64_t> hidden{1024, 1024};
  // mlp, cnn: the dataset's input shape (C, H, W) and number of classes.
  int64_t channels = 1, height = 28, width = 28;
  int64_t num_classes = 10;

  // gpt, llama (the language models)
  int64_t vocab_size = 256;     // --vocab-size (from the dataset)
  int64_t seq_length = 256;     // --seq-length: the longest sequence (positions in wpe)
  int64_t num_layers = 4;       // --num-layers
  int64_t num_heads = 4;        // --num-heads
  int64_t hidden_size = 256;    // --hidden-size
  int64_t ffn_hidden_size = 0;  // --ffn-hidden-size; 0 means 4·hidden_size
  float dropout = 0.0f;         // --dropout (embeddings, attention and MLP outputs)
  bool recompute = false;       // --recompute: blocks keep only their input and recompute in backward
  // --attention-dropout: dropout on the attention probabilities (training only; GPT-2's attn_pdrop)
  float attention_dropout = 0.0f;

  // The decoder's choices (Megatron's switches, each working on its own for
  // either language model; unset: the model's own, decoder_defaults):
  // --normalization, --position-embedding-type rope, --swiglu,
  // --disable-bias-linear (bias false), --untie-embeddings-and-output-weights.
  std::optional<Normalization> normalization;
  std::optional<bool> rotary, swiglu, bias, untie_embeddings;
  // Grouped-query attention (--num-query-groups G: key/value heads, G divides
  // --num-heads; 0 means G = heads), RoPE's base (--rotary-base), the norms'
  // epsilon (--norm-epsilon).
  int64_t num_query_groups = 0;
  float rotary_base = 10000.0f;
  float norm_epsilon = 1e-5f;

  // Mixture of experts (Megatron's flags; parallel/moe.h). --num-experts E >
  // 0 makes the MLP of the layers --moe-layer-freq picks a router over E
  // SwiGLU experts of width --moe-ffn-hidden-size (0: ffn()), each token going
  // to its --moe-router-topk best; the coefficients of the load-balancing and
  // z losses, and the capacity factor (0: dropless).
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  // "N": layers 0, N, 2N, ... (Megatron's integer); "[1,0,1,1]": one 0/1 per layer.
  std::string moe_layer_freq = "1";
  int64_t moe_ffn_hidden_size = 0;
  double moe_aux_loss_coeff = 0.0, moe_z_loss_coeff = 0.0, moe_expert_capacity_factor = 0.0;

  // The choices in force: those set, else the model's defaults.
  DecoderChoices decoder() const;
  bool untied() const { return decoder().untie_embeddings; }
  // The MLP's width: --ffn-hidden-size, else 4·hidden, or for SwiGLU
  // 8/3·hidden rounded up to a multiple of 256 (Meta's multiple_of).
  int64_t ffn() const;
  // Key/value heads: --num-query-groups, or one per head.
  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_heads; }
  // Whether attention keeps its qkv rows in the grouped layout [G, R+2, Dh]
  // (parallel::ParallelGroupedAttention: the Llama's, and any model with
  // rotary embeddings or G < H) rather than GPT-2's [3, H, Dh].
  bool grouped_attention() const;
  // Whether block `layer`'s MLP is a mixture of experts (--num-experts and --moe-layer-freq).
  bool moe_layer(int64_t layer) const;
  // Each expert's width: --moe-ffn-hidden-size, else ffn().
  int64_t moe_ffn() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn(); }
  // Throws tessera::Error naming the flag and the value at fault.
  void validate() const;
};

// The divisor of `n` (>= 1) closest to `target`, the larger on a tie: the
// head count to suggest when --num-heads does not divide the width. O(sqrt n).
int64_t nearest_divisor(int64_t n, int64_t target);

// The layers a pipeline stage holds: layers [begin, end) of the model's
// partitionable layers (the GPT's Transformer blocks, the MLP's linear
// layers), plus what comes before them on the first stage (embeddings,
// input cast) and after them on the last (final norm, LM head).
class Module;

struct StageLayers {
  int stage = 0, stages = 1;
  int64_t begin = 0, end = -1;  // end -1: to the last layer
  // The last chunk of a V-shaped pipeline (zbv) sits on the first chunk's
  // stage: that chunk's token embedding, which a tied head then uses instead
  // of a copy of its own. Null otherwise.
  Module* shared_embedding = nullptr;
  bool first() const { return stage == 0; }
  bool last() const { return stage + 1 == stages; }
};

// What each partitionable layer costs (its parameter elements), and what the
// first and last stage pay besides (GPT: the embeddings; the final norm and
// the LM head's copy of the tied table), for balancing pipeline stages. Each
// model's row in the registry (models/registry.h) computes them.
struct LayerCosts {
  std::vector<int64_t> layers;
  int64_t first = 0, last = 0;
};

// Total number of parameter elements of the logical model (whole tensors,
// also when a rank holds only tensor-parallel shards of them).
int64_t parameter_count(Module& model);

}  // namespace tessera::nn
