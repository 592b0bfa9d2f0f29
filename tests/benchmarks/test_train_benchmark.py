#!/usr/bin/env python3
"""The training benchmark's two sides build the same models (benchmarks/train_compare.py's
cases, PyTorch's in benchmarks/train_torch.py):

- for every case, `tessera train` with the case's flags reports the parameter count of
  train_torch.py's model of that case;
- train_torch.py's Llama is Hugging Face's LlamaForCausalLM configured from the case's
  Tessera flags (vocabulary, context, layers, heads, key/value groups, width, SwiGLU width,
  untied head, no biases, rope base and RMSNorm epsilon at Tessera's defaults): its
  state_dict loads into transformers' model by name, strictly (every shape equal), and the
  logits and every parameter's gradient equal transformers' within f32 rounding (Tessera's
  Llama against transformers' is tests/io/test_hf_llama_transformers.cpp's).

Runs itself under a Python with PyTorch: the venv scripts/install-hf.sh makes
(/opt/tessera-tools/hf, transformers over Debian's torch), else this interpreter; without
transformers the Llama check is skipped with a message, without PyTorch the whole test.

Usage: test_train_benchmark.py BUILD_DIR
"""
import os
import re
import subprocess
import sys

import failures as failures_report  # tests/benchmarks/failures.py, beside this file

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP = 77  # ctest's SKIP_RETURN_CODE for this test


def can_import(python, modules):
    code = f"import {', '.join(modules)}"
    return subprocess.run([python, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def torch_python():
    """The hf venv when it has torch and transformers, else this interpreter if it has torch."""
    venv = os.path.join(os.environ.get("TESSERA_TOOLS_DIR", "/opt/tessera-tools"), "hf", "bin", "python")
    if os.path.exists(venv) and can_import(venv, ["torch", "transformers"]):
        return venv
    return sys.executable if can_import(sys.executable, ["torch"]) else None


def flag(flags, name, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


def tessera_parameters(tessera, flags):
    """The parameter count `tessera train` prints for a model of these flags (one step of batch 1)."""
    command = [tessera, "train", "--synthetic", *flags, "--micro-batch-size", "1", "--train-steps", "1",
               "--threads", "1"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = re.search(r"^model: \w+, (\d+) parameters", result.stdout, re.MULTILINE)
    if result.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(command)} (exit {result.returncode}) printed no parameter count:\n"
                           f"{result.stdout}")
    return int(found.group(1))


def check_parameter_counts(tessera, failures):
    import torch
    import train_compare
    import train_torch
    for model, (flags, _, _, _) in train_compare.CASES.items():
        ours = tessera_parameters(tessera, flags)
        built, _, _, _ = train_torch.build(f"{model}_f32", 1, int(flag(flags, "--seq-length", "256")),
                                           torch.Generator().manual_seed(1))
        theirs = sum(p.numel() for p in built.parameters())
        print(f"{model}: tessera {ours} parameters, pytorch {theirs}")
        if ours != theirs:
            failures.append(f"{model}: tessera has {ours} parameters, train_torch.py's model {theirs}")


def hugging_face_llama(flags):
    """transformers' LlamaForCausalLM of the Llama case's Tessera flags (Tessera's defaults where none is given)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    heads = int(flag(flags, "--num-heads"))
    config = LlamaConfig(vocab_size=int(flag(flags, "--vocab-size")), hidden_size=int(flag(flags, "--hidden-size")),
                         intermediate_size=int(flag(flags, "--ffn-hidden-size")),
                         num_hidden_layers=int(flag(flags, "--num-layers")), num_attention_heads=heads,
                         num_key_value_heads=int(flag(flags, "--num-query-groups", heads)),
                         max_position_embeddings=int(flag(flags, "--seq-length")),
                         rope_theta=float(flag(flags, "--rotary-base", "10000")),
                         rms_norm_eps=float(flag(flags, "--norm-epsilon", "1e-5")), tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False)
    return LlamaForCausalLM(config).float()


def close(ours, theirs):
    """Within f32 rounding of the larger magnitude (a wrong layout or scale is off by O(1))."""
    return (ours - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())


def check_llama_is_hugging_faces(failures):
    import torch
    import torch.nn.functional as F
    import train_compare
    import train_torch
    flags = train_compare.CASES["llama"][0]
    seq = int(flag(flags, "--seq-length"))
    ours, ids, targets, _ = train_torch.build("llama_f32", 2, seq, torch.Generator().manual_seed(7))
    with torch.no_grad():  # every weight random (the norms too), so that a swapped tensor shows
        for p in ours.parameters():
            p.normal_(0.0, 0.5)
    theirs = hugging_face_llama(flags)
    try:
        theirs.load_state_dict(ours.state_dict(), strict=True)
    except RuntimeError as error:
        failures.append(f"train_torch.py's Llama does not load into LlamaForCausalLM: {error}")
        return
    logits = {"pytorch": ours(ids), "transformers": theirs(input_ids=ids).logits}
    if not close(logits["pytorch"], logits["transformers"]):
        failures.append("train_torch.py's Llama logits differ from transformers' by "
                        f"{(logits['pytorch'] - logits['transformers']).abs().max().item()}")
    for name, model in (("pytorch", ours), ("transformers", theirs)):
        F.cross_entropy(logits[name].reshape(-1, logits[name].shape[-1]), targets.reshape(-1)).backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if not close(p.grad, grads[name].grad):
            failures.append(f"gradient of {name} differs from transformers' by "
                            f"{(p.grad - grads[name].grad).abs().max().item()}")
    print(f"llama: logits and {len(grads)} gradients equal transformers' (attention: "
          f"{theirs.config._attn_implementation}, torch {torch.__version__})")


def inside(build_dir):
    sys.path.insert(0, os.path.join(SOURCE, "benchmarks"))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    failures = []
    check_parameter_counts(os.path.join(build_dir, "bin", "tessera"), failures)
    if can_import(sys.executable, ["transformers"]):
        check_llama_is_hugging_faces(failures)
    else:
        print("transformers not installed (scripts/install-hf.sh): train_torch.py's Llama not checked against it")
    return failures_report.report(failures, "train benchmark models")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--inside":
        return inside(sys.argv[2])
    python = torch_python()
    if python is None:
        print("PyTorch not installed (scripts/install-deps.sh --with-benchmarks): skipped")
        return SKIP
    return subprocess.run([python, os.path.abspath(__file__), "--inside", sys.argv[1]]).returncode


if __name__ == "__main__":
    sys.exit(main())
