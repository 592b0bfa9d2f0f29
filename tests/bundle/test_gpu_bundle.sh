#!/usr/bin/env bash
# The GPU bundle (scripts/gpu-bundle.sh) proven where the system cannot help
# it: packs BUILD_DIR, prints the compressed size (and fails above 60 MiB),
# unpacks it, and in a private mount namespace (unshare) hides every library
# the bundle carries from the system (an empty file bind-mounted over each
# one's real path, found through the loader's cache) and the folders of Open
# MPI, PMIx, HDF5, OpenBLAS and hwloc, as on a bare GPU machine. There:
#   - the build's own `tessera` no longer starts (the hiding works);
#   - env.sh prepares the shell; the bundle's `tessera --version` runs;
#   - the CPU tests of the packed test binaries pass (GPU tests filtered out),
#     the MPI ones under the bundle's own mpirun with 2 ranks;
#   - a one-rank CPU training run (mpirun -np 1, and a plain start) trains;
#   - the GPU suite's rehearsal (run-gpu-suite.sh --device emu --quick) passes;
#   - with the bundle's copy of HDF5 hidden too, its `tessera` fails to start:
#     the bundle's copies, not some other, were the ones loaded.
# Label `gpu-bundle`; needs root (mount namespaces), patchelf and xz
# (scripts/install-deps.sh). Exit 77 is a skip (no unshare); with CI=true it
# fails instead.
#
#   tests/bundle/test_gpu_bundle.sh BUILD_DIR
set -euo pipefail

