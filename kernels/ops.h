// The operator library: every operator MLP, CNN, GPT and Llama training needs,
// forward and backward, on the CPU and on CUDA devices.
//
// Conventions, for every function here:
//   - Outputs are passed in, allocated by the caller with the documented shape
//     and dtype (so callers reuse buffers and tests poison outputs first).
//   - All tensors of one call live on one device; the work runs on that
//     device's compute stream (see core/context.h) and is ordered after
//     earlier work there. CPU calls return when the work is done.
//   - Floating dtypes are f32, bf16 and f16; arithmetic and reductions are
//     done in f32 whatever the storage type. Index tensors are i32 or i64.
//   - Shapes are row-major; "rows" means all leading dimensions flattened.
//   - Arguments are validated here (shape, dtype, device), with a message that
//     names the operator and the offending argument; backends trust them.
//   - Gradients are written (overwriting) unless `accumulate` is true, in
//     which case they are added to what the output already holds.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace tessera::ops {

enum class Activation { none, relu, gelu };

// ---------------------------------------------------------------------------
// Matrix multiply
// ---------------------------------------------------------------------------
struct MatmulOptions {
  bool transpose_a = false;  // use Aᵀ: a is stored [K, M] (or [B, K, M])
  bool transpose_b = false;  // use Bᵀ: b is stored [N, K] (or [B, N, K])
  float alpha = 1.0f;
  float beta = 0.0f;             // C = act(alpha·op(A)·op(B) + beta·C + bias)
  const Tensor* bias = nullptr;  // [N], added to every row of C
  Activation activation = Activation::none;
  Tensor* pre_activation = nullptr;  // if given: receives the value before the activation (shape of C)
};

// C = alpha·op(A)·op(B) + beta·C (+ bias, then activation).
//   plain:   a [M, K], b [K, N], c [M, N]
//   batched: a [B, M, K], b [B, K, N] or [K, N] (shared by all batches), c [B, M, N]
// a and b share a dtype; c has that dtype or f32.
void matmul(const Tensor& a, const Tensor& b, Tensor& c, const MatmulOptions& options = {});

// Gradients of C = op(A)·op(B) given dC, in A's and B's stored layouts:
//   grad_a = dC·op(B)ᵀ (transposed back if transpose_a), grad_b = op(A)ᵀ·dC (likewise).
// Either output may be null. For batched A with a shared 2-D B, grad_b sums over the batch.
// Without grad_a, b may be a placeholder (Tensor::placeholder: its shape and
// dtype only): a weight's gradient while its values are sharded (ZeRO-3).
void matmul_backward(const Tensor& grad_c, const Tensor& a, const Tensor& b, Tensor* grad_a, Tensor* grad_b,
                     bool transpose_a = false, bool transpose_b = false, bool accumulate = false);

// y = x + bias on every row. x, y [R, C] (y may be x); bias [C].
void bias_add(const Tensor& x, const Tensor& bias, Tensor& y);
// grad_bias [C] = Σ_rows grad_y [R, C].
void bias_add_backward(const Tensor& grad_y, Tensor& grad_bias, bool accumulate = false);

// ---------------------------------------------------------------------------
// Elementwise activations (any shape; y / grad_x may alias the input)
// ---------------------------------------------------------------------------
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x);
// GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
void gelu_forward(const Tensor& x, Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x);

// SwiGLU, the gated MLP activation of Llama-family models, fused:
// x [..., 2F] holds [gate | up] in each row, y [..., F] = silu(gate)·up with
// silu(a) = a·σ(a) = a / (1 + e^−a). grad_x [..., 2F] = [dgate | dup]
// (grad_x may be x itself: each element pair is read before it is written).
void swiglu_forward(const Tensor& x, Tensor& y);
void swiglu_backward(const Tensor& x, const Tensor& grad_y, Tensor& grad_x);

// ---------------------------------------------------------------------------
// Row-wise operators (over the last dimension D; rows = numel / D)
// ---------------------------------------------------------------------------
void softmax_forward(const Tensor& x, Tensor& y);
void softmax_backward(const Tensor& y, const Tensor& grad_y, Tensor& grad_x);  // grad_x may alias grad_y

