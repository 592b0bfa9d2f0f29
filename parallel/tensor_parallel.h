// Tensor parallelism (Megatron-LM): single layers split across the ranks of
// a tensor-parallel group ("tp" axis of the process grid, K ranks).
//
//   ColumnParallelLinear  weight [out, in] split by output features (rows):
//                         forward identity on its input, backward all-reduce
//                         of the input gradient ("copy to the region").
//   RowParallelLinear     weight split by input features (columns): forward
//                         all-reduce of the output ("reduce from the region"),
//                         backward identity. Its bias is whole and added once,
//                         after the reduction.
//   So an MLP (fc column-, proj row-parallel) or an attention block (qkv
//   column-parallel split by heads, proj row-parallel) costs exactly one
//   all-reduce in forward and one in backward.
//
//   VocabParallelEmbedding  table [V, C] split by vocabulary rows; each rank
//                         looks up the ids it holds (zeros for the others) and
//                         the partial embeddings are summed over the group.
//   VocabParallelCrossEntropy  over logits [N, V/K] split the same way: the
//                         row max and the sum of exponentials (and the target's
//                         logit) are all-reduced; the full logits never exist.
//   With weight tying the LM head multiplies by the same table shard.
//
// Sequence parallelism (TensorParallelism::sequence_parallel): outside the
// split layers (LayerNorms, dropout, residual adds) activations are sharded
// along the sequence: rank r holds positions [r·T/K, (r+1)·T/K) of every
// sequence, [B, T/K, C]. A column-parallel layer all-gathers its input along
// the sequence (backward: reduce-scatter), a row-parallel layer and the
// embedding reduce-scatter their output along it (backward: all-gather): the
// same bytes as the all-reduce they replace, with 1/K of the activations.
// Parameters used on a sequence shard (LayerNorm weights, the row-parallel
// biases, the position table) get only part of their gradient on each rank:
// their gradients are summed over the group once per block backward
// (SequenceParallelGradients), before any data-parallel hook sees them.
//
// Parameters keep the names and initial values of the tp = 1 model: each
// layer records which part of the logical tensor it holds (nn::ParameterShard)
// and draws exactly those elements (nn::init_shard_*), so tp = K from seed s
// holds the slices of the tp = 1 model from seed s, and checkpoints store the
// logical tensors whole.
//
// Dropout (Megatron's rule): inside replicated regions (the residual stream)
// every rank draws the tp = 1 mask, and under sequence parallelism each rank
// draws its own positions of that same mask (masks indexed by the global
// element); inside split regions (Dropout region `split`) each rank draws a
// different mask (its tensor-parallel rank is mixed into the seed).
// Everything is reproducible from (seed, step, micro-batch, name).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/models.h"
#include "nn/module.h"
#include "parallel/communicator.h"

