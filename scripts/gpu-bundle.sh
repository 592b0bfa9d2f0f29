#!/usr/bin/env bash
# Packs what the GPU suite and `tessera train --device cuda` need into one
# relocatable archive for a bare GPU machine: one that has the NVIDIA driver
# and the CUDA runtime, cuBLAS/cuBLASLt, cuDNN and NCCL (system CUDA or the
# nvidia-* Python wheels that PyTorch installs) but none of our other
# dependencies. In it: bin/tessera, libtessera, the test binaries with GPU
# tests, the benchmarks; every other shared library they load, found with ldd
# (Open MPI with its plugins, mpirun and orted, help files and settings; PMIx
# and hwloc plugins; HDF5, OpenBLAS, oneDNN, libgfortran, libgomp, ...; never
# glibc, never the CUDA libraries, which come from the target); RUNPATHs
# rewritten to $ORIGIN-relative ones (patchelf); env.sh (finds the target's
# CUDA libraries, points Open MPI and PMIx inside the bundle, checks the
# processor and glibc); the GPU suite's runner (scripts/gpu-suite.sh);
# Fashion-MNIST's t10k files and the fortunes text for its training runs; a
# manifest. Compressed with xz; its size is printed.
#
#   scripts/gpu-bundle.sh                    configure and build a portable release build into build-bundle/
#                                            (TESSERA_NATIVE=OFF, CUDA ON, sm_80 and sm_90), then pack it
#   scripts/gpu-bundle.sh --build DIR        pack an existing build (the `gpu-bundle` test packs build/)
#   scripts/gpu-bundle.sh -o FILE            where to write it (default: <build dir>/tessera-gpu.tar.xz)
#   scripts/gpu-bundle.sh --leave-out SONAME leave one library out (to show that the bundle test catches it)
#
# On the target: tar xf tessera-gpu.tar.xz && tessera-gpu/run-gpu-suite.sh
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
build_dir=""
out=""
leave_out=()
usage() { sed -n '/^#   scripts\/gpu-bundle.sh/,/^# On the target/p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --build) build_dir=${2:?--build needs a directory}; shift 2 ;;
    -o|--output) out=${2:?-o needs a file name}; shift 2 ;;
    --leave-out) leave_out+=("${2:?--leave-out needs a library soname}"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-bundle.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

say() { echo "gpu-bundle: $*" >&2; }
die() { echo "gpu-bundle: error: $*" >&2; exit 1; }

for tool in patchelf ldd xz tar readelf sha256sum; do
  command -v "$tool" >/dev/null || die "$tool not found (scripts/install-deps.sh installs patchelf)"
done

# ---------------------------------------------------------------------------
# The build: an existing one (--build), or a portable release build.
# ---------------------------------------------------------------------------
if [[ -z $build_dir ]]; then
  build_dir=$repo/build-bundle
  say "configuring a portable release build in $build_dir (TESSERA_NATIVE=OFF, CUDA ON, architectures 80;90)"
  cmake -S "$repo" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_WERROR=ON \
    -DTESSERA_NATIVE=OFF -DTESSERA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="80;90" >"$build_dir.configure.log" 2>&1 || {
    cat "$build_dir.configure.log" >&2; die "configure failed"; }
  say "building (about 20 minutes on 2 cores)"
  cmake --build "$build_dir" --parallel "$(nproc)"
fi
build_dir=$(cd "$build_dir" && pwd)
[[ -x $build_dir/bin/tessera ]] || die "$build_dir/bin/tessera not found: build first, or name the build with --build"
[[ -n $out ]] || out=$build_dir/tessera-gpu.tar.xz
out_dir=$(cd "$(dirname "$out")" && pwd) || die "the folder of $out does not exist"
out=$out_dir/$(basename "$out")

cache_value() { [[ ! -f $build_dir/CMakeCache.txt ]] || sed -n "s/^$1:[A-Z]*=//p" "$build_dir/CMakeCache.txt" | head -1; }
native=$(cache_value TESSERA_NATIVE)
portable_arch=$(cache_value TESSERA_PORTABLE_ARCH)
cxx=$(cache_value CMAKE_CXX_COMPILER)
cuda_archs=$(cache_value CMAKE_CUDA_ARCHITECTURES)
[[ -n $cxx ]] || cxx=c++

work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-gpu-bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT
stage=$work/tessera-gpu
mkdir -p "$stage"/{bin/benchmarks,lib/fallback,lib/openmpi,lib/pmix,lib/hwloc,share/openmpi,share/pmix,etc,data}

# ---------------------------------------------------------------------------
# Classes of shared libraries, by soname.
# ---------------------------------------------------------------------------
# glibc: always the target's own (a bundled glibc cannot be mixed with the target's loader).
is_glibc() {
  [[ $1 =~ ^(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1|libanl\.so\.1|libmvec\.so\.1|libBrokenLocale\.so\.1|libthread_db\.so\.1|libnss_.*|linux-vdso\.so\.1)$ ]]
}
# The driver and the CUDA libraries: from the target (env.sh finds them).
is_cuda() {
  [[ $1 =~ ^lib(cuda|cudart|cublas|cublasLt|cudnn.*|nccl|nvrtc.*|nvJitLink|cufft.*|curand|cusparse|cusolver.*|nvToolsExt|cupti|nvidia-.*)\.so ]]
}
# The C++ and GCC runtimes: used only where the target's are older than this build needs (env.sh decides).
is_fallback() { [[ $1 =~ ^lib(stdc\+\+\.so\.6|gcc_s\.so\.1)$ ]]; }
# Network fabrics (UCX, libfabric, verbs, PSM): plugins that need them are left out; shared memory and TCP remain.
is_fabric() { [[ $1 =~ ^lib(ucp|ucs|uct|ucm|fabric|ibverbs|rdmacm|efa|psm_infinipath|psm2|infinipath)\.so ]]; }

# ldd_deps FILE: "soname<TAB>path" per dependency ("soname<TAB>" when not found).
ldd_deps() {
  env -u LD_PRELOAD ${LDD_ENV:-} ldd "$1" 2>/dev/null | awk '
    $2 == "=>" && $3 == "not" { print $1 "\t"; next }
    $2 == "=>" && $3 ~ /^\// { print $1 "\t" $3; next }'
}

# ---------------------------------------------------------------------------
# What goes in: our programs, then Open MPI, PMIx and hwloc pieces.
# ---------------------------------------------------------------------------
left_out_notes=()
# copy FILE DIR: a writable copy (patchelf rewrites it), links followed.
copy() {
  cp -L "$1" "$2/"
  chmod u+w "$2/$(basename "$1")"
}

cp -L "$build_dir/bin/tessera" "$stage/bin/"
# Test binaries that hold GPU tests (tessera_fault_tests and tessera_multiprocess_tests
# have this build's paths compiled in and hold none; the app and nn tests hold none).
test_binaries=(tessera_core_tests tessera_kernel_tests tessera_infra_tests tessera_mpi_tests)
for t in "${test_binaries[@]}"; do
  [[ -x $build_dir/bin/$t ]] || die "$build_dir/bin/$t not found (built with TESSERA_BUILD_TESTS=ON?)"
  cp -L "$build_dir/bin/$t" "$stage/bin/"
done
for b in "$build_dir"/bin/benchmarks/*; do [[ -x $b && -f $b ]] && cp -L "$b" "$stage/bin/benchmarks/"; done
[[ -x $stage/bin/benchmarks/gemm_cuda ]] || say "warning: no benchmarks/gemm_cuda in this build (built without CUDA?)"
libtessera=$(readlink -f "$build_dir/lib/libtessera.so.0")
[[ -f $libtessera ]] || die "$build_dir/lib/libtessera.so.0 not found"
cp "$libtessera" "$stage/lib/"
(cd "$stage/lib" && ln -sf "$(basename "$libtessera")" libtessera.so.0 && ln -sf libtessera.so.0 libtessera.so)
ldd_deps "$libtessera" | grep -q '^libcudart' || say "warning: this libtessera has no CUDA backend: the GPU suite will fail on the target"

# Open MPI: the one libtessera was linked with, found through its mpirun and ompi_info.
mpirun=$(command -v mpirun) || die "mpirun not found"
ompi_bindir=$(dirname "$(readlink -f "$mpirun")")
"$mpirun" --version 2>&1 | grep -q "Open MPI" || die "$mpirun is not Open MPI's"
ompi_info=$ompi_bindir/ompi_info
[[ -x $ompi_info ]] || ompi_info=$(command -v ompi_info) || die "ompi_info not found"
ompi_path() { "$ompi_info" --parsable --path "$1" | sed -n "s/^path:$1://p"; }
ompi_pkglibdir=$(ompi_path pkglibdir)
ompi_pkgdatadir=$(ompi_path pkgdatadir)
ompi_sysconfdir=$(ompi_path sysconfdir)
[[ -d $ompi_pkglibdir ]] || die "Open MPI's plugin folder '$ompi_pkglibdir' not found"
cp -L "$(readlink -f "$mpirun")" "$stage/bin/mpirun"
(cd "$stage/bin" && ln -sf mpirun mpiexec && ln -sf mpirun orterun)
for program in orted ompi_info; do
  [[ -x $ompi_bindir/$program ]] || die "$ompi_bindir/$program not found"
  cp -L "$ompi_bindir/$program" "$stage/bin/"
done
cp -rL "$ompi_pkgdatadir"/. "$stage/share/openmpi/"
cp -L "$ompi_sysconfdir/openmpi-mca-params.conf" "$stage/etc/" 2>/dev/null || : >"$stage/etc/openmpi-mca-params.conf"
for plugin in "$ompi_pkglibdir"/*.so; do
  name=$(basename "$plugin")
  # OpenSHMEM's frameworks (atomic, memheap, scoll, spml, sshmem): Tessera uses MPI only.
  if [[ $name =~ ^mca_(atomic|memheap|scoll|spml|sshmem)_ ]]; then continue; fi
  fabric=$(ldd_deps "$plugin" | cut -f1 | while read -r so; do if is_fabric "$so"; then echo "$so"; fi; done | tr '\n' ' ')
  if [[ -n $fabric ]]; then
    left_out_notes+=("Open MPI plugin $name (needs ${fabric% })")
    continue
  fi
  copy "$plugin" "$stage/lib/openmpi"
done
# Open MPI's own plugin libraries (libmca_common_*) are found through the plugins' dependencies below.

# PMIx (Open MPI 4.1 with an external PMIx, as Debian builds it): plugins and help files.
libpmix=""
if [[ -f $stage/lib/openmpi/mca_pmix_ext3x.so ]]; then
  libpmix=$(ldd_deps "$stage/lib/openmpi/mca_pmix_ext3x.so" | awk -F'\t' '$1 ~ /^libpmix\.so/ {print $2}')
fi
if [[ -n $libpmix ]]; then
  pmix_root=$(dirname "$(dirname "$(readlink -f "$libpmix")")")   # .../pmix2 on Debian
  if [[ -d $pmix_root/lib/pmix ]]; then
    for plugin in "$pmix_root"/lib/pmix/*.so; do copy "$plugin" "$stage/lib/pmix"; done
  fi
  [[ -d $pmix_root/share/pmix ]] && cp -rL "$pmix_root/share/pmix"/. "$stage/share/pmix/"
  [[ -f $pmix_root/share/pmix-mca-params.conf ]] && cp -L "$pmix_root/share/pmix-mca-params.conf" "$stage/etc/"
fi

# hwloc's PCI plugin (GPU and NIC locality); the GL, OpenCL and libxml2 ones are left out.
hwloc_lib=$(ldd_deps "$libtessera" | awk -F'\t' '$1 ~ /^libhwloc\.so/ {print $2}')
if [[ -n $hwloc_lib && -f $(dirname "$(readlink -f "$hwloc_lib")")/hwloc/hwloc_pci.so ]]; then
  copy "$(dirname "$(readlink -f "$hwloc_lib")")/hwloc/hwloc_pci.so" "$stage/lib/hwloc"
fi

# ---------------------------------------------------------------------------
# Every shared library those need, except glibc and CUDA.
# ---------------------------------------------------------------------------
is_elf() { [[ -f $1 && ! -L $1 ]] && [[ $(head -c 4 "$1" | od -An -c | tr -d ' ') == 177ELF ]]; }
elf_files() {
  local f
  for f in "$stage"/bin/* "$stage"/bin/benchmarks/* "$stage"/lib/*.so* "$stage"/lib/fallback/* \
           "$stage"/lib/openmpi/*.so "$stage"/lib/pmix/*.so "$stage"/lib/hwloc/*.so; do
    if is_elf "$f"; then echo "$f"; fi
  done
}
declare -A bundled=() from_target=()
missing=()
while read -r f; do
  while IFS=$'\t' read -r so path; do
    if is_glibc "$so"; then continue; fi
    if is_cuda "$so"; then from_target[$so]=1; continue; fi
    [[ -n ${bundled[$so]:-} ]] && continue
    [[ $so == libtessera.so.0 ]] && continue
    if [[ -z $path ]]; then missing+=("$so (needed by ${f#"$stage"/})"); continue; fi
    bundled[$so]=$path
  done < <(ldd_deps "$f")
done < <(elf_files)
((${#missing[@]} == 0)) || die "libraries not found on this machine: ${missing[*]}"
for so in "${!bundled[@]}"; do
  skip=0
  for l in "${leave_out[@]}"; do if [[ $so == "$l" ]]; then skip=1; fi; done
  if ((skip)); then say "leaving out $so (--leave-out)"; continue; fi
  if is_fallback "$so"; then dest=$stage/lib/fallback; else dest=$stage/lib; fi
  cp -L "${bundled[$so]}" "$dest/$so"
  chmod u+w "$dest/$so"
done
for l in "${leave_out[@]}"; do [[ -n ${bundled[$l]:-} ]] || die "--leave-out $l: no bundled library has that soname"; done

# ---------------------------------------------------------------------------
# RUNPATHs: each file finds the bundle's libraries relative to itself.
# Our own programs lose their symbols (not their dynamic ones): backtraces
# name functions through the dynamic symbol table only, and the archive shrinks.
# ---------------------------------------------------------------------------
while read -r f; do
  case ${f#"$stage"/} in
    bin/benchmarks/*) rpath='$ORIGIN/../../lib' ;;
    bin/*) rpath='$ORIGIN/../lib' ;;
    lib/fallback/*) continue ;;   # the C++/GCC runtimes need glibc only
    lib/openmpi/*|lib/pmix/*|lib/hwloc/*) rpath='$ORIGIN/..' ;;
    lib/*) rpath='$ORIGIN' ;;
  esac
  case ${f#"$stage"/} in
    bin/tessera*|bin/benchmarks/*|lib/libtessera.so*) strip --strip-unneeded "$f" ;;
  esac
  patchelf --set-rpath "$rpath" "$f"
done < <(elf_files)

# Check: with no LD_LIBRARY_PATH, every dependency of every file resolves
# inside the bundle, or is glibc, CUDA or the C++/GCC runtime.
bad=()
while read -r f; do
  while IFS=$'\t' read -r so path; do
    if is_glibc "$so" || is_cuda "$so"; then continue; fi
    if is_fallback "$so" && [[ ! -f $stage/lib/fallback/$so ]]; then bad+=("${f#"$stage"/}: $so missing from lib/fallback"); continue; fi
    if is_fallback "$so"; then continue; fi   # the system's here; env.sh chooses on the target
    [[ $path == "$stage"/* ]] || bad+=("${f#"$stage"/}: $so -> ${path:-not found}")
  done < <(LDD_ENV=-uLD_LIBRARY_PATH ldd_deps "$f")
done < <(elf_files)
if ((${#bad[@]})); then
  if ((${#leave_out[@]})); then
    say "as asked (--leave-out), these dependencies now resolve outside the bundle: ${bad[*]}"
  else
    die "dependencies that resolve outside the bundle after patching: ${bad[*]}"
  fi
fi

# ---------------------------------------------------------------------------
# What the target must provide: glibc version, CUDA libraries, processor.
# ---------------------------------------------------------------------------
max_version() { sort -t. -k1,1n -k2,2n -k3,3n | tail -1; }
# version_needs PREFIX: the versions of PREFIX_x.y tags (GLIBC, GLIBCXX, ...) in the files read from stdin.
version_needs() {
  local f
  while read -r f; do
    readelf -V --wide "$f" 2>/dev/null | grep -o "Name: $1_[0-9.]*" | sed "s/Name: $1_//" || true
  done | max_version
}
glibc_min=$(elf_files | version_needs GLIBC)
# (the fallback folder's own files define these tags; what the rest needs counts)
glibcxx_min=$(elf_files | grep -v /lib/fallback/ | version_needs GLIBCXX)
cxxabi_min=$(elf_files | grep -v /lib/fallback/ | version_needs CXXABI)
gcc_s_min=$(elf_files | grep -v /lib/fallback/ | version_needs GCC)
{
  echo "# Version tags the bundled programs need from libstdc++.so.6 and libgcc_s.so.1;"
  echo "# env.sh uses lib/fallback/ (this build's own copies) when the target's lack one."
  echo "libstdc++.so.6 GLIBCXX_${glibcxx_min} CXXABI_${cxxabi_min}"
  echo "libgcc_s.so.1 GCC_${gcc_s_min}"
} >"$stage/lib/fallback/REQUIRES"
printf '%s\n' "${!from_target[@]}" | sort >"$stage/cuda-libraries.txt"
echo "$glibc_min" >"$stage/glibc-min.txt"

# The processor: the instruction-set extensions the host code may use, as
# /proc/cpuinfo names them (checked by env.sh). From the compiler itself:
# what -march=<baseline> (or -march=native) enables.
if [[ $native == ON ]]; then march=native; else march=${portable_arch}; fi
isa_map="sse3:pni ssse3:ssse3 sse4.1:sse4_1 sse4.2:sse4_2 popcnt:popcnt cx16:cx16 sahf:lahf_lm avx:avx avx2:avx2
fma:fma f16c:f16c bmi:bmi1 bmi2:bmi2 lzcnt:abm abm:abm movbe:movbe xsave:xsave avx512f:avx512f avx512bw:avx512bw
avx512cd:avx512cd avx512dq:avx512dq avx512vl:avx512vl avx512ifma:avx512ifma avx512vbmi:avx512vbmi
avx512vbmi2:avx512_vbmi2 avx512vnni:avx512_vnni avx512bitalg:avx512_bitalg avx512vpopcntdq:avx512_vpopcntdq
avx512bf16:avx512_bf16 avx512fp16:avx512_fp16 avxvnni:avx_vnni amx-tile:amx_tile amx-bf16:amx_bf16 amx-int8:amx_int8
gfni:gfni vaes:vaes vpclmulqdq:vpclmulqdq pclmul:pclmulqdq aes:aes sha:sha_ni adx:adx rdrnd:rdrand rdseed:rdseed
movdiri:movdiri movdir64b:movdir64b serialize:serialize clflushopt:clflushopt clwb:clwb fsgsbase:fsgsbase
xsavec:xsavec xsaveopt:xsaveopt xsaves:xsaves rdpid:rdpid prfchw:3dnowprefetch"
cpu_flags=""
if [[ -n $march ]]; then
  enabled=$("$cxx" -march="$march" -Q --help=target 2>/dev/null | awk '$NF == "[enabled]" {sub(/^-m/, "", $1); print $1}') ||
    die "$cxx -march=$march -Q --help=target failed"
  for pair in $isa_map; do
    if grep -qxF "${pair%%:*}" <<<"$enabled"; then cpu_flags+=" ${pair#*:}"; fi
  done
fi
cpu_flags=$(tr ' ' '\n' <<<"$cpu_flags" | sed '/^$/d' | sort -u | tr '\n' ' ')
{
  if [[ $march == native ]]; then
    echo "native: -march=native on $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
  else
    echo "${march:-compiler default}: -march=${march:-<none>} -mtune=generic"
  fi
  echo "${cpu_flags% }"
} >"$stage/cpu-baseline.txt"

# ---------------------------------------------------------------------------
# Runner, environment, data, manifest.
# ---------------------------------------------------------------------------
cp "$repo/scripts/gpu-suite.sh" "$stage/run-gpu-suite.sh"
cp "$repo/scripts/gpu-bundle-env.sh" "$stage/env.sh"
chmod +x "$stage/run-gpu-suite.sh"
fm=/usr/share/datasets/fashion-mnist
if [[ -f $fm/t10k-images-idx3-ubyte.gz ]]; then
  mkdir -p "$stage/data/fashion-mnist"
  cp "$fm"/t10k-images-idx3-ubyte.gz "$fm"/t10k-labels-idx1-ubyte.gz "$stage/data/fashion-mnist/"
else
  say "warning: $fm not found (Debian's dataset-fashion-mnist): the suite's MLP and CNN runs will use --synthetic data"
fi
fortunes=/usr/share/games/fortunes
if [[ -d $fortunes ]]; then
  mkdir -p "$stage/data/fortunes"
  find "$fortunes" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp -L {} "$stage/data/fortunes/" \;
else
  say "warning: $fortunes not found (Debian's fortunes): the suite's GPT runs will use --synthetic data"
fi

version_text=$("$stage/bin/tessera" --version 2>&1 || true)
{
  echo "Tessera GPU bundle"
  echo "packed: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n) ($(. /etc/os-release && echo "$PRETTY_NAME"))"
  echo "source: $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "build: $build_dir ($(cache_value CMAKE_BUILD_TYPE); TESSERA_NATIVE=$native; TESSERA_PORTABLE_ARCH=$portable_arch; CUDA architectures ${cuda_archs:-none})"
  echo "host processor: $(head -1 "$stage/cpu-baseline.txt"); needs: $(tail -1 "$stage/cpu-baseline.txt")"
  echo "needs glibc >= $glibc_min (the target's own; never bundled)"
  echo "libstdc++/libgcc_s: the target's when they provide GLIBCXX_$glibcxx_min, CXXABI_$cxxabi_min and GCC_$gcc_s_min, else lib/fallback/"
  echo "from the target (env.sh finds them): $(tr '\n' ' ' <"$stage/cuda-libraries.txt")and the driver's libcuda.so.1"
  echo
  echo "tessera --version here:"
  sed 's/^/  /' <<<"$version_text"
  echo
  echo "left out:"
  echo "  tessera_fault_tests, tessera_multiprocess_tests, tessera_app_tests, tessera_nn_tests (no GPU tests; the first two have build paths compiled in)"
  echo "  Open MPI's OpenSHMEM plugins; hwloc's GL, OpenCL and libxml2 plugins"
  for note in "${left_out_notes[@]}"; do echo "  $note"; done
  for l in "${leave_out[@]}"; do echo "  $l (--leave-out: this bundle is broken on purpose)"; done
  echo
  echo "files:"
  (cd "$work" && find tessera-gpu -type f -printf '  %10s  %p\n' | sort -k2)
} >"$stage/MANIFEST.txt"
(cd "$stage" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum >SHA256SUMS)

say "compressing $(du -sh "$stage" | cut -f1) (xz)"
tar -C "$work" --owner=0 --group=0 --numeric-owner -cf - tessera-gpu | xz -T"$(nproc)" -6 >"$out.partial"
mv "$out.partial" "$out"
bytes=$(stat -c %s "$out")
echo "gpu-bundle: wrote $out: $bytes bytes ($(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}') MiB compressed," \
  "$(du -s --apparent-size -m "$stage" | cut -f1) MiB unpacked); minimum glibc $glibc_min; host code $(head -1 "$stage/cpu-baseline.txt" | cut -d: -f1)"