// Fused log-softmax + cross-entropy. logits [N, V]; targets [N] i32/i64;
// losses [N] f32 (0 where target == ignore_index); logsumexp [N] f32, kept for
// the backward pass. A target outside [0, V) that is not ignore_index gives a
// NaN loss (so it surfaces in the loss, on any device).
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& logsumexp,
                           int64_t ignore_index = -100);
// grad_logits[n, v] = grad_losses[n]·(softmax(logits[n])[v] − [v == targets[n]]), zero rows where ignored.
// grad_logits may be the logits tensor itself: the backward then overwrites
// the only copy of the logits, which is never materialised twice.
// Vocabulary-parallel (see cross_entropy_shard_max below): logits [N, Vl] are
// the columns [vocab_begin, vocab_begin + Vl) of a vocabulary of vocab_size
// (0: the logits' width, the whole vocabulary) and logsumexp is the global one
// (from cross_entropy_shard_finish); the one-hot term applies only where
// target − vocab_begin is a column of this shard. A target outside
// [0, vocab_size) that is not ignore_index gives a NaN row on every shard.
void cross_entropy_backward(const Tensor& logits, const Tensor& logsumexp, const Tensor& targets,
                            const Tensor& grad_losses, Tensor& grad_logits, int64_t ignore_index = -100,
                            int64_t vocab_begin = 0, int64_t vocab_size = 0);

// Vocabulary-parallel cross-entropy: `logits` [N, Vl] hold the columns
// [vocab_begin, vocab_begin + Vl) of logits over a vocabulary of vocab_size
// (the other columns live on other ranks). The caller combines ranks between
// the steps: 1) cross_entropy_shard_max → all-reduce(max) of row_max;
// 2) cross_entropy_shard_sums → all-reduce(sum) of sums; 3) cross_entropy_shard_finish.
// row_max [N] f32: the max over this shard's columns of each row.
void cross_entropy_shard_max(const Tensor& logits, Tensor& row_max);
// sums [2, N] f32: sums[0, n] = Σ_v exp(logits[n, v] − row_max[n]) over this shard's columns;
// sums[1, n] = logits[n, target − vocab_begin] when the target falls in this shard, else 0
// (0 for ignored rows too). row_max: the global (all-reduced) max.
void cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets, const Tensor& row_max, int64_t vocab_begin,
                              Tensor& sums, int64_t ignore_index = -100);
// From the all-reduced row_max and sums: logsumexp[n] = row_max[n] + log(sums[0, n]);
// losses[n] = logsumexp[n] − sums[1, n], 0 where target == ignore_index, NaN where the
// target is outside [0, vocab_size) (as cross_entropy_forward). targets [N] i32/i64;
// losses, logsumexp [N] f32 (logsumexp feeds cross_entropy_backward on every shard).
void cross_entropy_shard_finish(const Tensor& row_max, const Tensor& sums, const Tensor& targets, int64_t vocab_size,
                                Tensor& losses, Tensor& logsumexp, int64_t ignore_index = -100);

// LayerNorm: y = (x − mean)·rstd·weight + bias. x, y [R, D]; weight, bias [D]
// (bias may be undefined); mean, rstd [R] f32, kept for the backward pass.
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean, Tensor& rstd,
                       float eps = 1e-5f);
// grad_bias may be null (no bias).
void layernorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& grad_x, Tensor& grad_weight, Tensor* grad_bias,
                        bool accumulate = false);
// RMSNorm: y = x·rstd·weight, rstd = 1/√(mean(x²) + eps). rstd [R] f32.
void rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps = 1e-5f);
void rmsnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& grad_x,
                      Tensor& grad_weight, bool accumulate = false);