namespace tessera::parallel {

// The group a tensor-parallel layer is split over, and how.
struct TensorParallelism {
  Communicator* group = nullptr;   // the tp axis (size 1: every layer is whole)
  bool sequence_parallel = false;  // --sequence-parallel
  // Context parallelism: the cp axis the sequence is split over (null or one
  // rank: whole sequences). Each rank holds its zigzag share of every
  // sequence (parallel/ring_attention.h); attention runs as ring attention
  // over this group, positions are the share's global ones.
  Communicator* context = nullptr;
  // Expert parallelism: the ep axis a mixture of experts spreads its experts
  // over (parallel/moe.h; null or one rank: every expert on every rank).
  Communicator* experts = nullptr;
  int context_size() const { return context ? context->size() : 1; }
  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
};

// The global positions of this rank's tokens of sequences of `tokens` tokens
// per cp rank: under context parallelism its zigzag share of sequences of
// tokens·C (parallel::context_share), else 0 .. tokens − 1; under sequence
// parallelism its tensor-parallel rank's part of those.
std::vector<int64_t> held_positions(const TensorParallelism& tp, int64_t tokens);

// ---------------------------------------------------------------------------
// The communication of the regions (blocking; K = 1 costs nothing)
// ---------------------------------------------------------------------------
// Sums `x` over the group, in place.
void tp_all_reduce(Communicator& group, Tensor& x);
// x [B, T/K, C] (this rank's positions) → [B, T, C] (every rank's, in order).
Tensor tp_gather_sequence(Communicator& group, const Tensor& x);
// x [B, T, C] partial sums → [B, T/K, C]: this rank's positions of the sum.
Tensor tp_reduce_scatter_sequence(Communicator& group, const Tensor& x);
// x [..., n] → [..., K·n]: every rank's columns, in rank order.
Tensor tp_gather_last_dim(Communicator& group, const Tensor& x);
// This rank's columns [r·n/K, (r+1)·n/K) of x [..., n] (a copy).
Tensor tp_split_last_dim(Communicator& group, const Tensor& x);
// The same over a layer's TensorParallelism: nothing when it is one rank.
void all_reduce_in(const TensorParallelism& tp, Tensor& x);
Tensor gather_sequence_in(const TensorParallelism& tp, const Tensor& x);
Tensor reduce_scatter_sequence_in(const TensorParallelism& tp, const Tensor& x);

// ---------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------
// How a column-parallel layer's output features are split. Plain: into K
// contiguous blocks. Heads: the output is `groups` × heads × head_dim (a
// fused QKV projection: groups 3) and each rank takes heads/K heads of every
// group, so its output is [..., groups, heads/K, head_dim] as attention wants.
struct OutputSplit {
  int64_t groups = 1;
  int64_t heads = 0;  // 0: plain split
};

// y = act(x·Wᵀ + b) with W [out, in] split by rows: this rank computes its
// out/K features. Input: [..., in] whole (or [B, T/K, in] under sequence
// parallelism, gathered here). Output: [..., out/K], or [..., out] whole with
// gather_output (plain splits only). Init: uniform(±1/√in) (PyTorch's Linear).
class ColumnParallelLinear : public nn::Module {
 public:
  ColumnParallelLinear(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t in_features,
                       int64_t out_features, bool bias = true, ops::Activation activation = ops::Activation::none,
                       OutputSplit split = {}, bool gather_output = false);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  bool splits_backward() const override { return true; }
  nn::Parameter& weight() { return *weight_; }
  nn::Parameter* bias() { return bias_; }
  int64_t local_out_features() const { return local_out_; }

 private:
  TensorParallelism tp_;
  int64_t in_, out_, local_out_;
  ops::Activation activation_;
  bool gather_output_;
  nn::Parameter* weight_;
  nn::Parameter* bias_ = nullptr;
};

// y = x·Wᵀ + b with W [out, in] split by columns: this rank multiplies its
// in/K input features (input [..., in/K], the output of a column-parallel
// layer) and the partial outputs are summed over the group (or
// reduce-scattered along the sequence: output [B, T/K, out]). The bias is
// whole. Init: uniform(±1/√in).
class RowParallelLinear : public nn::Module {
 public:
  RowParallelLinear(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t in_features,
                    int64_t out_features, bool bias = true);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  bool splits_backward() const override { return true; }
  nn::Parameter& weight() { return *weight_; }
  nn::Parameter* bias() { return bias_; }

 private:
  TensorParallelism tp_;
  int64_t in_, out_, local_in_;
  nn::Parameter* weight_;
  nn::Parameter* bias_ = nullptr;
};

// ids [B, T] → [B, T, C] whole (or [B, T/K, C] under sequence parallelism);
// table [V, C] split by rows (V divisible by K). Init: normal(0, 1).
class VocabParallelEmbedding : public nn::Module {
 public:
  VocabParallelEmbedding(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t vocab_size,
                         int64_t dim);
  Tensor forward_impl(const Tensor& ids, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  bool splits_backward() const override { return true; }
  nn::Parameter& weight() { return *weight_; }
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_size() const { return vocab_; }

 private:
  TensorParallelism tp_;
  int64_t vocab_, dim_, vocab_begin_, local_vocab_;
  nn::Parameter* weight_;
};

// Dropout in a tensor-parallel model.
//   replicated: the input is the same on every rank ([B, T, C]), and so is the
//               mask: the tp = 1 mask. Under sequence parallelism the input is
//               [B, T/K, C] and each rank applies its positions of that mask;
//               under context parallelism those of its zigzag share
//               (held_positions): one rank's mask, whatever the layout.
//   split:      the input is split across ranks (e.g. attention heads); each
//               rank draws its own mask (seed mixed with its rank).
class TensorParallelDropout : public nn::Module {
 public:
  enum class Region { replicated, split };
  TensorParallelDropout(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, float p,
                        Region region = Region::replicated);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;