build=$(cd "${1:?usage: test_gpu_bundle.sh BUILD_DIR}" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
fail() { echo "test_gpu_bundle: FAILED: $*" >&2; exit 1; }
skip() {
  if [[ ${CI:-} == true ]]; then fail "$* (CI=true: not skipped)"; fi
  echo "test_gpu_bundle: skipped: $*"; exit 77
}
[[ $(id -u) == 0 ]] || skip "needs root for a mount namespace"
unshare --mount true 2>/dev/null || skip "unshare --mount is not permitted here"

work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-bundle-test.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- pack and unpack --------------------------------------------------------
start=$(date +%s)
"$repo/scripts/gpu-bundle.sh" --build "$build" -o "$work/tessera-gpu.tar.xz" 2>"$work/pack.log" |
  tee "$work/pack.out" || { cat "$work/pack.log" >&2; fail "scripts/gpu-bundle.sh failed"; }
bytes=$(stat -c %s "$work/tessera-gpu.tar.xz")
echo "gpu_bundle_compressed_bytes=$bytes"
echo "gpu_bundle_compressed_mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')"
echo "gpu_bundle_pack_seconds=$(($(date +%s) - start))"
((bytes < 60 * 1048576)) || fail "the bundle is $bytes bytes, over 60 MiB"
tar -C "$work" -xf "$work/tessera-gpu.tar.xz"
bundle=$work/tessera-gpu
[[ -x $bundle/bin/tessera && -f $bundle/env.sh ]] || fail "the archive holds no tessera-gpu/bin/tessera or env.sh"

# --- what to hide -----------------------------------------------------------
# Each library of the bundle (lib/, its Open MPI, PMIx and hwloc plugins'
# dependencies included; not lib/fallback/, the C++ runtime the target
# normally has) at the path the system would load it from, but those the
# base system's tools need.
hide_files=()
while read -r so; do
  while read -r path; do
    [[ -n $path ]] && hide_files+=("$(readlink -f "$path")")
  done < <(ldconfig -p | awk -v s="$so" '$1 == s {print $NF}')
done < <(find "$bundle/lib" -maxdepth 1 -name '*.so*' -printf '%f\n' | sort -u)
((${#hide_files[@]} > 10)) || fail "found only ${#hide_files[@]} system copies of the bundle's libraries to hide"
# Not hidden: what the base system's own tools load (libpcre2-8 for grep, sed
# and mount): every target machine has those, and the test needs the tools.
base_libraries=$(for tool in bash grep sed mount tar; do ldd "$(command -v "$tool")"; done |
  awk '$3 ~ /^\// {print $3}' | xargs -r readlink -f | sort -u)
mapfile -t hide_files < <(printf '%s\n' "${hide_files[@]}" | grep -vxF -f <(printf '%s\n' "$base_libraries"))
# The system's Open MPI (programs, plugins, help files), PMIx, HDF5, OpenBLAS and hwloc folders.
hide_dirs=()
for dir in /usr/lib/x86_64-linux-gnu/{openmpi,pmix2,hdf5,openblas-openmp,openblas-pthread,openblas-serial,hwloc} \
  /usr/share/openmpi /usr/share/pmix /etc/openmpi; do
  [[ -d $dir ]] && hide_dirs+=("$(readlink -f "$dir")")
done
for program in mpirun orted ompi_info; do
  path=$(command -v "$program" 2>/dev/null) && hide_files+=("$(readlink -f "$path")")
done
printf '%s\n' "${hide_files[@]}" | sort -u >"$work/hide-files.txt"
printf '%s\n' "${hide_dirs[@]}" >"$work/hide-dirs.txt"
echo "hiding $(wc -l <"$work/hide-files.txt") files and $(wc -l <"$work/hide-dirs.txt") folders of the system"

# --- inside the namespace ---------------------------------------------------
cat >"$work/inside.sh" <<'INSIDE'
set -euo pipefail
work=$1 bundle=$2 build=$3
fail() { echo "test_gpu_bundle: FAILED: $*" >&2; exit 1; }
: >"$work/empty"
mkdir -p "$work/empty-dir"
while read -r f; do mount --bind "$work/empty" "$f"; done <"$work/hide-files.txt"
while read -r d; do mount --bind "$work/empty-dir" "$d"; done <"$work/hide-dirs.txt"

# The hiding works: the build's own program cannot start.
if "$build/bin/tessera" --version >"$work/control.log" 2>&1; then
  fail "the build's tessera still starts with the system's libraries hidden"
fi
echo "control: $build/bin/tessera no longer starts: $(head -1 "$work/control.log")"

cd "$work"
# shellcheck disable=SC1091
source "$bundle/env.sh" || fail "env.sh found problems ($TESSERA_BUNDLE_PROBLEMS)"
[[ $(command -v tessera) == "$bundle/bin/tessera" ]] || fail "tessera on PATH is $(command -v tessera)"
[[ $(command -v mpirun) == "$bundle/bin/mpirun" ]] || fail "mpirun on PATH is $(command -v mpirun)"
tessera --version
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# A bare GPU machine has none of the Python tools install-deps.sh puts under
# /opt/tessera-tools (transformers, over the system's libraries hidden here):
# the tests that run them skip, as they do there.
export TESSERA_TOOLS_DIR=$work/no-tools

# The CPU tests of the packed binaries (GPU and CUDA tests need a GPU).
no_gpu='-*Gpu*:*Cuda*:*Nccl*'
for t in tessera_core_tests tessera_kernel_tests tessera_infra_tests; do
  echo "== $t"
  "$bundle/bin/$t" --gtest_filter="$no_gpu" --gtest_brief=1 >"$work/$t.log" 2>&1 ||
    { tail -40 "$work/$t.log" >&2; fail "$t failed inside the namespace"; }
  tail -1 "$work/$t.log"
done
echo "== tessera_mpi_tests under the bundle's mpirun, 2 ranks"
mpirun -np 2 --oversubscribe "$bundle/bin/tessera_mpi_tests" --gtest_filter="$no_gpu" --gtest_brief=1 \
  >"$work/mpi.log" 2>&1 || { tail -40 "$work/mpi.log" >&2; fail "tessera_mpi_tests failed under the bundle's mpirun"; }
grep -E 'PASSED|tests? ran' "$work/mpi.log" | tail -2 || tail -3 "$work/mpi.log"

# One-rank CPU training: under the bundle's mpirun, and started plainly.
train=(train --model gpt --synthetic --vocab-size 64 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32
       --micro-batch-size 4 --train-steps 3 --log-interval 1 --device cpu --save "$work/run" --save-interval 3)
mpirun -np 1 tessera "${train[@]}" >"$work/train.log" 2>&1 ||
  { cat "$work/train.log" >&2; fail "one-rank training under the bundle's mpirun failed"; }
grep -q '^done: 3 steps' "$work/train.log" || { cat "$work/train.log" >&2; fail "the training run did not finish"; }
tessera checkpoint inspect "$work/run/step_00000003" >/dev/null || fail "the run's checkpoint does not verify"
tessera "${train[@]}" --save "$work/run-plain" >"$work/train-plain.log" 2>&1 ||
  { cat "$work/train-plain.log" >&2; fail "one-rank training started plainly failed"; }
echo "training: $(grep '^done:' "$work/train.log")"

# The GPU suite's rehearsal: every part that does not need CUDA itself, with
# the emulated device standing in for cuda:0 (scripts/gpu-suite.sh).
"$bundle/run-gpu-suite.sh" --device emu --quick --out "$work/suite" >"$work/suite.log" 2>&1 ||
  { tail -60 "$work/suite.log" >&2; fail "run-gpu-suite.sh --device emu --quick failed"; }
sed -n '/^Tessera GPU suite:/,$p' "$work/suite.log"

# The bundle's own copy was the one loaded: hidden too, nothing else is found.
mount --bind "$work/empty" "$bundle/lib/libhdf5_serial.so.103"
if tessera --version >"$work/control2.log" 2>&1; then
  fail "tessera still starts with the bundle's HDF5 hidden as well"
fi
echo "control: with the bundle's HDF5 hidden too: $(head -1 "$work/control2.log")"
INSIDE

unshare --mount --propagation private bash "$work/inside.sh" "$work" "$bundle" "$build" ||
  fail "the bundle did not run with the system's libraries hidden"
echo "test_gpu_bundle: passed"
