#!/usr/bin/env python3
"""Checkpoint saves side by side: how long training stalls and how long the write takes, per way of writing.

For every number of ranks in --ranks and every way of writing, in alternating
rounds (so machine noise hits every configuration alike), runs

    mpirun -np D --bind-to none --oversubscribe tessera train --synthetic --model gpt --zero 3 \\
        --save DIR --save-interval 2 --train-steps 8 ...

with the ways of writing

    gathered   --ckpt-format gathered         every rank sends what it owns to rank 0, which writes one file
    sharded    --ckpt-format sharded --no-async-save   every rank writes its own file, training waits
    async      --ckpt-format sharded --async-save      every rank copies what it owns to host memory and a
                                                       background thread writes it while training goes on

(--zero 3: every rank owns 1/D of the parameters and of the optimizer state,
so there is something to write in parallel). Rank 0's `checkpoint:` lines
give, for each save, how long the step loop was blocked (synchronous: the
whole save; asynchronous: starting it, i.e. the descriptors' all-gather and
the host copy, plus publishing it later: rank 0's index, the rename,
`latest`) and how long the write took (synchronous: the same; asynchronous:
rank 0's background write of its file). The saves at steps 2, 4 and 6 are
counted (the one at the end is published at once). Prints one line per
configuration:

    checkpoint_save ranks=4 mode=async stall_ms=12.3 write_s=0.456 stall_ratio_to_gathered=0.02 owned_by_rank0=...
        step_ms=...

stall_ms and write_s: medians over the counted saves of every round;
step_ms: the median step time (rank 0's metrics, saves excluded: the time of
a step with a write running beside it shows there). The save directory is
on --dir (default: a temporary directory); checkpoints are fsynced, so the
write times include the disk. Compare within one run only.

Usage: benchmarks/checkpoint_save.py [--tessera build/bin/tessera] [--ranks 1 2 4] [--rounds 3]
       [--num-layers 8] [--hidden-size 384] [--dir DIR]
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
MODES = {
    "gathered": ["--ckpt-format", "gathered"],
    "sharded": ["--ckpt-format", "sharded", "--no-async-save"],
    "async": ["--ckpt-format", "sharded", "--async-save"],
}
SYNC_LINE = re.compile(r"^checkpoint: (\S+) \(([\d.]+) s, ([\d.]+ \w+) from rank 0\)$", re.MULTILINE)
ASYNC_LINE = re.compile(r"^checkpoint: (\S+) \(written in ([\d.]+) s in the background; training waited ([\d.]+) ms;"
                        r" ([\d.]+ \w+) from rank 0\)$", re.MULTILINE)


def gpt_flags(args):
    return ["--model", "gpt", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-heads", "6", "--seq-length", "64", "--vocab-size", "8192", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--optimizer", "adamw", "--lr", "1e-3", "--threads", "1"]


def timed_run(args, ranks, mode, work, env):
    save = os.path.join(work, f"save_{ranks}_{mode}")
    shutil.rmtree(save, ignore_errors=True)
    metrics = os.path.join(work, f"metrics_{ranks}_{mode}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    zero = ["--zero", "3"] if ranks > 1 else []
    out = run([args.mpirun, "-np", str(ranks), "--bind-to", "none", "--oversubscribe", args.tessera, "train",
               "--synthetic", *gpt_flags(args), *zero, *MODES[mode], "--save", save, "--save-interval", "2",
               "--train-steps", "8", "--log-interval", "1000", "--metrics", metrics], env)
    saves = []  # (step, stall_ms, write_s, size)
    for match in SYNC_LINE.finditer(out):
        seconds = float(match.group(2))
        saves.append((int(match.group(1).rsplit("_", 1)[1]), seconds * 1e3, seconds, match.group(3)))
    for match in ASYNC_LINE.finditer(out):
        saves.append((int(match.group(1).rsplit("_", 1)[1]), float(match.group(3)), float(match.group(2)),
                      match.group(4)))
    counted = [s for s in saves if s[0] < 8]
    if len(counted) != 3:
        sys.exit(f"expected the saves of steps 2, 4 and 6 in:\n{out}")
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    steps = [r["ms_per_step"] for r in records if r.get("kind") == "train" and r.get("step", 0) > 1]
    shutil.rmtree(save, ignore_errors=True)
    return counted, statistics.median(steps)



def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = parser.parse_args()

    env = mpi_environment()
    configurations = [(ranks, mode) for ranks in args.ranks for mode in MODES]
    print(f"checkpoint_save: {cpu_description()}; GPT {' '.join(gpt_flags(args)[2:])}, --zero 3 from 2 ranks, "
          f"saves at steps 2, 4, 6 of 8, {args.rounds} rounds", flush=True)
    saves = {c: [] for c in configurations}
    steps = {c: [] for c in configurations}
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for _ in range(args.rounds):
            for c in configurations:
                counted, step_ms = timed_run(args, *c, work, env)
                saves[c] += counted
                steps[c].append(step_ms)
    stall = {c: statistics.median(s[1] for s in saves[c]) for c in configurations}
    for ranks, mode in configurations:
        c = (ranks, mode)
        line = (f"checkpoint_save ranks={ranks} mode={mode} stall_ms={stall[c]:.1f}"
                f" write_s={statistics.median(s[2] for s in saves[c]):.3f}")
        if (ranks, "gathered") in stall:
            line += f" stall_ratio_to_gathered={stall[c] / stall[(ranks, 'gathered')]:.3f}"
        line += f" owned_by_rank0={saves[c][0][3].replace(' ', '')} step_ms={statistics.median(steps[c]):.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
