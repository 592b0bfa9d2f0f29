#!/usr/bin/env python3
"""tessera plan against measured runs: predicted and measured step time and memory of GPT and Llama layouts on 1, 2 and 4 CPU ranks.

For each world size W in --worlds, first the calibration run on W ranks,

    mpirun -np W tessera selfcheck --cluster --threads 1 --output cal-W.toml

(GEMM rates by shape, bandwidth, attention and the links, measured with all
W ranks at once), then for every layout of that world

    mpirun -np W tessera train --synthetic <model> <layout> --train-steps S --threads 1 --metrics m.jsonl
    tessera plan <model> <layout, every axis fixed> --cluster cal-W.toml

and one line per layout:

    plan_validation world=4 model=gpt layout="tp 2 pp 2 mbs 2" measured_ms=812.3 predicted_ms=790.1 time_error=-0.027 \\
        measured_bytes=1.2e8 predicted_bytes=1.19e8 memory_error=-0.008

measured_ms: the median step of rank 0's metrics (the first steps dropped);
measured_bytes: rank 0's peak of model state plus its peak of everything
else (activations, workspaces, batches) over the timed steps;
predicted_bytes: the plan's for rank 0 (pipeline stage 0). Then the summary
(median and largest |error|) and a markdown table. One OpenMP thread per
rank; with more ranks than cores they share them, as the calibration did.

Usage: benchmarks/plan_validation.py [--tessera build/bin/tessera] [--worlds 1 2 4] [--steps 6] [--keep DIR [--reuse]]
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile

from machine import cpu_description, mpi_environment, run

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 2
GLOBAL_BATCH = 16

MODELS = {
    "gpt": ["--model", "gpt", "--num-layers", "8", "--hidden-size", "256", "--num-heads", "4", "--seq-length", "256",
            "--vocab-size", "1024", "--global-batch-size", str(GLOBAL_BATCH)],
    "llama": ["--model", "llama", "--num-layers", "8", "--hidden-size", "256", "--num-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256", "--vocab-size", "1024",
              "--global-batch-size", str(GLOBAL_BATCH)],
}


class Layout:
    def __init__(self, world, model, tp=1, pp=1, zero=0, mbs=4, vpp=1, recompute=False, sp=False):
        self.world, self.model, self.tp, self.pp, self.zero, self.mbs = world, model, tp, pp, zero, mbs
        self.vpp, self.recompute, self.sp = vpp, recompute, sp

    def name(self):
        parts = [f"dp {self.world // (self.tp * self.pp)}"]
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        parts += [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"vpp {self.vpp}"] if self.vpp > 1 else []
        parts += [f"zero {self.zero}"] if self.zero else []
        parts += [f"mbs {self.mbs}"]
        parts += ["recompute"] if self.recompute else []
        parts += ["sp"] if self.sp else []
        return " ".join(parts)

    def flags(self):
        """Every axis, for train and plan alike (plan's search then has one layout to rank)."""
        flags = ["--tp", str(self.tp), "--pp", str(self.pp), "--zero", str(self.zero), "--micro-batch-size",
                 str(self.mbs), "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
                 f"--recompute={'true' if self.recompute else 'false'}"]
        if self.tp > 1:
            flags += [f"--sequence-parallel={'true' if self.sp else 'false'}"]
        if self.pp > 1:
            flags += ["--pipeline-schedule", "1f1b", "--virtual-pipeline-stages", str(self.vpp)]
        return flags


LAYOUTS = [
    Layout(1, "gpt"), Layout(1, "llama"), Layout(1, "gpt", recompute=True),
    Layout(2, "gpt"), Layout(2, "gpt", zero=1), Layout(2, "llama", zero=2), Layout(2, "gpt", tp=2),
    Layout(2, "llama", tp=2, sp=True), Layout(2, "gpt", pp=2, mbs=2),
    Layout(4, "gpt", zero=3, mbs=2), Layout(4, "gpt", tp=2), Layout(4, "gpt", pp=2, zero=1, mbs=2),
    Layout(4, "llama", pp=4, vpp=2, mbs=1), Layout(4, "gpt", tp=2, pp=2, mbs=2),
    Layout(4, "llama", tp=2, pp=2, mbs=2, recompute=True),
]


def mpirun(args, world):
    return [args.mpirun, "-np", str(world), "--bind-to", "none", "--oversubscribe"]


def measured(args, layout, tmp, env):
    metrics = os.path.join(tmp, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run(mpirun(args, layout.world) + [args.tessera, "train", "--synthetic", *MODELS[layout.model], *layout.flags(),
                                      "--threads", "1", "--train-steps", str(args.steps + WARMUP),
                                      "--log-interval", "1000", "--metrics", metrics], env)
    with open(metrics) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    timed = [r for r in records if r.get("kind") == "train" and r.get("step", 0) > WARMUP]
    return (statistics.median(r["ms_per_step"] for r in timed),
            max(r["mem_model_state_bytes"] for r in timed) + max(r["mem_activations_bytes"] for r in timed))


def predicted(args, layout, calibration, env):
    out = run([args.tessera, "plan", *MODELS[layout.model], *layout.flags(), "--cluster", calibration], env)
    values = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("predicted_"))
    return 1e3 * float(values["predicted_step_s"]), float(values["predicted_rank0_memory_bytes"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--keep", help="keep the calibration files in this directory")
    parser.add_argument("--reuse", action="store_true", help="use the calibration files already in --keep")
    args = parser.parse_args()
    env = mpi_environment()
    print(f"plan_validation: {cpu_description()}; {args.steps} timed steps per layout", flush=True)
    rows, time_errors, memory_errors = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for world in args.worlds:
            calibration = os.path.join(folder, f"cal-{world}.toml")
            if not (args.reuse and os.path.exists(calibration)):
                run(mpirun(args, world) + [args.tessera, "selfcheck", "--cluster", "--threads", "1", "--output", calibration], env)
            for layout in (l for l in LAYOUTS if l.world == world):
                ms, used = measured(args, layout, tmp, env)
                p_ms, p_bytes = predicted(args, layout, calibration, env)
                t_err, m_err = p_ms / ms - 1, p_bytes / used - 1
                time_errors.append(abs(t_err))
                memory_errors.append(abs(m_err))
                print(f'plan_validation world={world} model={layout.model} layout="{layout.name()}" '
                      f"measured_ms={ms:.1f} predicted_ms={p_ms:.1f} time_error={t_err:+.3f} "
                      f"measured_bytes={used:.4g} predicted_bytes={p_bytes:.4g} memory_error={m_err:+.3f}", flush=True)
                rows.append(f"| {world} | {layout.model} | {layout.name()} | {ms:.0f} | {p_ms:.0f} | {100 * t_err:+.1f} % | "
                            f"{used / 2**20:.1f} | {p_bytes / 2**20:.1f} | {100 * m_err:+.1f} % |")
    print(f"plan_validation_summary layouts={len(rows)} median_time_error={statistics.median(time_errors):.3f} "
          f"max_time_error={max(time_errors):.3f} median_memory_error={statistics.median(memory_errors):.3f} "
          f"max_memory_error={max(memory_errors):.3f}", flush=True)
    print("\n| ranks | model | layout | measured ms | predicted ms | error | measured MiB | predicted MiB | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
