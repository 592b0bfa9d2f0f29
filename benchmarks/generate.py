#!/usr/bin/env python3
"""Text generation side by side: tokens per second with and without the KV cache, on 1 and 2 ranks.

Makes a checkpoint of a GPT of the given size (`tessera train --synthetic`
for one step: the weights' values do not change the cost), then, in
alternating rounds (so machine noise hits every configuration alike), runs

    mpirun -np R --bind-to none --oversubscribe tessera generate CKPT --prompt-ids ... \\
        --max-new-tokens N --temperature 0 [--no-kv-cache]

for R in --ranks (R > 1: the model split over R tensor-parallel ranks) and
with/without the cache, and reads the figures generate prints on stderr
(tokens per second after the prompt). Both ways produce the same tokens
(greedy; checked here too). Prints one line per configuration:

    generate ranks=1 cache=on tokens_per_s=512.3 ratio_to_no_cache=21.4 prompt_ms=3.1 new_tokens=448

tokens_per_s and prompt_ms: medians over the rounds. Compare within one run only.

Usage: benchmarks/generate.py [--tessera build/bin/tessera] [--ranks 1 2] [--rounds 3] [--num-layers 6]
       [--hidden-size 384] [--num-heads 6] [--vocab-size 4096] [--seq-length 512] [--prompt 64]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile

from machine import cpu_description, mpi_environment, run

HERE = os.path.dirname(os.path.abspath(__file__))


def make_checkpoint(args, directory, env):
    run([args.tessera, "train", "--model", "gpt", "--synthetic", "--vocab-size", str(args.vocab_size),
         "--seq-length", str(args.seq_length), "--num-layers", str(args.num_layers), "--num-heads",
         str(args.num_heads), "--hidden-size", str(args.hidden_size), "--micro-batch-size", "1",
         "--train-steps", "1", "--save", directory], env)
    return directory


def generate(args, checkpoint, ranks, cache, env):
    """(tokens per second, prompt seconds, the tokens) of one generate run."""
    prompt = ",".join(str((7 * i + 3) % args.vocab_size) for i in range(args.prompt))
    new_tokens = args.seq_length - args.prompt + 1
    cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", "--oversubscribe", args.tessera, "generate",
           checkpoint, "--prompt-ids", prompt, "--max-new-tokens", str(new_tokens), "--temperature", "0",
           "--print-ids", "--threads", str(max(1, (os.cpu_count() or 1) // ranks))]
    if not cache:
        cmd.append("--no-kv-cache")
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"failed ({' '.join(cmd)}):\n{result.stdout}\n{result.stderr}")
    figures = re.search(r"the prompt in ([0-9.]+) s, then ([0-9.]+) tokens/s", result.stderr)
    if not figures:
        raise SystemExit(f"no figures in the output of {' '.join(cmd)}:\n{result.stderr}")
    return float(figures.group(2)), float(figures.group(1)), result.stdout.split(), new_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tessera", default=os.path.join(HERE, "..", "build", "bin", "tessera"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-heads", type=int, default=6)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    env = mpi_environment()
    env.pop("OMP_NUM_THREADS")  # --threads decides
    print(f"machine={cpu_description()}")
    print(f"model=gpt layers={args.num_layers} hidden={args.hidden_size} heads={args.num_heads} "
          f"vocab={args.vocab_size} context={args.seq_length} prompt={args.prompt}")
    directory = tempfile.mkdtemp(prefix="tessera_generate_bench_")
    try:
        checkpoint = make_checkpoint(args, os.path.join(directory, "ckpt"), env)
        configurations = [(ranks, cache) for ranks in args.ranks for cache in (True, False)]
        rates = {c: [] for c in configurations}
        prompts = {c: [] for c in configurations}
        outputs = {}
        for _ in range(args.rounds):
            for configuration in configurations:
                rate, prompt_s, tokens, new_tokens = generate(args, checkpoint, *configuration, env)
                rates[configuration].append(rate)
                prompts[configuration].append(prompt_s)
                outputs[configuration] = tokens
        reference = outputs[configurations[0]]
        for configuration in configurations:
            ranks, cache = configuration
            no_cache = statistics.median(rates[(ranks, False)])
            rate = statistics.median(rates[configuration])
            same = "yes" if outputs[configuration] == reference else "NO"
            print(f"generate ranks={ranks} cache={'on' if cache else 'off'} tokens_per_s={rate:.1f} "
                  f"ratio_to_no_cache={rate / no_cache:.2f} prompt_ms={1e3 * statistics.median(prompts[configuration]):.1f} "
                  f"new_tokens={new_tokens} same_tokens_as_first={same}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
