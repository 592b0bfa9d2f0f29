#!/usr/bin/env bash
# The README's first command: installs dependencies, builds, prepares
# Fashion-MNIST (Debian's dataset-fashion-mnist) and trains the MLP
# 784-1024-1024-10 on it for a few hundred steps with evaluation on two MPI
# ranks, then draws the curves. Everything it writes goes to runs/demo/ (and runs/data/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh --target tessera_cli  # the `tessera` program only: the demo runs nothing else (the tests build the rest)
tessera=build/bin/tessera
fmnist=/usr/share/datasets/fashion-mnist
mkdir -p runs/data runs/demo
[[ -f runs/data/fashion-mnist-train.h5 ]] || $tessera prepare idx --images $fmnist/train-images-idx3-ubyte.gz \
  --labels $fmnist/train-labels-idx1-ubyte.gz -o runs/data/fashion-mnist-train.h5
[[ -f runs/data/fashion-mnist-test.h5 ]] || $tessera prepare idx --images $fmnist/t10k-images-idx3-ubyte.gz \
  --labels $fmnist/t10k-labels-idx1-ubyte.gz -o runs/data/fashion-mnist-test.h5
# Two MPI ranks train one model (data parallelism), one thread each: 2 x 64
# samples = the same global batch of 128 as one rank with --micro-batch-size 128.
# Open MPI refuses to run as root unless told; --oversubscribe lets the ranks
# outnumber the cores and --bind-to none keeps each from being pinned to one.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np 2 --bind-to none --oversubscribe $tessera train --model mlp --hidden 1024,1024 \
  --data runs/data/fashion-mnist-train.h5 --eval-data runs/data/fashion-mnist-test.h5 \
  --micro-batch-size 64 --threads 1 --train-steps 400 --lr 1e-3 --warmup-steps 20 --eval-interval 100 \
  --metrics runs/demo/metrics.jsonl --trace runs/demo/trace.json
$tessera plot runs/demo/metrics.jsonl -o runs/demo/curves.svg
echo "demo: metrics in runs/demo/metrics.jsonl, curves in runs/demo/curves.svg," \
  "timelines in runs/demo/trace.rank0.json and trace.rank1.json (one per rank)"
