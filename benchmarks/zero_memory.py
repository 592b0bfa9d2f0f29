#!/usr/bin/env python3
"""ZeRO stages side by side: per-rank memory (measured and predicted) and step time of the GPT.

For every data-parallel size in --ranks and every --zero stage in --zero, in
alternating rounds (so machine noise hits every configuration alike), runs

    mpirun -np D --bind-to none --oversubscribe tessera train --synthetic --model gpt --zero Z ...

and, once per configuration, the same command with --estimate-memory. Prints
one line per configuration:

    zero_memory ranks=4 zero=3 step_ms=123.4 ratio_to_zero1=1.21 parameters_bytes=... gradients_bytes=...
        optimizer_bytes=... model_state_bytes=... activations_bytes=... predicted_model_state_bytes=...
        predicted_error=+0.4%

step_ms: the median over rounds of a round's median step time (rank 0's
metrics, warm-up steps excluded); ratio_to_zero1: step_ms over ZeRO-1's at
the same number of ranks. The memory figures are rank 0's peaks over the
timed steps, by the allocator's counters per use (parameters, gradients,
optimizer state, and everything else: activations, workspaces, batches);
model_state_bytes is the peak of the first three together. predicted: what
`--estimate-memory` prints for rank 0 (parallel/memory_plan.h). Every rank runs
one OpenMP thread; with more ranks than cores the timings include
oversubscription, so compare within one run only.

Usage: benchmarks/zero_memory.py [--tessera build/bin/tessera] [--ranks 1 2 4] [--zero 0 1 2 3]
       [--rounds 3] [--steps 8] [--num-layers 8] [--hidden-size 256] [--zero-prefetch 1]
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
WARMUP = 2
MEMORY = ["mem_parameters_bytes", "mem_gradients_bytes", "mem_optimizer_bytes", "mem_model_state_bytes",
          "mem_activations_bytes"]


def gpt_flags(args):
    return ["--model", "gpt", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-heads", "4", "--seq-length", "128", "--vocab-size", "4096", "--micro-batch-size", "4",
            "--global-batch-size", "16", "--optimizer", "adamw", "--lr", "1e-3", "--threads", "1"]


def command(args, ranks, zero, extra):
    flags = gpt_flags(args) + ["--zero", str(zero)]
    if zero >= 2:
        flags += ["--zero-prefetch", str(args.zero_prefetch)]
    return [args.mpirun, "-np", str(ranks), "--bind-to", "none", "--oversubscribe", args.tessera, "train",
            "--synthetic", *flags, *extra]


def timed_run(args, ranks, zero, tmp, env):
    metrics = os.path.join(tmp, f"metrics_{ranks}_{zero}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run(command(args, ranks, zero, ["--train-steps", str(args.steps + WARMUP), "--log-interval", "1000",
                                    "--metrics", metrics]), env)
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    timed = [r for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]
    if not timed:
        sys.exit(f"no timed steps in {metrics}")
    memory = {key: max(r[key] for r in timed) for key in MEMORY}
    return statistics.median(r["ms_per_step"] for r in timed), memory


def predicted(args, ranks, zero, env):
    out = run(command(args, ranks, zero, ["--train-steps", "1", "--estimate-memory"]), env)
    match = re.search(r"^rank 0: P=.* = (\d+) bytes$", out, re.MULTILINE)
    if not match:
        sys.exit(f"no prediction in:\n{out}")
    return int(match.group(1))



def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--zero-prefetch", type=int, default=1)
    args = parser.parse_args()

    env = mpi_environment()
    # One rank is measured without ZeRO only: tessera refuses --zero at one data-parallel rank.
    configurations = [(ranks, zero) for ranks in args.ranks for zero in args.zero if ranks > 1 or zero == 0]
    print(f"zero_memory: {cpu_description()}; GPT {' '.join(gpt_flags(args)[2:])}, "
          f"--zero-prefetch {args.zero_prefetch}, {args.steps} timed steps x {args.rounds} rounds", flush=True)
    times = {c: [] for c in configurations}
    memory, prediction = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in configurations:
            prediction[c] = predicted(args, *c, env)
        for _ in range(args.rounds):
            for c in configurations:
                ms, memory[c] = timed_run(args, *c, tmp, env)
                times[c].append(ms)
    for ranks, zero in configurations:
        ms = statistics.median(times[(ranks, zero)])
        line = f"zero_memory ranks={ranks} zero={zero} step_ms={ms:.1f}"
        if (ranks, 1) in times:
            line += f" ratio_to_zero1={ms / statistics.median(times[(ranks, 1)]):.3f}"
        m = memory[(ranks, zero)]
        line += (f" parameters_bytes={m['mem_parameters_bytes']:.0f} gradients_bytes={m['mem_gradients_bytes']:.0f}"
                 f" optimizer_bytes={m['mem_optimizer_bytes']:.0f} model_state_bytes={m['mem_model_state_bytes']:.0f}"
                 f" activations_bytes={m['mem_activations_bytes']:.0f}")
        p = prediction[(ranks, zero)]
        line += f" predicted_model_state_bytes={p} predicted_error={100.0 * (p - m['mem_model_state_bytes']) / p:+.1f}%"
        print(line, flush=True)


if __name__ == "__main__":
    main()
