#!/usr/bin/env bash
# Benchmarks on this machine, beside PyTorch (installs Debian's python3-torch)
# and MPI: GEMM through the tensor API vs OpenBLAS and PyTorch; training step
# time for MLP, CNN and GPT in f32 and bf16 vs PyTorch; all-reduce through the
# communicator vs MPI_Allreduce; data-parallel efficiency of 2 ranks vs 1.
# Prints name=value lines.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --with-benchmarks
scripts/build.sh >/dev/null
build/bin/benchmarks/gemm
# Debian's python3-torch lives in the system interpreter, whatever python3 is first on PATH.
/usr/bin/python3 benchmarks/gemm_torch.py
/usr/bin/python3 benchmarks/train_compare.py
# Communication: all-reduce against MPI_Allreduce, and data-parallel efficiency (2 ranks vs 1).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np 2 --bind-to none --oversubscribe build/bin/benchmarks/allreduce
/usr/bin/python3 benchmarks/dp_efficiency.py
