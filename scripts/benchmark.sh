#!/usr/bin/env bash
# Benchmarks beside PyTorch on this machine (installs Debian's python3-torch):
# GEMM through the tensor API vs OpenBLAS and PyTorch, and training step time
# for MLP, CNN and GPT in f32 and bf16 vs PyTorch. Prints name=value lines.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --with-benchmarks
scripts/build.sh >/dev/null
build/bin/benchmarks/gemm
# Debian's python3-torch lives in the system interpreter, whatever python3 is first on PATH.
/usr/bin/python3 benchmarks/gemm_torch.py
/usr/bin/python3 benchmarks/train_compare.py "$@"
