#!/usr/bin/env bash
# Installs dependencies (PyTorch included, for comparison), builds, then runs
# the main job: the kernel self-check on every device here and the GEMM
# benchmark beside OpenBLAS and PyTorch. Until training lands, this is the
# most complete thing Tessera does end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --with-benchmarks
scripts/build.sh
build/bin/tessera info
build/bin/tessera selfcheck
build/bin/benchmarks/gemm
# Debian's python3-torch lives in the system interpreter, whatever python3 is first on PATH.
/usr/bin/python3 benchmarks/gemm_torch.py
