#!/usr/bin/env python3
"""Context parallelism: step time and activation memory per rank of a Llama at long sequences, cp 1/2/4.

For every --seq-length in --seq and every cp in --cp, in alternating rounds
(so machine noise hits every configuration alike), runs

    mpirun -np C --bind-to none --oversubscribe tessera train --synthetic --model llama --seq-length T \\
        --context-parallel-size C ...

and prints one line per configuration:

    context_parallel seq=4096 cp=2 step_ms=123.4 ratio_to_cp1=0.61 activations_bytes=22419456
        activations_ratio_to_cp1=0.56 tokens_per_rank=2048

step_ms: the median over rounds of a round's median step time (rank 0's
metrics, warm-up steps excluded); activations_bytes: rank 0's peak bytes of
activations and workspaces over the timed steps, by the allocator's counters
(everything but parameters, gradients and optimizer state).

With cp > 1 the runs also write a trace (--trace), and the ring's events of
the timed steps on every rank give (medians over rounds, summed over ranks):
ring_exchange_ms (per step and rank: every exchange from its launch until it
was seen complete), ring_exposed_ms (the waits that blocked: exchange time
not hidden behind a block's compute), ring_exposed_share (exposed over
exchange time) and ring_exposed_of_attention (exposed over the ring's
compute plus exposed time: what the exchanges add to attention). Every rank runs
one OpenMP thread; with more ranks than cores the timings include
oversubscription (4 ranks on 2 cores take turns), so compare within one run
and read the memory, which does not depend on the cores, as the result.

Usage: benchmarks/context_parallel.py [--tessera build/bin/tessera] [--seq 2048 4096 8192] [--cp 1 2 4]
       [--rounds 3] [--steps 4]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from machine import cpu_description, mpi_environment, run

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 1


def llama_flags(seq):
    return ["--model", "llama", "--num-layers", "4", "--hidden-size", "256", "--num-heads", "8",
            "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "704", "--vocab-size", "2048",
            "--seq-length", str(seq), "--micro-batch-size", "1", "--lr", "1e-3", "--threads", "1"]


def timed_run(args, seq, cp, tmp, env):
    metrics = os.path.join(tmp, f"metrics_{seq}_{cp}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([args.mpirun, "-np", str(cp), "--bind-to", "none", "--oversubscribe", args.tessera, "train", "--synthetic",
         *llama_flags(seq), "--context-parallel-size", str(cp), "--train-steps", str(args.steps + WARMUP),
         "--log-interval", "1000", "--metrics", metrics, *trace_flags(tmp, seq, cp)], env)
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    timed = [r for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]
    if not timed:
        sys.exit(f"no timed steps in {metrics}")
    ring = ring_times(tmp, seq, cp, len(timed)) if cp > 1 else None
    return statistics.median(r["ms_per_step"] for r in timed), max(r["mem_activations_bytes"] for r in timed), ring


def trace_path(tmp, seq, cp):
    return os.path.join(tmp, f"trace_{seq}_{cp}.json")


def trace_flags(tmp, seq, cp):
    return ["--trace", trace_path(tmp, seq, cp)] if cp > 1 else []


def ring_times(tmp, seq, cp, steps):
    """Milliseconds per step and rank of the ring's exchanges, waits and blocks in the timed steps' trace events."""
    totals = {"exchange": 0.0, "wait": 0.0, "block": 0.0}
    for rank in range(cp):
        path = trace_path(tmp, seq, cp).replace(".json", f".rank{rank}.json")
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        timed_from = min(e["ts"] for e in events if e.get("name") == f"step {WARMUP + 1}")
        for e in events:
            name = e.get("name", "")
            if e.get("ph") == "X" and name.startswith("ring ") and e["ts"] >= timed_from:
                totals[name.split()[-1]] += e["dur"] / 1000.0
        os.remove(path)
    return {kind: ms / (steps * cp) for kind, ms in totals.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    env = mpi_environment()
    configurations = [(seq, cp) for seq in args.seq for cp in args.cp]
    print(f"context_parallel: {cpu_description()}; Llama {' '.join(llama_flags('T')[2:])}, "
          f"{args.steps} timed steps x {args.rounds} rounds", flush=True)
    times = {c: [] for c in configurations}
    rings = {c: [] for c in configurations}
    memory = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for c in configurations:
                ms, memory[c], ring = timed_run(args, *c, tmp, env)
                times[c].append(ms)
                if ring:
                    rings[c].append(ring)
    for seq, cp in configurations:
        ms = statistics.median(times[(seq, cp)])
        line = f"context_parallel seq={seq} cp={cp} step_ms={ms:.1f}"
        if (seq, 1) in times:
            line += f" ratio_to_cp1={ms / statistics.median(times[(seq, 1)]):.3f}"
        line += f" activations_bytes={memory[(seq, cp)]:.0f}"
        if (seq, 1) in memory:
            line += f" activations_ratio_to_cp1={memory[(seq, cp)] / memory[(seq, 1)]:.3f}"
        line += f" tokens_per_rank={seq // cp}"
        if rings[(seq, cp)]:
            exchange = statistics.median(r["exchange"] for r in rings[(seq, cp)])
            exposed = statistics.median(r["wait"] for r in rings[(seq, cp)])
            block = statistics.median(r["block"] for r in rings[(seq, cp)])
            line += (f" ring_exchange_ms={exchange:.1f} ring_exposed_ms={exposed:.1f}"
                     f" ring_exposed_share={exposed / exchange:.3f}"
                     f" ring_exposed_of_attention={exposed / (block + exposed):.3f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
