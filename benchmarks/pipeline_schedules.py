#!/usr/bin/env python3
"""Pipeline schedules on a real model: Llama step time under gpipe, 1f1b, interleaved, zb-h1 and zbv at pp 4 and 2.

For every pipeline size P in --pp (P ranks, dp 1) and every schedule, in
alternating rounds (A B C D E, A B C D E, ...: machine noise hits every
schedule alike), runs

    mpirun -np P --bind-to none --oversubscribe tessera train --synthetic --model llama --pp P \\
        --pipeline-schedule S [--virtual-pipeline-stages 2] ...

(the Llama: its own LM head, so zbv can run; 8 layers, hidden 128, seq 128,
micro-batch 2, global batch 32: M = 16 micro-batches per step; one OpenMP
thread per rank) and prints one line per configuration:

    pipeline_schedules pp=4 schedule=zb-h1 virtual_stages=1 micro_batches=16 step_ms=812.3 ratio_to_1f1b=0.951 \\
        stage0_idle=0.153 stage0_activations_bytes=23068672 rounds_ms=815/812/790

then a markdown table of the same. step_ms: the median over rounds of a
round's median step time (rank 0's metrics, the first step dropped);
rounds_ms: each round's; ratio_to_1f1b: the median over rounds of the
step time over 1f1b's at the same P in that round; stage0_idle: the median of
stage 0's pipeline_idle (its idle share of the pipeline part of a step);
stage0_activations_bytes: stage 0's peak bytes of activations and
workspaces. With more ranks than cores the ranks share them, so step times
measure the machine as well as the schedule: compare within one run, and
see benchmarks/pipeline_bubble.cpp for the bubble alone.

Usage: benchmarks/pipeline_schedules.py [--tessera build/bin/tessera] [--pp 4 2] [--rounds 3] [--steps 5]
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
MICRO_BATCH, GLOBAL_BATCH = 2, 32
# (name, --pipeline-schedule, --virtual-pipeline-stages)
SCHEDULES = [("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("interleaved", "1f1b", 2), ("zb-h1", "zb-h1", 1),
             ("zbv", "zbv", 2)]


def model_flags():
    return ["--model", "llama", "--num-layers", "8", "--hidden-size", "128", "--num-heads", "4", "--seq-length", "128",
            "--vocab-size", "1024", "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--lr", "1e-3", "--threads", "1"]


def schedule_flags(schedule, virtual_stages):
    flags = ["--pipeline-schedule", schedule]
    if schedule == "1f1b" and virtual_stages > 1:
        flags += ["--virtual-pipeline-stages", str(virtual_stages)]
    return flags


def timed_run(args, pp, schedule, virtual_stages, tmp, env):
    metrics = os.path.join(tmp, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([args.mpirun, "-np", str(pp), "--bind-to", "none", "--oversubscribe", args.tessera, "train", "--synthetic",
         *model_flags(), "--pp", str(pp), *schedule_flags(schedule, virtual_stages),
         "--train-steps", str(args.steps + WARMUP), "--log-interval", "1000", "--metrics", metrics], env)
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    timed = [r for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]
    if not timed:
        sys.exit(f"no timed steps in {metrics}")
    return {
        "ms": statistics.median(r["ms_per_step"] for r in timed),
        "idle": statistics.median(r["pipeline_idle"] for r in timed),
        "activations": max(r["mem_activations_bytes"] for r in timed),
    }


def summarise(results, pp, name):
    runs = results[(pp, name)]
    # The ratio within each round (its runs minutes apart at most), then their median: load that comes and goes
    # between rounds cancels out.
    ratios = [r["ms"] / baseline["ms"] for r, baseline in zip(runs, results[(pp, "1f1b")])]
    return {"ms": statistics.median(r["ms"] for r in runs), "rounds_ms": [r["ms"] for r in runs],
            "ratio": statistics.median(ratios), "idle": statistics.median(r["idle"] for r in runs),
            "activations": max(r["activations"] for r in runs)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    env = mpi_environment()
    configurations = [(pp, name) for pp in args.pp for name, _, _ in SCHEDULES]
    flags = {name: (schedule, v) for name, schedule, v in SCHEDULES}
    print(f"pipeline_schedules: {cpu_description()}; Llama {' '.join(model_flags()[2:])}, "
          f"{args.steps} timed steps x {args.rounds} rounds", flush=True)
    results = {c: [] for c in configurations}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for pp, name in configurations:
                results[(pp, name)].append(timed_run(args, pp, *flags[name], tmp, env))
    rows = []
    for pp, name in configurations:
        s = summarise(results, pp, name)
        micro_batches = GLOBAL_BATCH // MICRO_BATCH
        print(f"pipeline_schedules pp={pp} schedule={name} virtual_stages={flags[name][1]} "
              f"micro_batches={micro_batches} step_ms={s['ms']:.1f} ratio_to_1f1b={s['ratio']:.3f} "
              f"stage0_idle={s['idle']:.3f} stage0_activations_bytes={s['activations']:.0f} "
              f"rounds_ms={'/'.join(f'{ms:.0f}' for ms in s['rounds_ms'])}", flush=True)
        rows.append(f"| {pp} | {name} | {s['ms']:.1f} | {s['ratio']:.3f} | {s['idle']:.3f} | "
                    f"{s['activations'] / 2**20:.1f} |")
    print("\n| P | schedule | step ms | ratio to 1F1B | stage 0 idle | stage 0 activations MiB |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