// ---------------------------------------------------------------------------
// Dropout (counter-based: nothing is stored, the backward regenerates the mask)
// ---------------------------------------------------------------------------
// y[i] = keep(i) ? x[i] / (1 − p) : 0, keep(i) = U(seed, kDropoutRngStream, offset + i) ≥ p.
inline constexpr uint64_t kDropoutRngStream = 0x64726f70;  // "drop"
void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset);
void dropout_backward(const Tensor& grad_y, Tensor& grad_x, float p, uint64_t seed, uint64_t offset);

// ---------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------
// out[n, :] = table[ids[n], :]. ids: any shape, N elements, i32/i64; table [V, D]; out [N, D].
// Vocabulary-parallel (vocab_size > 0): the table holds rows [vocab_begin,
// vocab_begin + V) of a vocabulary of vocab_size; ids held by other shards
// give zero rows (summing the shards' outputs gives the lookup), ids outside
// [0, vocab_size) are errors as ids outside [0, V) are otherwise.
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin = 0,
                       int64_t vocab_size = 0);
// grad_table[ids[n] − vocab_begin, :] += grad_out[n, :] (always accumulates;
// deterministic); ids held by other shards are skipped.
void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin = 0,
                        int64_t vocab_size = 0);

// ---------------------------------------------------------------------------
// Causal scaled-dot-product attention over packed projections
// ---------------------------------------------------------------------------
// qkv [B, T, 3, H, Dh] holds query, key and value of every head; out [B, T, H, Dh];
// logsumexp [B, H, T] f32, kept for the backward pass.
//   out[b,t,h] = Σ_{s≤t} softmax_s(scale·q[b,t,h]·k[b,s,h])·v[b,s,h],  scale = 1/√Dh if scale ≤ 0.
// Never materialises a T×T matrix for long T.
//
// Dropout on the attention probabilities (PyTorch's and Megatron's attention
// dropout, GPT-2's attn_pdrop): with P = softmax(scale·q·kᵀ + causal mask),
//   out = (P ∘ M / (1 − p))·V,  M[b, head, t, s] ~ Bernoulli(1 − p),
// logsumexp that of the undropped softmax. M is never stored: it is a pure
// function of (seed, offset + b, head_offset + h, t, s) (Philox, core/rng.h;
// kernels/functors/attention.h's attention_dropout_multiplier), so the
// backward pass regenerates it from the same argument, and a tensor-parallel
// rank whose heads are heads [head_offset, head_offset + H) of the whole
// model draws for each the mask the whole model draws. p = 0 (the default)
// is plain attention, at no cost.
struct AttentionDropout {
  float p = 0.0f;  // drop probability, in [0, 1)
  uint64_t seed = 0;
  uint64_t offset = 0;      // added to the batch index (a part of a larger batch)
  int64_t head_offset = 0;  // the whole model's index of this call's first query head
};
void attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale = 0.0f,
                       const AttentionDropout& dropout = {});
// grad_qkv [B, T, 3, H, Dh]; `dropout` the forward's.
void attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                        Tensor& grad_qkv, float scale = 0.0f, const AttentionDropout& dropout = {});
// Inference with a key/value cache (generation): keys and values [B, H, S, Dh]
// (qkv's dtype) hold the first `position` tokens' keys and values of a
// sequence of at most S. Writes the Tn new tokens' keys and values of qkv
// [B, Tn, 3, H, Dh] at positions [position, position + Tn), then
//   out[b,t,h] = Σ_{s ≤ position+t} softmax_s(scale·q[b,t,h]·keys[b,h,s])·values[b,h,s]
// (out [B, Tn, H, Dh]): the new tokens attend to everything before them and
// to each other causally, without recomputing the earlier tokens.
void attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                          float scale = 0.0f);

