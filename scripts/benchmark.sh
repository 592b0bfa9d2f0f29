#!/usr/bin/env bash
# Benchmarks on this machine, beside PyTorch (installs Debian's python3-torch,
# and PyPI's current one into /opt/tessera-tools/torch) and MPI: GEMM through
# the tensor API vs OpenBLAS and PyTorch, bf16 GEMM of square, GPT and Llama
# shapes vs PyTorch 2.15 (benchmarks/gemm_compare.py); training step
# time for MLP, CNN and GPT in f32 and bf16 vs PyTorch; all-reduce through the
# communicator vs MPI_Allreduce; data-parallel efficiency of 2 ranks vs 1;
# the pipeline bubble of every schedule at P = 2, 4 stages against theory, and
# the schedules' step times on a real Llama.
# Prints name=value lines.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --with-benchmarks
scripts/build.sh >/dev/null
build/bin/benchmarks/gemm
# Debian's python3-torch lives in the system interpreter, whatever python3 is first on PATH.
/usr/bin/python3 benchmarks/gemm_torch.py
/usr/bin/python3 benchmarks/gemm_compare.py
/usr/bin/python3 benchmarks/train_compare.py
# Communication: all-reduce against MPI_Allreduce, and data-parallel efficiency (2 ranks vs 1).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np 2 --bind-to none --oversubscribe build/bin/benchmarks/allreduce
/usr/bin/python3 benchmarks/dp_efficiency.py
# Pipeline bubble: measured idle share of a step for P = 2, 4 stages and M = 4, 8, 16 micro-batches under every
# schedule, beside the simulator and the closed forms; then the schedules' step times on a real Llama.
for stages in 2 4; do
  mpirun -np $stages --bind-to none --oversubscribe build/bin/benchmarks/pipeline_bubble --micro-batches 4 8 16 \
    --schedule gpipe 1f1b zb-h1 zbv --virtual-stages 1 2
done
/usr/bin/python3 benchmarks/pipeline_schedules.py
