// Hugging Face's LlamaForCausalLM in and out: its config.json as a plain
// struct, its tensors as Tessera's Llama parameters (each rank reading only
// the slices it owns, from one model.safetensors or from shards with an
// index, BF16/F16/F32/F64), and a directory that transformers'
// LlamaForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR)
// load, written from the model's whole logical tensors. Mixtral
// (MixtralForCausalLM) is the same model with a mixture of experts as every
// block's MLP (Mixtral's router: softmax over all experts, the top k,
// renormalised, as Tessera's): one code path, its config's expert keys set.
//
//   Tessera (logical layout)                  Hugging Face LlamaForCausalLM
//   wte.weight [V, C]                         model.embed_tokens.weight
//   blocks.<i>.ln1.weight [C]                 model.layers.<i>.input_layernorm.weight
//   blocks.<i>.attn.qkv.weight                model.layers.<i>.self_attn.q_proj.weight [H·Dh, C],
//     [G·(R+2)·Dh, C], grouped: for group g    k_proj.weight [G·Dh, C], v_proj.weight [G·Dh, C]
//     the q heads g·R .. g·R+R-1, then k head  (q head h attends with kv head h / R: transformers'
//     g, then v head g (Dh rows each)          repeat_kv)
//   blocks.<i>.attn.proj.weight [C, H·Dh]     model.layers.<i>.self_attn.o_proj.weight
//   blocks.<i>.ln2.weight [C]                 model.layers.<i>.post_attention_layernorm.weight
//   blocks.<i>.mlp.fc.weight [2F, C]          model.layers.<i>.mlp.gate_proj.weight (rows [0, F)),
//                                             mlp.up_proj.weight (rows [F, 2F))
//   blocks.<i>.mlp.proj.weight [C, F]         model.layers.<i>.mlp.down_proj.weight
//   Mixtral (MixtralForCausalLM, --num-experts E in every block): instead of mlp.fc and mlp.proj
//   blocks.<i>.mlp.router.weight [E, C]       model.layers.<i>.block_sparse_moe.gate.weight
//   blocks.<i>.mlp.experts.<e>.fc.weight      ...block_sparse_moe.experts.<e>.w1.weight (rows [0, F): the
//     [2F, C]                                 gate), w3.weight (rows [F, 2F): up)
//   blocks.<i>.mlp.experts.<e>.proj.weight    ...block_sparse_moe.experts.<e>.w2.weight
//   ln_f.weight [C]                           model.norm.weight
//   lm_head.weight [V, C]                     lm_head.weight (absent when tie_word_embeddings)
//   the training data's tokenizer             vocab.json, merges.txt, tokenizer_config.json (GPT2Tokenizer)
//
// H query heads, G = num_key_value_heads groups, R = H / G, Dh = C / H. Both
// use the half-split rotary layout (rotate_half) and RMSNorm weights without
// offsets, so the tensors' values move across unchanged.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/model_weights.h"
#include "io/safetensors.h"
#include "io/safetensors_directory.h"
#include "nn/models.h"
#include "nn/parameter.h"

namespace tessera::io {

class Tokenizer;

// What Tessera's Llama needs of Hugging Face's LlamaConfig (config.json).
// Defaults are LlamaConfig's for the keys a file may leave out.
struct HfLlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // absent in the file: num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  std::string torch_dtype;  // "float32", "bfloat16", "float16", ...; empty when absent
  std::optional<int64_t> bos_token_id, eos_token_id;
  // Written from a checkpoint's --attention-dropout; not read (a run's is its flag's).
  double attention_dropout = 0.0;
  // Mixtral: every block's MLP a mixture of num_local_experts SwiGLU experts
  // of width intermediate_size, each token going to num_experts_per_tok of
  // them; 0 experts: a Llama. router_aux_loss_coef is written from a
  // checkpoint's --moe-aux-loss-coeff (else MixtralConfig's default), not
  // read (a run's is its flag's).
  int64_t num_local_experts = 0;
  int64_t num_experts_per_tok = 2;
  double router_aux_loss_coef = 0.001;
  bool mixtral() const { return num_local_experts > 0; }

