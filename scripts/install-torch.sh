#!/usr/bin/env bash
# Installs PyTorch from PyPI (pinned) into its own virtual environment,
# /opt/tessera-tools/torch (TESSERA_TOOLS_DIR/torch to change), for the
# side-by-side benchmarks (benchmarks/gemm_compare.py: bf16 GEMM beside a
# current PyTorch, whose oneDNN is much newer than Debian's python3-torch
# 1.13's). PyPI's Linux wheel brings its CUDA libraries along (about 5 GB);
# the benchmarks use only the CPU (NumPy: torch warns without it). Idempotent and quiet when the pinned
# version is in place. Run by scripts/install-deps.sh --with-benchmarks.
set -euo pipefail
"$(dirname "$0")/install-pypi-venv.sh" torch bin/python torch==2.15.0 numpy==2.4.6
