#!/usr/bin/env python3
"""Data-parallel efficiency: 2 ranks x 1 thread x batch b against 1 rank x 1 thread x batch b.

For each model it runs, alternating --rounds times,

    tessera train --synthetic --threads 1 --micro-batch-size b ...                           (one rank)
    mpirun -np 2 --bind-to none --oversubscribe tessera train ... (same flags)               (two ranks)

and prints

    dp_efficiency model=mlp ranks=2 batch_per_rank=128 zero=0 one_rank_ms=11.2 two_rank_ms=12.0 efficiency=0.93

where each *_ms is the median over the rounds of a round's median step time
(rank 0's metrics file, warm-up steps excluded) and efficiency =
one_rank_ms / two_rank_ms: 1.0 when two ranks process twice the samples in
the same time (the gradient all-reduce entirely hidden or free). Each rank
runs one OpenMP thread (OMP_NUM_THREADS=1, --threads 1), so two ranks use two
cores; the all-reduce goes through Open MPI's shared-memory transport. --zero
applies to the two-rank run (the one-rank baseline is plain). On CPU ranks the
reduction itself needs the core that computes, so what overlap hides is
bounded: expect efficiency to grow with the compute per parameter (batch,
convolutions).

Usage: benchmarks/dp_efficiency.py [--tessera build/bin/tessera] [--models mlp,cnn] [--rounds 3]
       [--batch 128] [--bucket-size-mb 25] [--zero 0]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# model -> (flags, steps)
MODELS = {
    "mlp": (["--model", "mlp", "--hidden", "1024,1024"], 40),
    "cnn": (["--model", "cnn"], 15),
}
WARMUP = 3


def run_ms(command, env, metrics):
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"failed ({' '.join(command)}):\n{result.stderr}")
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    times = [r["ms_per_step"] for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]
    if not times:
        sys.exit(f"no timed steps in {metrics} ({' '.join(command)})")
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=128, help="micro-batch per rank (b)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-size-mb", default="25")
    parser.add_argument("--zero", default="0")
    args = parser.parse_args()

    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    if os.geteuid() == 0:  # Open MPI refuses to run as root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpirun = [args.mpirun, "-np", "2", "--bind-to", "none", "--oversubscribe"]
    print(f"dp_efficiency: {os.cpu_count()} cores, 1 thread per rank, batch {args.batch} per rank, "
          f"bucket {args.bucket_size_mb} MiB, zero {args.zero}", flush=True)
    for model in args.models.split(","):
        flags, steps = MODELS[model]
        one, two = [], []
        with tempfile.TemporaryDirectory() as tmp:
            metrics = os.path.join(tmp, "metrics.jsonl")
            train = [args.tessera, "train", "--synthetic", *flags, "--micro-batch-size", str(args.batch),
                     "--train-steps", str(steps + WARMUP), "--optimizer", "sgd", "--lr", "0.01", "--clip-grad", "0",
                     "--threads", "1", "--bucket-size-mb", args.bucket_size_mb, "--log-interval", "1000",
                     "--metrics", metrics]
            for _ in range(args.rounds):
                one.append(run_ms(train, env, metrics))  # one rank: plain (ZeRO on one rank only adds copies)
                two.append(run_ms(mpirun + train + ["--zero", args.zero], env, metrics))
        one_ms, two_ms = statistics.median(one), statistics.median(two)
        print(f"dp_efficiency model={model} ranks=2 batch_per_rank={args.batch} zero={args.zero} "
              f"one_rank_ms={one_ms:.2f} two_rank_ms={two_ms:.2f} efficiency={one_ms / two_ms:.3f}", flush=True)


if __name__ == "__main__":
    main()
