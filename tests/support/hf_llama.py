#!/usr/bin/env python3
"""Hugging Face's side of the Llama tests: transformers' own classes make,
save and load Llama (and Mixtral) directories, and say what they hold, as JSON.

Run with the venv scripts/install-hf.sh makes (/opt/tessera-tools/hf: pinned
transformers over Debian's torch 1.13); the C++ tests (tests/io/test_hf_llama.cpp)
call it and read the JSON it writes to --json.

  make DIR --json OUT [--seed N] [--max-shard-size 60KB] [--dtype bfloat16] [--ids 1,2,3] [sizes...]
      A tiny LlamaForCausalLM with random weights (every tensor, norms too,
      drawn from torch.manual_seed(N)), saved by save_pretrained(DIR) (with a
      small max_shard_size it shards; --dtype casts before saving). OUT: the
      config, every tensor of the state_dict (float64 lists, row-major) and
      the logits of --ids (float32 model, before any cast).
  load DIR --json OUT [--ids 1,2,3] [--text "..."]
      LlamaForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR)
      of a directory Tessera wrote. OUT: the config as transformers read it,
      every tensor of the loaded state_dict, the logits of --ids in float32,
      the tokenizer's class, length and ids of --text, and the weights that
      from_pretrained reported missing or unexpected (both must be empty).

Defaults: hidden 64, 4 heads, 2 key/value heads (G < H), 2 layers,
intermediate 160, vocabulary 96, rope_theta 500000, untied embeddings,
rms_norm_eps 1e-5, max_position_embeddings 64. With --experts E (make): a
MixtralForCausalLM instead, every layer's MLP E experts of the intermediate
width, --experts-per-tok of them per token (default 2). load reads either
(AutoModelForCausalLM: the class config.json names).
"""
import argparse
import json
import os
import sys

# Nothing from the network (every directory is local), no progress bars in the tests' logs.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")

import torch  # noqa: E402  (after the environment above)
import transformers  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          MixtralConfig, MixtralForCausalLM)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensors_of(model):
    return {name: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                   "values": t.detach().to(torch.float64).flatten().tolist()}
            for name, t in model.state_dict().items()}


def logits_of(model, ids):
    if not ids:
        return []
    with torch.no_grad():
        return model.float()(torch.tensor([ids])).logits[0].to(torch.float64).tolist()


def parse_ids(text):
    return [int(i) for i in text.split(",")] if text else []


def make(args):
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 rope_theta=args.rope_theta, rms_norm_eps=args.rms_norm_eps,
                 max_position_embeddings=args.max_positions, tie_word_embeddings=args.tied)
    if args.experts:
        config = MixtralConfig(num_local_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
                               sliding_window=None, **sizes)
        model_class = MixtralForCausalLM
    else:
        config = LlamaConfig(**sizes)
        model_class = LlamaForCausalLM
    torch.manual_seed(args.seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # Norm weights away from 1 and every matrix at a scale that keeps the logits varied.
            parameter.copy_(1.0 + 0.5 * torch.randn_like(parameter) if parameter.dim() == 1
                            else 0.2 * torch.randn_like(parameter))
    logits = logits_of(model, parse_ids(args.ids))
    model = model.to(DTYPES[args.dtype])
    kwargs = {"safe_serialization": True}
    if args.max_shard_size:
        kwargs["max_shard_size"] = args.max_shard_size
    model.save_pretrained(args.dir, **kwargs)
    return {"config": config.to_dict(), "tensors": tensors_of(model), "logits": logits}


def load(args):
    model, info = AutoModelForCausalLM.from_pretrained(args.dir, output_loading_info=True, torch_dtype="auto")
    model.eval()
    out = {"config": model.config.to_dict(), "tensors": tensors_of(model),
           "missing": list(info.get("missing_keys", [])), "unexpected": list(info.get("unexpected_keys", [])),
           "mismatched": [list(map(str, m)) for m in info.get("mismatched_keys", [])],
           "class": type(model).__name__}
    out["logits"] = logits_of(model, parse_ids(args.ids))
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.dir)
    except Exception as error:  # reported, not raised: the test says what failed
        out["tokenizer_error"] = f"{type(error).__name__}: {error}"
        return out
    out["tokenizer"] = {"class": type(tokenizer).__name__, "length": len(tokenizer),
                        "ids": tokenizer(args.text)["input_ids"] if args.text else [],
                        "decoded": tokenizer.decode(tokenizer(args.text)["input_ids"]) if args.text else ""}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["make", "load"])
    parser.add_argument("dir")
    parser.add_argument("--json", required=True, help="where to write what the command found")
    parser.add_argument("--ids", default="", help="token ids to run the model on, comma-separated")
    parser.add_argument("--text", default="", help="load: a text for the tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=160)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--rms-norm-eps", type=float, default=1e-5)
    parser.add_argument("--max-positions", type=int, default=64)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--experts", type=int, default=0, help="make: a Mixtral of this many experts per layer")
    parser.add_argument("--experts-per-tok", type=int, default=2)
    args = parser.parse_args()
    out = make(args) if args.command == "make" else load(args)
    out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                       "python": sys.version.split()[0]}
    with open(args.json, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
