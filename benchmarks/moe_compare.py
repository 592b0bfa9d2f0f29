#!/usr/bin/env python3
"""The mixture-of-experts layer on one rank: Tessera's beside PyTorch eager's, forward and backward.

Runs build/bin/benchmarks/moe_layer (parallel::MixtureOfExperts: router, top-k, dispatch, SwiGLU
experts on contiguous rows, combine, the load-balancing loss) and the same layer in PyTorch eager as
Hugging Face's MixtralSparseMoeBlock computes it (router Linear, softmax, topk, renormalise, a loop
over the experts with index_select and index_add_, the Switch load-balancing loss), with the same
sizes, dtype and thread count, in alternating rounds. Prints name=value lines, per dtype:

    moe_compare dtype=f32 tessera_forward_ms=20.1 torch_forward_ms=25.3 tessera_backward_ms=...
        torch_backward_ms=... step_ratio_tessera_over_torch=0.81

(medians over rounds of each round's median). Compare within one run only.

Usage: /opt/tessera-tools/torch/bin/python benchmarks/moe_compare.py [--tokens 2048] [--hidden 512]
       [--experts 8] [--ffn 1024] [--top-k 2] [--rounds 3] [--repeats 5] [--threads 2]
(PyTorch from PyPI in /opt/tessera-tools/torch: scripts/install-deps.sh --with-benchmarks)
"""
import argparse
import os
import re
import statistics
import subprocess
import time

import torch

from machine import cpu_description

HERE = os.path.dirname(os.path.abspath(__file__))


class MixtralMoe(torch.nn.Module):
    """Mixtral's sparse MoE block (its loop over experts), SwiGLU experts w1/w3/w2."""

    def __init__(self, hidden, ffn, experts, top_k):
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.w1 = torch.nn.ModuleList(torch.nn.Linear(hidden, ffn, bias=False) for _ in range(experts))
        self.w3 = torch.nn.ModuleList(torch.nn.Linear(hidden, ffn, bias=False) for _ in range(experts))
        self.w2 = torch.nn.ModuleList(torch.nn.Linear(ffn, hidden, bias=False) for _ in range(experts))

    def forward(self, x):
        logits = self.gate(x).float()
        probs = torch.softmax(logits, dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            rows = x.index_select(0, token)
            y = self.w2[e](torch.nn.functional.silu(self.w1[e](rows)) * self.w3[e](rows))
            out.index_add_(0, token, y * weights[token, slot, None])
        counts = torch.bincount(chosen.flatten(), minlength=self.experts).to(probs.dtype)
        aux = 1e-2 * self.experts / (x.shape[0] ** 2 * self.top_k) * (counts * probs.sum(0)).sum()
        return out, aux


def torch_times(args, dtype, repeats):
    torch.manual_seed(0)
    layer = MixtralMoe(args.hidden, args.ffn, args.experts, args.top_k).to(dtype)
    x = torch.rand(args.tokens, args.hidden, dtype=dtype) * 2 - 1
    g = torch.rand(args.tokens, args.hidden, dtype=dtype) * 2 - 1
    forward, backward = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        out, aux = layer(x)
        middle = time.perf_counter()
        ((out * g).sum() + aux).backward()
        end = time.perf_counter()
        if i:
            forward.append(middle - start)
            backward.append(end - middle)
    return statistics.median(forward), statistics.median(backward)


def tessera_times(args, dtype_name, repeats):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run([args.binary, "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--experts",
                          str(args.experts), "--ffn", str(args.ffn), "--top-k", str(args.top_k), "--dtypes",
                          dtype_name, "--repeats", str(repeats)], check=True, capture_output=True, text=True,
                         env=env).stdout
    found = re.search(r"forward_seconds=([\d.]+) backward_seconds=([\d.]+)", out)
    return float(found.group(1)), float(found.group(2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default=os.path.join(HERE, "..", "build", "bin", "benchmarks", "moe_layer"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"moe_compare: {cpu_description()}; torch {torch.__version__}; {args.threads} threads; N={args.tokens} "
          f"C={args.hidden} E={args.experts} F={args.ffn} K={args.top_k}", flush=True)
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        figures = {"tessera": [], "torch": []}
        for _ in range(args.rounds):
            figures["tessera"].append(tessera_times(args, name, args.repeats))
            figures["torch"].append(torch_times(args, dtype, args.repeats))
        median = {k: tuple(statistics.median(r[i] for r in v) for i in range(2)) for k, v in figures.items()}
        ratio = sum(median["tessera"]) / sum(median["torch"])
        print(f"moe_compare dtype={name} tessera_forward_ms={1e3 * median['tessera'][0]:.1f} "
              f"torch_forward_ms={1e3 * median['torch'][0]:.1f} tessera_backward_ms={1e3 * median['tessera'][1]:.1f} "
              f"torch_backward_ms={1e3 * median['torch'][1]:.1f} step_ratio_tessera_over_torch={ratio:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
