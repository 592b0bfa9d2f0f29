#!/usr/bin/env python3
"""bf16 GEMM, Tessera beside PyTorch, in one run on this machine.

For square products n = 512 ... 8192 and the products of the GPT benchmark's
layers (benchmarks/train_compare.py's GPT: 16 x 256 tokens, hidden 256, MLP
1024) and of Llama-size layers (TinyLlama-1.1B's and Llama-2-7B's, 2048
tokens), it runs build/bin/benchmarks/gemm (ops::matmul) and
benchmarks/gemm_torch.py (torch.matmul) on the same shape, alternating the two
programs --rounds times (and which goes first), and prints per case

    gemm_bf16 case=square_4096 shape=4096x4096x4096:nn tessera_gflops=1830.2 torch_gflops=1790.5 ratio=1.022

where each *_gflops is the median over the rounds (each round's figure the
median of its timed runs) and ratio = Tessera's GFLOP/s over PyTorch's, the
median of the rounds' ratios (> 1: Tessera is faster). A shape is MxNxK:
C [M, N] = op(A) [M, K] · op(B) [K, N]; :nt is a linear layer's forward
(x · Wᵀ), :tn its weight gradient, :nn its input gradient. A header line
names the processor, PyTorch's version, and the CPU libraries Tessera runs.

Usage: benchmarks/gemm_compare.py [--python /opt/tessera-tools/torch/bin/python] [--cases square_4096,gpt_fc1]
(PyTorch 2.15 from PyPI in /opt/tessera-tools/torch: scripts/install-deps.sh --with-benchmarks)
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

from machine import cpu_description, run

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_VENV_PYTHON = os.path.join(os.environ.get("TESSERA_TOOLS_DIR", "/opt/tessera-tools"), "torch", "bin", "python")

GPT_TOKENS, GPT_HIDDEN, GPT_MLP = 16 * 256, 256, 4 * 256
TINYLLAMA_TOKENS, TINYLLAMA_HIDDEN, TINYLLAMA_KV, TINYLLAMA_MLP = 2048, 2048, 256, 5632
LLAMA7B_HIDDEN, LLAMA7B_MLP = 4096, 11008


def shape(m, n, k, layout="nn"):
    return f"{m}x{n}x{k}:{layout}"


# case -> shape, in the order printed
CASES = {f"square_{n}": shape(n, n, n) for n in (512, 1024, 2048, 4096, 8192)}
CASES.update({
    "gpt_qkv": shape(GPT_TOKENS, 3 * GPT_HIDDEN, GPT_HIDDEN, "nt"),
    "gpt_attn_proj": shape(GPT_TOKENS, GPT_HIDDEN, GPT_HIDDEN, "nt"),
    "gpt_fc1": shape(GPT_TOKENS, GPT_MLP, GPT_HIDDEN, "nt"),
    "gpt_fc2": shape(GPT_TOKENS, GPT_HIDDEN, GPT_MLP, "nt"),
    "gpt_fc1_weight_grad": shape(GPT_MLP, GPT_HIDDEN, GPT_TOKENS, "tn"),
    "gpt_fc2_input_grad": shape(GPT_TOKENS, GPT_MLP, GPT_HIDDEN, "nn"),
    "tinyllama_q": shape(TINYLLAMA_TOKENS, TINYLLAMA_HIDDEN, TINYLLAMA_HIDDEN, "nt"),
    "tinyllama_kv": shape(TINYLLAMA_TOKENS, TINYLLAMA_KV, TINYLLAMA_HIDDEN, "nt"),
    "tinyllama_gate_up": shape(TINYLLAMA_TOKENS, TINYLLAMA_MLP, TINYLLAMA_HIDDEN, "nt"),
    "tinyllama_down": shape(TINYLLAMA_TOKENS, TINYLLAMA_HIDDEN, TINYLLAMA_MLP, "nt"),
    "tinyllama_up_weight_grad": shape(TINYLLAMA_MLP, TINYLLAMA_HIDDEN, TINYLLAMA_TOKENS, "tn"),
    "tinyllama_down_input_grad": shape(TINYLLAMA_TOKENS, TINYLLAMA_MLP, TINYLLAMA_HIDDEN, "nn"),
    "llama7b_gate_up": shape(TINYLLAMA_TOKENS, LLAMA7B_MLP, LLAMA7B_HIDDEN, "nt"),
    "llama7b_down": shape(TINYLLAMA_TOKENS, LLAMA7B_HIDDEN, LLAMA7B_MLP, "nt"),
})


def bf16_gflops(command, text, env):
    """The bf16_gflops figure that `command` prints for the shape `text`."""
    output = run(command, env)
    found = re.search(rf"^gemm shape={re.escape(text)} impl=\S+ bf16_gflops=([0-9.]+)", output, re.MULTILINE)
    if not found:
        sys.exit(f"no bf16_gflops for {text} in the output of {' '.join(command)}:\n{output}")
    return float(found[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm", default=os.path.join(HERE, "..", "build", "bin", "benchmarks", "gemm"))
    parser.add_argument("--python", default=TORCH_VENV_PYTHON if os.path.exists(TORCH_VENV_PYTHON) else sys.executable,
                        help="the interpreter with PyTorch (default: /opt/tessera-tools/torch's when installed)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time each product for at least this long")
    args = parser.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        sys.exit(f"gemm_compare.py: unknown --cases {', '.join(unknown)}; known: {', '.join(CASES)}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    torch_version = run([args.python, "-c", "import torch; print(torch.__version__)"], env).strip()
    libraries = re.search(r"oneDNN [^)]*\)", run([os.path.join(os.path.dirname(args.gemm), "..", "tessera"),
                                                    "--version"], env))
    print(f'gemm_bf16 machine="{cpu_description()}" threads={args.threads} torch={torch_version} '
          f'tessera="{libraries[0] if libraries else "?"}"', flush=True)
    timing = ["--repeats", "3", "--min-seconds", str(args.min_seconds)]
    for case in args.cases.split(","):
        text = CASES[case]
        ours_command = [args.gemm, "--bf16-shapes", text, *timing]
        theirs_command = [args.python, os.path.join(HERE, "gemm_torch.py"), "--bf16-shapes", text,
                          "--threads", str(args.threads), *timing]
        ours, theirs = [], []
        for round_index in range(args.rounds):
            if round_index % 2 == 0:
                ours.append(bf16_gflops(ours_command, text, env))
                theirs.append(bf16_gflops(theirs_command, text, env))
            else:
                theirs.append(bf16_gflops(theirs_command, text, env))
                ours.append(bf16_gflops(ours_command, text, env))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"gemm_bf16 case={case} shape={text} tessera_gflops={statistics.median(ours):.1f} "
              f"torch_gflops={statistics.median(theirs):.1f} ratio={ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
