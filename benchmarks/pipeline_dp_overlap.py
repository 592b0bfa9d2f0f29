#!/usr/bin/env python3
"""Data-parallel reduction beside pipeline backward: dp 2 x pp 2 GPT step time and trace figures.

Runs, alternating --rounds times, for each binary given (--tessera, and
--baseline to compare another build side by side in one run),

    mpirun -np 4 --bind-to none --oversubscribe tessera train --synthetic --model gpt --dp 2 --pp 2 \\
        --trace T ...

and prints, per binary,

    pipeline_dp_overlap build=new ranks=4 dp=2 pp=2 step_ms=412.3 buckets=6 launched_in_backward=5
        reduction_tail_ms=3.2

step_ms: the median over rounds of a round's median step time (rank 0's
metrics, warm-up steps excluded). From the traces of the last round's timed
steps, per step and rank, median over them: buckets (bucket reductions),
launched_in_backward (of them, started before the stage's last backward of
the step ended: from a gradient hook) and reduction_tail_ms (from the end of
that backward to the last bucket seen complete: what the step waits for;
"seen" is the first poll that found it done, so it is an upper bound). Every rank runs one OpenMP thread; with 4 ranks on fewer cores
the timings include oversubscription, so compare within one run only.

Usage: benchmarks/pipeline_dp_overlap.py [--tessera build/bin/tessera] [--baseline OTHER/tessera]
       [--baseline-library-path DIR] [--rounds 3] [--steps 12] [--bucket-size-mb 1] [--num-layers 4]
       [--vocab-size 4096]
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 2
def gpt_flags(layers, vocab):
    return ["--model", "gpt", "--num-layers", str(layers), "--hidden-size", "256", "--num-heads", "4", "--seq-length",
            "128", "--vocab-size", str(vocab), "--micro-batch-size", "4", "--global-batch-size", "32"]


def step_times(metrics):
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    return [r["ms_per_step"] for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]


def overlap_of(trace_files):
    """Per step and rank: buckets, launched in backward, ms from the last backward to the last bucket's end."""
    rows = []
    for path in trace_files:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        # A step: from the end of the previous step's optimizer update to the end of its own.
        ends = sorted(e["ts"] + e["dur"] for e in events if e["name"] == "optimizer")
        for begin, end in list(zip(ends, ends[1:]))[WARMUP:]:
            inside = [e for e in events if begin <= e["ts"] < end]
            backward = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["name"].startswith("backward")]
            buckets = [e for e in inside if e["cat"] == "comm" and " bucket " in e["name"]
                       and not e["name"].startswith("all_gather")]
            if not backward or not buckets:
                continue
            last_backward = max(b for _, b in backward)
            launched = sum(1 for e in buckets if e["ts"] < last_backward)
            # What the step waits for after its last backward: until the last bucket is seen complete.
            tail = max(0.0, max(e["ts"] + e["dur"] for e in buckets) - last_backward)
            rows.append((len(buckets), launched, tail / 1e3))
    if not rows:
        sys.exit(f"no timed steps with bucket events in {trace_files}")
    return [statistics.median(column) for column in zip(*rows)]


def run(tessera, library_path, args, tmp, env):
    metrics = os.path.join(tmp, "metrics.jsonl")
    trace = os.path.join(tmp, "trace.json")
    for old in glob.glob(os.path.join(tmp, "trace*.json")):
        os.remove(old)
    run_env = dict(env)
    if library_path:
        run_env["LD_LIBRARY_PATH"] = library_path + ":" + env.get("LD_LIBRARY_PATH", "")
    command = [args.mpirun, "-np", "4", "--bind-to", "none", "--oversubscribe", "-x", "LD_LIBRARY_PATH",
               tessera, "train", "--synthetic", *gpt_flags(args.num_layers, args.vocab_size), "--pp", "2", "--train-steps",
               str(args.steps + WARMUP), "--optimizer", "adamw", "--lr", "1e-3", "--threads", "1",
               "--bucket-size-mb", args.bucket_size_mb, "--log-interval", "1000", "--metrics", metrics,
               "--trace", trace]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=run_env)
    if result.returncode != 0:
        sys.exit(f"failed ({' '.join(command)}):\n{result.stderr}")
    times = step_times(metrics)
    if not times:
        sys.exit(f"no timed steps in {metrics}")
    return statistics.median(times), sorted(glob.glob(os.path.join(tmp, "trace.rank*.json")))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--baseline", help="another build's tessera, run alternately with --tessera")
    parser.add_argument("--baseline-library-path", default="", help="LD_LIBRARY_PATH for --baseline (its libtessera)")
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bucket-size-mb", default="1")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096, help="the tied table's rows (its bucket waits for the sum)")
    args = parser.parse_args()

    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env.setdefault("LD_LIBRARY_PATH", "")
    if os.geteuid() == 0:  # Open MPI refuses to run as root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    builds = [("new", args.tessera, "")]
    if args.baseline:
        builds.append(("baseline", args.baseline, args.baseline_library_path))
    print(f"pipeline_dp_overlap: {os.cpu_count()} cores, 4 ranks x 1 thread, "
          f"GPT {' '.join(gpt_flags(args.num_layers, args.vocab_size)[2:])}, "
          f"bucket {args.bucket_size_mb} MiB", flush=True)
    times = {name: [] for name, _, _ in builds}
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, tessera, library_path in builds:
                ms, traces = run(tessera, library_path, args, tmp, env)
                times[name].append(ms)
                figures[name] = overlap_of(traces)
    for name, _, _ in builds:
        buckets, launched, tail = figures[name]
        print(f"pipeline_dp_overlap build={name} ranks=4 dp=2 pp=2 step_ms={statistics.median(times[name]):.1f} "
              f"buckets={buckets:g} launched_in_backward={launched:g} reduction_tail_ms={tail:.2f}", flush=True)
    if args.baseline:
        ratio = statistics.median(times["baseline"]) / statistics.median(times["new"])
        print(f"pipeline_dp_overlap speedup={ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
