#!/usr/bin/env bash
# scripts/demo.sh, the README's first command, run whole: it builds the
# `tessera` program and nothing else (every cmake call is recorded by a
# wrapper that runs the real cmake, first on PATH), then prepares
# Fashion-MNIST, trains on two ranks and draws the curves.
#   test_demo.sh SOURCE_DIR BUILD_DIR
# The demo builds into SOURCE_DIR/build with scripts/build.sh's settings, so
# the test runs where that is the tests' build (as in CI); elsewhere it would
# reconfigure someone's build, and it says SKIPPED.
set -euo pipefail
source_dir=$(realpath "$1") build_dir=$(realpath "$2")
fail() { echo "FAIL: $*"; exit 1; }
if [[ $build_dir != "$source_dir/build" ]] || ! grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$build_dir/CMakeCache.txt"; then
  echo "SKIPPED: the demo builds into $source_dir/build (Release, scripts/build.sh); the tests' build is $build_dir"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
real_cmake=$(command -v cmake)
cat >"$work/cmake" <<WRAPPER
#!/bin/sh
printf '%s\n' "\$*" >>"$work/cmake-calls"
exec "$real_cmake" "\$@"
WRAPPER
chmod +x "$work/cmake"
start=$(date +%s)
if ! PATH="$work:$PATH" bash "$source_dir/scripts/demo.sh" >"$work/demo.log" 2>&1; then
  cat "$work/demo.log"
  fail "scripts/demo.sh exited non-zero"
fi
cat "$work/cmake-calls"
builds=$(grep -c -- '--build' "$work/cmake-calls" || true)
[[ $builds == 1 ]] || fail "the demo ran cmake --build $builds times"
grep -- '--build' "$work/cmake-calls" | grep -q -- '--target tessera_cli$' ||
  fail "the demo's build is not of the tessera program alone: $(grep -- '--build' "$work/cmake-calls")"
grep -q 'demo: metrics in runs/demo/metrics.jsonl' "$work/demo.log" || { cat "$work/demo.log"; fail "no final line"; }
curves=$source_dir/runs/demo/curves.svg
[[ -s $curves && $(stat -c %Y "$curves") -ge $start ]] || fail "$curves was not drawn by this run"
echo "PASS: the demo built only tessera_cli and drew $curves"