// Grouped-query attention (Llama's; G = H is multi-head, G = 1 multi-query)
// over the grouped projections qkv [B, T, G, R + 2, Dh]: for each key/value
// group g its R query heads (slots 0..R−1), then its key (slot R), then its
// value (slot R + 1). Query head h = g·R + j (H = G·R heads) attends with
// group g's key and value, which are read in place, never repeated:
//   out[b,t,h] = Σ_{s≤t} softmax_s(scale·q[b,t,g,j]·k[b,s,g,R])·v[b,s,g,R+1],
// out [B, T, H, Dh]; logsumexp [B, H, T] f32; scale = 1/√Dh if scale ≤ 0.
// Never materialises a T×T matrix for long T. (With R = 1 this is multi-head
// attention in another layout than attention_forward's.) `dropout` as
// attention_forward's, over query heads h = g·R + j (head_offset: the whole
// model's index of head 0 here, e.g. rank·H/K under tensor parallelism).
void grouped_attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale = 0.0f,
                               const AttentionDropout& dropout = {});
// grad_qkv [B, T, G, R + 2, Dh]: the key and value gradients summed over each group's R query heads.
void grouped_attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                                Tensor& grad_qkv, float scale = 0.0f, const AttentionDropout& dropout = {});
// attention_with_cache for grouped projections qkv [B, Tn, G, R + 2, Dh]: the
// cache keys and values [B, G, S, Dh] hold the G key/value heads (not H);
// out [B, Tn, H, Dh].
void grouped_attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                  float scale = 0.0f);

// ---------------------------------------------------------------------------
// Blockwise causal attention with global positions (context parallelism's ring)
// ---------------------------------------------------------------------------
// A sequence split over ranks (parallel/ring_attention.h) attends one key/value
// block at a time: the local queries q [B, Tq, H, Dh] (query head h = g·R + j
// uses key/value head g, R = H/G; G = H is multi-head) meet a block
// kv [B, Tk, G, 2, Dh] (per key/value head its key then its value: compact,
// what travels between ranks). q_positions [Tq] and k_positions [Tk] (i64)
// are the tokens' global positions: key s is visible to query t iff
// k_positions[s] ≤ q_positions[t]. Never materialises a Tq×Tk matrix.
// The partial results are f32 (a sequence's output and gradients sum over
// blocks, which rounding to bf16/f16 at each would spoil); q, kv, grad_out
// and out share one floating dtype; scale = 1/√Dh if scale ≤ 0. No dropout.
//
// The block's partial attention: out [B, Tq, H, Dh] f32, softmax-normalised
// over this block's visible keys, and logsumexp [B, H, Tq] f32 of its scaled
// scores; a query that sees no key of the block gets out 0 and logsumexp −∞.
void attention_block_forward(const Tensor& q, const Tensor& kv, const Tensor& q_positions, const Tensor& k_positions,
                             Tensor& out, Tensor& logsumexp, float scale = 0.0f);
// Merges a block's (block_out, block_logsumexp) into the running (out,
// logsumexp), in place, all f32 of the forward's shapes: the result is the
// attention over the union of the keys both have seen (log-sum-exp rule;
// −∞ is "nothing seen" and contributes nothing).
void attention_block_merge(const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out, Tensor& logsumexp);
// The gradients of one block, given the FINAL out [B, Tq, H, Dh] (q's dtype)
// and logsumexp [B, H, Tq] over every block (flash attention's backward with
// delta = rowsum(grad_out∘out)): ADDS the block's terms into
// grad_q [B, Tq, H, Dh] f32 and grad_kv [B, Tk, G, 2, Dh] f32 (each key/value
// head's gradient summed over its R query heads).
void attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,
                              const Tensor& logsumexp, const Tensor& q_positions, const Tensor& k_positions,
                              Tensor& grad_q, Tensor& grad_kv, float scale = 0.0f);

// ---------------------------------------------------------------------------
// Rotary position embedding (RoPE) of grouped projections
// ---------------------------------------------------------------------------
// qkv, out [B, T, G, R + 2, Dh] (the layout of grouped_attention_forward; out
// may be qkv itself), Dh even; positions [T] i32/i64: the position of each
// token (any values: a later chunk of a sequence, or non-contiguous ones).
// Rotates the R queries and the key of every group (slots 0..R) and copies
// the value (slot R + 1). Pairs are half-split as Hugging Face's rotate_half:
// element i with element i + Dh/2, i < Dh/2, rotated by the angle
// positions[t]·base^(−2i/Dh):
//   out[i] = x[i]·cos − x[i + Dh/2]·sin,   out[i + Dh/2] = x[i + Dh/2]·cos + x[i]·sin,
// with the angle in f32 exactly as transformers' LlamaRotaryEmbedding forms it.
void rotary_forward(const Tensor& qkv, const Tensor& positions, Tensor& out, float base);
// The transpose (the inverse rotation, by −angle) of grad_out [B, T, G, R + 2, Dh]
// into grad_qkv (which may be grad_out itself); the value's gradient is copied.
void rotary_backward(const Tensor& grad_out, const Tensor& positions, Tensor& grad_qkv, float base);