  int64_t head_dim() const { return hidden_size / num_attention_heads; }                   // Dh
  int64_t queries_per_group() const { return num_attention_heads / num_key_value_heads; }  // R
  // Throws naming `source` and the key when a size is not positive (or beyond any Llama's: a damaged file)
  // or the heads do not divide.
  void validate(const std::string& source) const;
};

// Tessera's model configuration (--model llama) of a Hugging Face Llama, for
// sequences of up to `seq_length` tokens.
nn::ModelConfig llama_model_config(const HfLlamaConfig& config, int64_t seq_length);

// config.json (a path to it, or the directory holding it): the keys above,
// checked. Refused, naming the file and the key: malformed JSON, a missing
// size, model_type other than "llama" or "mixtral", architectures without
// LlamaForCausalLM (MixtralForCausalLM), a Mixtral's sliding_window shorter
// than max_position_embeddings, attention_bias or mlp_bias true, hidden_act other than
// silu, rope_scaling other than null (not supported yet), head_dim other than
// hidden_size / num_attention_heads, a size that is not a positive integer.
HfLlamaConfig read_hf_llama_config(const std::string& path);
// The same from the file's text; `source` names it in messages.
HfLlamaConfig parse_hf_llama_config(const std::string& text, const std::string& source);
// config.json's text for `config`, everything from_pretrained needs
// (architectures, model_type, the sizes, rms_norm_eps, rope_theta,
// tie_word_embeddings, torch_dtype, bos/eos_token_id (null when absent),
// no biases, silu, rope_scaling null).
std::string hf_llama_config_json(const HfLlamaConfig& config);

// The config of a Llama checkpoint of `tessera train` (model.kind "llama"):
// the sizes from its model.* metadata (vocab_size, hidden_size,
// ffn_hidden_size, num_layers, num_heads, seq_length), the key/value groups
// from model.num_query_groups or else the rows of blocks.0.attn.qkv.weight,
// tied when it holds no lm_head.weight, rope_theta and rms_norm_eps from
// model.rotary_base and model.norm_epsilon (else the flags it was trained
// with, config.rotary-base and config.norm-epsilon). Throws naming the
// checkpoint and the entry it lacks.
HfLlamaConfig hf_llama_config_of(const CheckpointReader& reader);

// Every Tessera Llama parameter's place among Hugging Face's tensors, in the
// order transformers' state_dict lists them (no lm_head when tied).
std::vector<ParameterInFile> hf_llama_layouts(const HfLlamaConfig& config);

// Every parameter (names and logical shapes of the design; any
// nn::ParameterShard) from the Hugging Face Llama directory `directory`
// (model.safetensors or shards with their index; a single .safetensors file
// too), whose config is `config` (read_hf_llama_config of its config.json,
// checked against the model by the caller): each rank reads only its
// slices of each tensor. Throws naming the directory or file, the tensor and
// the fix (io::load_weights).
WeightsLoaded load_hf_llama_weights(const std::string& directory, const std::vector<nn::Parameter*>& parameters,
                                    const HfLlamaConfig& config);

struct HfLlamaWritten {
  SafetensorsWritten weights;  // model.safetensors, or the shards and the index
  std::string config;          // config.json
  // vocab.json, merges.txt, tokenizer_config.json; empty without a tokenizer.
  std::string vocab, merges, tokenizer_config;
};
// Writes `directory` (created when missing) as save_pretrained would for
// LlamaForCausalLM: the weights from `logical` (every parameter whole, under
// Tessera's names and logical shapes, one float dtype) as Hugging Face's
// tensors, in model.safetensors or above `max_shard_bytes` in shards with an
// index; config.json from `config` (torch_dtype set to the tensors' dtype);
// and, when `tokenizer` is given (at most config.vocab_size tokens), its
// vocab.json and merges.txt with a tokenizer_config.json saying
// GPT2Tokenizer (no special tokens), for AutoTokenizer. Refused naming the
// tensor: one missing, of another shape or dtype, or with no place in
// Hugging Face's Llama.
HfLlamaWritten write_hf_llama(const std::string& directory, const std::vector<SafetensorsInput>& logical,
                              const HfLlamaConfig& config, const Tokenizer* tokenizer,
                              int64_t max_shard_bytes = kDefaultMaxShardBytes);

}  // namespace tessera::io