 private:
  // Applies the mask (forward and backward are the same multiply).
  Tensor apply(const Tensor& x, uint64_t seed, int64_t tokens) const;
  TensorParallelism tp_;
  float p_;
  Region region_;
};

// Sums over the group the gradients a backward pass adds into `parameters`
// (parameters used on sequence shards), once per pass and in one collective:
//   SequenceParallelGradients sum(params, group);
//   sum.begin();   // gradients point at zeroed scratch; hooks held back
//   ... backward ...
//   sum.end();     // scratch all-reduced, added into the gradients, hooks fired
class SequenceParallelGradients {
 public:
  SequenceParallelGradients(std::vector<nn::Parameter*> parameters, Communicator& group);
  void begin();
  void end();

 private:
  std::vector<nn::Parameter*> parameters_;
  Communicator& group_;
  std::vector<Tensor> grads_;
  std::vector<std::function<void(nn::Parameter&)>> hooks_;
  Tensor scratch_;
};

// Causal self-attention with heads split across the group: qkv
// column-parallel (heads/K heads of each of q, k, v per rank), attention on
// the local heads (dropout `attention_dropout` on its probabilities, each
// head's mask that of the tp = 1 layer: nn::attention_dropout), proj
// row-parallel, dropout (replicated region).
// Children "<name>.qkv", "<name>.proj", "<name>.dropout"; with a group of
// one (TensorParallelism{}) it is the whole layer.
class ParallelSelfAttention : public nn::Module {
 public:
  ParallelSelfAttention(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden,
                        int64_t heads, float dropout, float attention_dropout = 0.0f, bool bias = true);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  ColumnParallelLinear& qkv() { return *qkv_; }
  RowParallelLinear& proj() { return *proj_; }

 private:
  int64_t hidden_, local_heads_, head_dim_;
  int64_t first_head_;  // the whole layer's index of this rank's first head
  float attention_dropout_;
  Communicator* context_ = nullptr;  // context parallelism: the cp group (null: whole sequences)
  ColumnParallelLinear* qkv_;
  RowParallelLinear* proj_;
  TensorParallelDropout* dropout_;
};

// fc column-parallel (fused GELU) → proj row-parallel → dropout; children
// "<name>.fc", "<name>.proj", "<name>.dropout".
class ParallelMlp : public nn::Module {
 public:
  ParallelMlp(const nn::ModelSpec& spec, std::string name, TensorParallelism tp, int64_t hidden, int64_t ffn_hidden,
              float dropout, bool bias = true);
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass& pass) override;
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override;
  ColumnParallelLinear& fc() { return *fc_; }
  RowParallelLinear& proj() { return *proj_; }

 private:
  ColumnParallelLinear* fc_;
  RowParallelLinear* proj_;
  TensorParallelDropout* dropout_;
};

// Why a model configuration cannot be split K ways (empty: it can). Names the
// numbers: heads, vocabulary, ffn size, sequence length under sequence parallelism.
std::string tensor_parallel_problem(const nn::ModelConfig& config, int tp, bool sequence_parallel);
// The group sizes a model configuration splits over (tensor_parallel_problem
// empty, no sequence parallelism), ascending: 1 and the divisors of its head
// count that also divide the vocabulary and the MLP. For a trained model,
// whose sizes are fixed, the rank counts that can run it.
std::vector<int> tensor_parallel_sizes(const nn::ModelConfig& config);


// Cross-entropy over logits split by vocabulary: [N, V/K] or [B, T, V/K]
// holding columns [vocab_begin, vocab_begin + V/K) of a vocabulary of
// vocab_size, against the whole targets. Same results as nn::CrossEntropyLoss
// on the gathered logits (ignored targets included); backward writes each
// rank's columns of the gradient in place.
class VocabParallelCrossEntropy : public nn::Loss {
 public:
  VocabParallelCrossEntropy(Communicator& group, int64_t vocab_begin, int64_t vocab_size, int64_t ignore_index = -100);
  nn::LossValue forward(const Tensor& logits, const Tensor& targets, nn::Saved& saved) const override;
  void backward(Tensor& logits, const Tensor& targets, float scale, nn::Saved& saved) const override;

 private:
  Communicator& group_;
  int64_t vocab_begin_, vocab_size_, ignore_index_;
};

}  // namespace tessera::parallel
