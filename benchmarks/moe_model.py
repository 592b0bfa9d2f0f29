#!/usr/bin/env python3
"""Mixture of experts: an MoE Llama (E = 8, K = 2) against the dense Llama of equal active parameters, 1/2/4 ranks.

For every rank count N in --ranks, in alternating rounds (so machine noise
hits every configuration alike), runs

    mpirun -np N --bind-to none --oversubscribe tessera train --synthetic --model llama ...
        moe:   --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size F --expert-model-parallel-size N
        dense: --ffn-hidden-size 2F (a token's active MLP parameters are the MoE's: 2 experts of F)

(data parallelism over the N ranks for the dense model; the MoE's experts
split over them, its dense parameters averaged over them) and prints one
line per configuration:

    moe_model model=moe ranks=2 step_ms=123.4 tokens_per_s=8300 ratio_to_dense=1.21 parameters_rank0=... \\
        model_state_bytes=... activations_bytes=... all_to_all_ms=12.3 all_to_all_share=0.10

step_ms: the median over rounds of a round's median step time (rank 0's
metrics, warm-up steps excluded); tokens_per_s likewise (the whole job's);
model_state_bytes and activations_bytes: rank 0's peak bytes of parameters,
gradients and optimizer state, and of activations and workspaces, by the
allocator's counters; all_to_all_ms: per step and rank, the expert exchanges'
time (the trace's "expert dispatch" and "expert combine" events of the timed
steps, every rank, forward and backward), all_to_all_share: that over the
step time. Every rank runs one OpenMP thread; with more ranks than cores the
timings include oversubscription, so compare within one run.

Usage: benchmarks/moe_model.py [--tessera build/bin/tessera] [--ranks 1 2 4] [--rounds 3] [--steps 4]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

from machine import cpu_description, mpi_environment, run

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 1
EXPERT_FFN = 512


def model_flags(kind, ranks):
    common = ["--model", "llama", "--num-layers", "4", "--hidden-size", "256", "--num-heads", "8",
              "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "2048", "--seq-length", "256",
              "--micro-batch-size", "4", "--lr", "1e-3", "--threads", "1"]
    if kind == "dense":
        return common + ["--ffn-hidden-size", str(2 * EXPERT_FFN)]
    return common + ["--ffn-hidden-size", str(2 * EXPERT_FFN), "--num-experts", "8", "--moe-router-topk", "2",
                     "--moe-ffn-hidden-size", str(EXPERT_FFN), "--moe-aux-loss-coeff", "1e-2",
                     "--expert-model-parallel-size", str(ranks)]


def trace_path(tmp, kind, ranks):
    return os.path.join(tmp, f"trace_{kind}_{ranks}.json")


def exchange_ms(tmp, kind, ranks, steps):
    """Milliseconds per step and rank of the expert exchanges in the timed steps' trace events."""
    total = 0.0
    for rank in range(ranks):
        path = trace_path(tmp, kind, ranks).replace(".json", f".rank{rank}.json")
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        timed_from = min(e["ts"] for e in events if e.get("name") == f"step {WARMUP + 1}")
        total += sum(e["dur"] / 1000.0 for e in events
                     if e.get("ph") == "X" and e.get("name", "").startswith("expert ") and e["ts"] >= timed_from)
        os.remove(path)
    return total / (steps * ranks)


def timed_run(args, kind, ranks, tmp, env):
    metrics = os.path.join(tmp, f"metrics_{kind}_{ranks}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    traced = kind == "moe" and ranks > 1
    output = run([args.mpirun, "-np", str(ranks), "--bind-to", "none", "--oversubscribe", args.tessera, "train",
                  "--synthetic", *model_flags(kind, ranks), "--train-steps", str(args.steps + WARMUP),
                  "--log-interval", "1000", "--metrics", metrics,
                  *(["--trace", trace_path(tmp, kind, ranks)] if traced else [])], env)
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    timed = [r for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]
    if not timed:
        sys.exit(f"no timed steps in {metrics}")
    found = re.search(r"model: llama, (\d+) parameters", output or "")
    return {
        "ms": statistics.median(r["ms_per_step"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "model_state": max(r["mem_model_state_bytes"] for r in timed),
        "activations": max(r["mem_activations_bytes"] for r in timed),
        "parameters": int(found.group(1)) if found else 0,
        "exchange_ms": exchange_ms(tmp, kind, ranks, len(timed)) if traced else 0.0,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    env = mpi_environment()
    configurations = [(kind, ranks) for ranks in args.ranks for kind in ("dense", "moe")]
    print(f"moe_model: {cpu_description()}; Llama {' '.join(model_flags('moe', 'N')[2:])}, "
          f"{args.steps} timed steps x {args.rounds} rounds", flush=True)
    results = {c: [] for c in configurations}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for c in configurations:
                results[c].append(timed_run(args, *c, tmp, env))
    for kind, ranks in configurations:
        runs = results[(kind, ranks)]
        ms = statistics.median(r["ms"] for r in runs)
        dense_ms = statistics.median(r["ms"] for r in results[("dense", ranks)])
        line = (f"moe_model model={kind} ranks={ranks} step_ms={ms:.1f}"
                f" tokens_per_s={statistics.median(r['tokens_per_s'] for r in runs):.0f}"
                f" ratio_to_dense={ms / dense_ms:.3f} parameters_rank0={runs[0]['parameters']}"
                f" model_state_bytes={runs[0]['model_state']:.0f} activations_bytes={runs[0]['activations']:.0f}")
        if kind == "moe" and ranks > 1:
            exchange = statistics.median(r["exchange_ms"] for r in runs)
            line += f" all_to_all_ms={exchange:.1f} all_to_all_share={exchange / ms:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
