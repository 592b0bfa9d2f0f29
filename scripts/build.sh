#!/usr/bin/env bash
# Configures and builds Tessera into ./build (Release, warnings as errors, the
# CUDA backend when nvcc exists). Extra arguments go to CMake, e.g.
#   scripts/build.sh -DTESSERA_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_WERROR=ON "$@" >build-configure.log 2>&1 || {
  cat build-configure.log >&2; exit 1; }
grep -E '^-- Tessera' build-configure.log || true
cmake --build build --parallel "$(nproc)"
