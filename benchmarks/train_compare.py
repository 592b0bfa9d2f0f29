#!/usr/bin/env python3
"""Training step time, Tessera beside PyTorch, in one run on this machine.

For each case (MLP batch 256, CNN batch 128, GPT and Llama batch 16; f32 and bf16) it
runs `tessera train --synthetic` and benchmarks/train_torch.py with the same
model, batch, optimizer and thread count, alternating the two programs
--rounds times (and which goes first), and prints per case

    train case=mlp_f32 tessera_ms=21.3 pytorch_ms=24.9 ratio=0.856 round_ratios=0.83,0.86,0.91

where each *_ms is the median step time over the rounds (each round's figure
being the median of its timed steps, warm-up excluded) and ratio =
tessera_ms / pytorch_ms (< 1: Tessera is faster); round_ratios are each
round's tessera/pytorch, sorted (their spread shows how noisy the machine
was: on a shared machine quote the median of several rounds). A header line says which
BLAS kernel runs (OpenBLAS core, OPENBLAS_CORETYPE) and the thread count;
both programs run under the same environment.

Usage: benchmarks/train_compare.py [--tessera build/bin/tessera] [--cases mlp_f32,gpt_bf16] [--rounds 3]
(needs Debian's python3-torch: scripts/install-deps.sh --with-benchmarks; or run it with another PyTorch's
interpreter, e.g. /opt/tessera-tools/torch/bin/python: the PyTorch side runs under the same interpreter)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# case -> (model flags, batch, optimizer flags, steps)
CASES = {
    "mlp": (["--model", "mlp", "--hidden", "1024,1024"], 256, ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.01"], 40),
    "cnn": (["--model", "cnn"], 128, ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.01"], 20),
    "gpt": (["--model", "gpt", "--vocab-size", "256", "--seq-length", "256", "--num-layers", "4", "--num-heads", "4",
             "--hidden-size", "256"], 16, ["--optimizer", "adamw", "--lr", "3e-4", "--weight-decay", "0.1"], 8),
    # Llama's defaults (RMSNorm, rope, SwiGLU, no biases, untied head) with 8 query heads in 2 key/value groups.
    "llama": (["--model", "llama", "--vocab-size", "256", "--seq-length", "256", "--num-layers", "4",
               "--num-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--hidden-size", "256",
               "--ffn-hidden-size", "704"], 16, ["--optimizer", "adamw", "--lr", "3e-4", "--weight-decay", "0.1"], 8),
}
WARMUP = 3


def tessera_ms(binary, case, threads):
    model, precision = case.split("_")
    flags, batch, optimizer, steps = CASES[model]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        command = [binary, "train", "--synthetic", *flags, *optimizer, "--micro-batch-size", str(batch),
                   "--train-steps", str(steps + WARMUP), "--precision", "fp32" if precision == "f32" else "bf16",
                   "--threads", str(threads), "--clip-grad", "0", "--metrics", metrics]
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            sys.exit(f"tessera failed ({' '.join(command)}):\n{result.stderr}")
        with open(metrics) as lines:
            records = [json.loads(line) for line in lines if line.strip()]
    times = [r["ms_per_step"] for r in records if "ms_per_step" in r and r.get("step", 0) > WARMUP]
    return statistics.median(times)


def pytorch_ms(case, threads):
    model, _ = case.split("_")
    _, batch, _, steps = CASES[model]
    command = [sys.executable, os.path.join(HERE, "train_torch.py"), "--case", case, "--batch", str(batch),
               "--steps", str(steps), "--warmup", str(WARMUP), "--threads", str(threads)]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"pytorch failed ({' '.join(command)}):\n{result.stderr}")
    fields = dict(part.split("=", 1) for part in result.stdout.split() if "=" in part)
    return float(fields["ms_per_step"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--cases", default="mlp_f32,mlp_bf16,cnn_f32,cnn_bf16,gpt_f32,gpt_bf16,llama_f32,llama_bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("PyTorch is not installed for this interpreter: run scripts/install-deps.sh --with-benchmarks "
                 "and use Debian's /usr/bin/python3")
    # One OpenMP pool that sleeps when idle in both programs (two spinning pools on 2 cores halve the speed).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    info = subprocess.run([args.tessera, "--version"], stdout=subprocess.PIPE, text=True).stdout
    blas = next((line for line in info.splitlines() if "openblas" in line.lower()), "openblas: ?")
    print(f"train threads={args.threads} torch={torch.__version__} OPENBLAS_CORETYPE="
          f"{os.environ.get('OPENBLAS_CORETYPE', 'unset')} {blas.strip()}", flush=True)
    for case in args.cases.split(","):
        ours, theirs = [], []
        for round_index in range(args.rounds):
            if round_index % 2:
                theirs.append(pytorch_ms(case, args.threads))
            ours.append(tessera_ms(args.tessera, case, args.threads))
            if not round_index % 2:
                theirs.append(pytorch_ms(case, args.threads))
        a, b = statistics.median(ours), statistics.median(theirs)
        rounds = ",".join(f"{x / y:.2f}" for x, y in sorted(zip(ours, theirs), key=lambda pair: pair[0] / pair[1]))
        print(f"train case={case} tessera_ms={a:.2f} pytorch_ms={b:.2f} ratio={a / b:.3f} round_ratios={rounds}",
              flush=True)


if __name__ == "__main__":
    main()
