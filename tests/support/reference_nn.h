// Naive double-precision references for the layers and models of nn:
// plain loops over std::vector<double>, written from the textbook definitions
// and independent of the operator library, so layer tests compare Tessera's
// forward with them and its backward with their central differences.
//
// Layouts are those of nn (row-major): linear weight [out, in]; conv
// NCHW with weight [K, C, R, S]; packed attention qkv [B, T, 3, H, Dh].
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tessera::testing::reference {

using Vec = std::vector<double>;
using Ids = std::vector<int64_t>;

// y [rows, out] = x [rows, in]·wᵀ (+ b); b may be empty.
Vec linear(const Vec& x, const Vec& w, const Vec& b, int64_t rows, int64_t in, int64_t out);
Vec relu(const Vec& x);
Vec gelu(const Vec& x);  // tanh approximation
Vec add(const Vec& a, const Vec& b);

// Over the last dimension d; b may be empty (no bias).
Vec layernorm(const Vec& x, const Vec& w, const Vec& b, int64_t d, double eps = 1e-5);
Vec rmsnorm(const Vec& x, const Vec& w, int64_t d, double eps = 1e-5);

// x [n, c, h, w], weight [k, c, r, r], b [k] or empty → [n, k, p, q].
Vec conv2d(const Vec& x, const Vec& weight, const Vec& b, int64_t n, int64_t c, int64_t h, int64_t w, int64_t k,
           int64_t r, int64_t stride, int64_t pad);
// Max over kernel×kernel windows (padding never wins) → [n, c, p, q].
Vec maxpool2d(const Vec& x, int64_t n, int64_t c, int64_t h, int64_t w, int64_t kernel, int64_t stride, int64_t pad);

// Causal softmax attention, scale 1/√dh: qkv [b, t, 3, heads, dh] → [b, t, heads, dh].
Vec attention(const Vec& qkv, int64_t b, int64_t t, int64_t heads, int64_t dh);
// out [ids.size(), dim] = table[ids].
Vec embedding(const Ids& ids, const Vec& table, int64_t dim);
// Mean of −log softmax(logits[n])[targets[n]] over targets ≠ ignore_index (0 if none).
double cross_entropy(const Vec& logits, const Ids& targets, int64_t vocab, int64_t ignore_index = -100);

// Named parameters, as nn names them ("blocks.0.attn.qkv.weight", ...).
using Params = std::map<std::string, Vec>;

// x [b, t, c] through "<prefix>.qkv" → attention → "<prefix>.proj" (no dropout).
Vec causal_self_attention(const Params& p, const std::string& prefix, const Vec& x, int64_t b, int64_t t, int64_t c,
                          int64_t heads);
// x [rows, c] through "<prefix>.fc" + GELU → "<prefix>.proj".
Vec mlp_block(const Params& p, const std::string& prefix, const Vec& x, int64_t rows, int64_t c, int64_t ffn);
// Pre-LN block: h = x + attn(ln1(x)), y = h + mlp(ln2(h)).
Vec transformer_block(const Params& p, const std::string& prefix, const Vec& x, int64_t b, int64_t t, int64_t c,
                      int64_t heads, int64_t ffn);

struct GptShape {
  int64_t vocab, seq_length, layers, heads, hidden, ffn;
};
// ids [b, t] → logits [b, t, vocab]: wte[ids] + wpe[:t] → blocks → ln_f → ·wteᵀ.
Vec gpt_logits(const GptShape& shape, const Params& p, const Ids& ids, int64_t b, int64_t t);
double gpt_loss(const GptShape& shape, const Params& p, const Ids& ids, const Ids& targets, int64_t b, int64_t t,
                int64_t ignore_index = -100);

// The Llama (models/decoder.h with the Llama's choices), written as Hugging Face's LlamaForCausalLM
// computes it: q, k, v projections (cut from the grouped qkv weight's rows),
// rotate_half rotary embeddings at positions 0..t-1, repeat_kv, causal
// softmax attention, o_proj, SiLU(gate)·up, RMSNorm; no biases.
//
// Each of the Llama's choices can be switched to GPT-2's on its own (the
// decoder's switches, models/decoder.h): LayerNorm with its bias instead of
// RMSNorm, learned positions wpe [seq_length, C] added to the embedding
// instead of rotary embeddings, a GELU MLP (fc [F, C]) instead of SwiGLU,
// biases in every linear layer (the grouped qkv's bias in the weight's row
// order), and qkv stored in GPT-2's layout [3, H, Dh] instead of the grouped one.
struct LlamaShape {
  int64_t vocab, layers, heads, groups, hidden, ffn;
  double rotary_base = 10000.0, eps = 1e-5;
  bool tied = false;
  bool layer_norm = false, learned_positions = false, gelu = false, bias = false, gpt2_qkv = false;
};
// ids [b, t] → logits [b, t, vocab].
Vec llama_logits(const LlamaShape& shape, const Params& p, const Ids& ids, int64_t b, int64_t t);
double llama_loss(const LlamaShape& shape, const Params& p, const Ids& ids, const Ids& targets, int64_t b, int64_t t,
                  int64_t ignore_index = -100);

}  // namespace tessera::testing::reference