// ---------------------------------------------------------------------------
// Attention projections split for the ring (context parallelism)
// ---------------------------------------------------------------------------
// The queries and the compact key/value block that ring attention takes
// (parallel/ring_attention.h) out of one layer's projections qkv, GPT-2's
// [B, T, 3, H, Dh] (grouped false) or Megatron's grouped [B, T, G, R + 2, Dh]
// (grouped true): q [B, T, H, Dh] (query head h = g·R + j), kv [B, T, G, 2, Dh]
// (per key/value head its key, then its value; G = H for GPT-2's). q and kv
// in qkv's dtype. Copies: no arithmetic.
void split_qkv(const Tensor& qkv, bool grouped, Tensor& q, Tensor& kv);
// The transpose: grad_q [B, T, H, Dh] and grad_kv [B, T, G, 2, Dh] (f32, or
// grad_qkv's dtype) written into grad_qkv (every element of it, rounded to
// its dtype) in the layout split_qkv read.
void join_qkv(const Tensor& grad_q, const Tensor& grad_kv, bool grouped, Tensor& grad_qkv);

// ---------------------------------------------------------------------------
// Mixture-of-experts routing
// ---------------------------------------------------------------------------
// Mixtral's router over E experts for N tokens: the softmax over every
// expert, the top_k most likely (ties: the lower index first), their
// probabilities renormalised to sum to 1 (the same as Megatron-Core's softmax
// over the top-k logits). logits [N, E] f32 → probs [N, E] f32 (the whole
// softmax, for the load-balancing loss), experts [N, K] i32 (most likely
// first), weights [N, K] f32, logsumexp [N] f32 (for the z-loss); K = experts.size(1).
void moe_route(const Tensor& logits, Tensor& probs, Tensor& experts, Tensor& weights, Tensor& logsumexp);
// grad_logits [N, E] f32 (written) from the forward's probs, experts and
// weights and the gradients of the weights [N, K] f32, of the probabilities
// [N, E] f32 (null: none) and of logsumexp [N] f32 (null: none).
void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& grad_weights,
                        const Tensor* grad_probs, const Tensor* grad_logsumexp, Tensor& grad_logits);

// Token dispatch. A plan of M slots: pairs [M] i32, pairs[m] = t·K + j (the
// j-th choice of token t), grouped by expert; slot_of [N, K] i32, the slot of
// each choice or −1 where it was dropped (over capacity). x, out, ys and
// the gradients [·, C] share one floating dtype; sums are f32.
// out [M, C]: row m is x's row pairs[m] / top_k (each expert's tokens contiguous).
void moe_permute(const Tensor& x, const Tensor& pairs, int64_t top_k, Tensor& out);
// grad_x [N, C] (written): each token's kept slots' gradients summed.
void moe_permute_backward(const Tensor& grad_slots, const Tensor& slot_of, Tensor& grad_x);
// out [N, C] (written): Σ_j weights[t, j]·ys[slot_of[t, j]] over the kept choices.
void moe_combine(const Tensor& ys, const Tensor& slot_of, const Tensor& weights, Tensor& out);
// grad_ys [M, C] and grad_weights [N, K] f32 (written; 0 for dropped choices).
void moe_combine_backward(const Tensor& grad_out, const Tensor& ys, const Tensor& pairs, const Tensor& slot_of,
                          const Tensor& weights, Tensor& grad_ys, Tensor& grad_weights);

