#!/usr/bin/env bash
# Installs dependencies, builds everything (CPU and CUDA backends, warnings as
# errors) and runs the whole test suite. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 900
