// A checkpoint's weights for the ecosystem, as safetensors (io/safetensors.h):
//   tessera  every parameter under Tessera's name and shape (no optimizer
//            state), the model's fields (model.*) in the file's metadata;
//   hf-gpt2  the GPT under Hugging Face GPT-2's names and layouts, with a
//            config.json beside it, so that transformers'
//            GPT2LMHeadModel.from_pretrained(DIR) loads it:
//
//     Tessera                         Hugging Face GPT-2
//     wte.weight [V, C]               transformer.wte.weight [V, C] (lm_head tied to it)
//     wpe.weight [T, C]               transformer.wpe.weight [T, C]
//     blocks.<i>.ln1.weight/bias      transformer.h.<i>.ln_1.weight/bias
//     blocks.<i>.attn.qkv.weight      transformer.h.<i>.attn.c_attn.weight, transposed: [C, 3C]
//       [3C, C] (rows: Q, K, V;       (Conv1D holds [in, out]; its output columns are Q, K, V,
//       heads contiguous in each)      heads contiguous in each: the same order)
//     blocks.<i>.attn.proj.weight     transformer.h.<i>.attn.c_proj.weight, transposed
//     blocks.<i>.ln2.weight/bias      transformer.h.<i>.ln_2.weight/bias
//     blocks.<i>.mlp.fc.weight        transformer.h.<i>.mlp.c_fc.weight, transposed: [C, F]
//     blocks.<i>.mlp.proj.weight      transformer.h.<i>.mlp.c_proj.weight, transposed: [F, C]
//     (every .bias as it is)          (likewise)
//     ln_f.weight/bias                transformer.ln_f.weight/bias
//     the training data's tokenizer   vocab.json, merges.txt (GPT-2's files)
//
//   The architectures match exactly: pre-LN blocks, learned positions, GELU
//   with the tanh approximation ("gelu_new"), LayerNorm eps 1e-5, biases
//   everywhere, the head tied to wte, 1/√(C/H) attention scaling. Refused:
//   checkpoints of other models (`--model mlp`/`cnn`: use --format tessera).
//   hf-llama  a Llama (model.kind "llama") as LlamaForCausalLM's directory,
//            with the tokenizer for AutoTokenizer (io/hf_llama.h).
// The Hugging Face formats' -o DIR is sharded above --max-shard-size, as
// save_pretrained does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/safetensors_directory.h"

namespace tessera::io {

// One GPT parameter under both names; `transposed`: Hugging Face's Conv1D
// holds the matrix as [in, out], Tessera's Linear as [out, in].
struct HfGpt2Name {
  std::string tessera, hf;
  bool transposed = false;
};
std::vector<HfGpt2Name> hf_gpt2_names(int64_t num_layers);

struct ExportResult {
  std::string weights;              // the safetensors file, or when sharded their model.safetensors.index.json
  std::vector<std::string> shards;  // the shards the index names; empty when one file
  std::string config;               // hf-*: the config.json beside it
  // hf-*: the tokenizer's vocab.json and merges.txt (hf-llama: and
  // tokenizer_config.json) beside it (empty when the training data stored
  // none: `tokenizer_note` says why).
  std::string vocab, merges, tokenizer_config, tokenizer_note;
  int64_t tensors = 0, bytes = 0;
};

struct ExportOptions {
  std::string format = "tessera";  // "tessera", "hf-gpt2", "hf-llama" or "hf-mixtral"
  // hf-*: the dataset (of `tessera prepare text`) whose tokenizer to write
  // as vocab.json and merges.txt; empty: the data the checkpoint was trained
  // on (config.data), when it is here.
  std::string tokenizer_data;
  bool force = false;  // hf-*: write into a non-empty directory, replacing the files named below
  // hf-*, -o DIR: above this many bytes of tensors, shards
  // model-0000i-of-0000N.safetensors and model.safetensors.index.json as
  // save_pretrained(DIR, max_shard_size=...) writes them (io/safetensors_directory.h).
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
};

// Exports the checkpoint at `checkpoint` (a step directory or its
// checkpoint.h5, either format) to `out`:
//   tessera  `out` is the safetensors file (its missing directories created);
//   hf-gpt2  `out` is the directory (created) that receives model.safetensors
//            (or shards and their index), config.json and the tokenizer's
//            vocab.json and merges.txt, as save_pretrained(DIR) does, so that
//            transformers' GPT2LMHeadModel and GPT2TokenizerFast.from_pretrained(DIR) load
//            it; an `out` ending in .safetensors names the weights file (one,
//            whatever its size), the others going beside it;
//   hf-llama `out` is the directory, as for hf-gpt2, with tokenizer_config.json
//            too (LlamaForCausalLM and AutoTokenizer.from_pretrained(DIR)).
// Nothing outside `out` (its directory for a FILE.safetensors) is written.
// Refused before anything is written: an output that is or lies inside the
// checkpoint being read; for hf-gpt2 a non-empty directory, or files beside
// a FILE.safetensors that would be replaced (unless options.force); a place
// that cannot be written; a tokenizer that does not fit the model. A write
// that fails removes what the export made. Throws tessera::Error naming what
// does not fit.
ExportResult export_checkpoint(const std::string& checkpoint, const std::string& out, const ExportOptions& options);

}  // namespace tessera::io