// ---------------------------------------------------------------------------
// Convolution and pooling (NCHW)
// ---------------------------------------------------------------------------
struct Conv2dParams {
  int stride_h = 1, stride_w = 1;
  int pad_h = 0, pad_w = 0;
};
// x [N, C, H, W], weight [K, C, R, S], bias [K] (may be undefined), y [N, K, P, Q].
Shape conv2d_output_shape(const Shape& x, const Shape& weight, const Conv2dParams& params);
void conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, const Conv2dParams& params);
// Any of grad_x, grad_weight, grad_bias may be null.
void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight, Tensor* grad_x, Tensor* grad_weight,
                     Tensor* grad_bias, const Conv2dParams& params, bool accumulate = false);

struct Pool2dParams {
  int kernel_h = 2, kernel_w = 2;
  int stride_h = 2, stride_w = 2;
  int pad_h = 0, pad_w = 0;
};
// x [N, C, H, W], y [N, C, P, Q]; indices [N, C, P, Q] i32: position (h·W + w)
// of each maximum within its input plane, kept for the backward pass.
Shape maxpool2d_output_shape(const Shape& x, const Pool2dParams& params);
void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const Pool2dParams& params);
void maxpool2d_backward(const Tensor& grad_y, const Tensor& indices, Tensor& grad_x, const Pool2dParams& params);

// ---------------------------------------------------------------------------
// Whole-tensor reductions, into a one-element f32 tensor `out` [1] on the same device
// ---------------------------------------------------------------------------
void sum(const Tensor& x, Tensor& out);
void mean(const Tensor& x, Tensor& out);
void max(const Tensor& x, Tensor& out);
void sum_squares(const Tensor& x, Tensor& out);
// Gradients given grad_out [1] f32: sum → grad_out everywhere; mean → grad_out / n;
// sum_squares → 2·x·grad_out; max → grad_out at the first maximum, 0 elsewhere.
void sum_backward(const Tensor& grad_out, Tensor& grad_x);
void mean_backward(const Tensor& grad_out, Tensor& grad_x);
void sum_squares_backward(const Tensor& x, const Tensor& grad_out, Tensor& grad_x);
void max_backward(const Tensor& x, const Tensor& grad_out, Tensor& grad_x);

// ---------------------------------------------------------------------------
// Fused optimizer steps, one call per parameter buffer
// ---------------------------------------------------------------------------
// The hyper-parameters in double, as torch.optim.AdamW holds them (Python
// floats): the step's scalars (bias corrections 1 − β^step, step size) are
// computed from them in double, the per-element update in f32.
struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled: param ·= 1 − lr·weight_decay, before the Adam update
  int64_t step = 1;           // 1-based, for bias correction
  float grad_scale = 1.0f;    // gradients are multiplied by this first (loss-scale unscaling, clipping)
};
// param, m, v: f32 [n] (param is the master copy); grad [n] any floating dtype.
// param_copy, if given ([n] bf16/f16/f32), receives the updated parameter (the model's low-precision weights).
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& params,
                Tensor* param_copy = nullptr);

struct SgdParams {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;  // L2: added to the gradient
  bool nesterov = false;
  bool first_step = false;  // the momentum buffer starts as the gradient (PyTorch's rule)
  float grad_scale = 1.0f;
};
// param f32 [n], grad [n] any floating dtype, momentum_buffer f32 [n] (unused when momentum == 0).
void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const SgdParams& params,
              Tensor* param_copy = nullptr);

// ---------------------------------------------------------------------------
// Casts and BLAS-1 style helpers (any shape, same number of elements)
// ---------------------------------------------------------------------------
void cast(const Tensor& x, Tensor& y);                    // between f32, bf16, f16 (round to nearest even)
void scale_(Tensor& x, float alpha);                      // x ·= alpha
void axpy(float alpha, const Tensor& x, Tensor& y);       // y += alpha·x; y has x's dtype or f32 (accumulator)
void add(const Tensor& a, const Tensor& b, Tensor& out);  // out = a + b (out may alias a or b)

}  // namespace tessera::ops
