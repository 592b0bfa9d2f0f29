# shellcheck shell=bash
# env.sh of the Tessera GPU bundle (scripts/gpu-bundle.sh copies this file
# into it): `source tessera-gpu/env.sh` prepares a shell to run the bundle's
# programs on this machine, and says what it found.
#   - PATH: the bundle's bin/ (tessera, mpirun, orted, the test binaries).
#   - Open MPI and PMIx look for their plugins, help files and settings inside
#     the bundle (OPAL_*, PMIX_*), hwloc for its PCI plugin (HWLOC_PLUGINS_PATH).
#     The bundle's own libraries need no LD_LIBRARY_PATH: every file's RUNPATH
#     points into the bundle ($ORIGIN-relative).
#   - LD_LIBRARY_PATH: the folders of this machine's CUDA libraries (those in
#     cuda-libraries.txt, plus NVRTC and nvJitLink, which cuDNN loads for some
#     engines, when present). Each is looked for, first match wins, in
#       1. TESSERA_CUDA_LIBRARY_PATH (folders separated by ':'), if set;
#       2. the CUDA toolkit: $CUDA_HOME/lib64, /usr/local/cuda/lib64, /usr/local/cuda/targets/x86_64-linux/lib, /usr/local/cuda/lib;
#       3. the nvidia-* wheels PyTorch installs: <site-packages>/nvidia/*/lib of
#          TESSERA_PYTHON, /opt/torch/.venv/bin/python3 and python3 on PATH;
#       4. the loader's cache (ldconfig -p) and default folders.
#     The driver's libcuda.so.1 is looked for in the loader's cache and
#     /usr/local/nvidia/lib64 (added when only there).
#   - lib/fallback/ (this build's libstdc++ and libgcc_s) joins LD_LIBRARY_PATH
#     only when this machine's are older than the bundle needs (lib/fallback/REQUIRES).
#   - Checks that glibc is new enough (glibc-min.txt) and that the processor has
#     the instruction-set extensions the host code was compiled for
#     (cpu-baseline.txt); a program of the bundle would die with SIGILL otherwise.
# Results: TESSERA_BUNDLE (this folder), TESSERA_BUNDLE_PROBLEMS (a count of
# what stops the bundle's programs from starting here: 0 when all is well),
# TESSERA_BUNDLE_CPU_MISSING (missing processor flags), TESSERA_BUNDLE_DRIVER
# (1 when libcuda.so.1 was found, else empty). TESSERA_BUNDLE_QUIET=1 prints
# problems only.
# Sourcing never exits the calling shell; it returns 1 when something is
# missing. (Sourced, so it sets no `set -euo pipefail`: it runs with errexit,
# nounset and pipefail off and gives the caller its own options back.)

_tb_main() {
  local bundle problems=0 quiet=${TESSERA_BUNDLE_QUIET:-0}
  bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  _tb_say() { [[ $quiet == 1 ]] || echo "env.sh: $*"; }
  _tb_problem() { echo "env.sh: PROBLEM: $*" >&2; problems=$((problems + 1)); }

  export TESSERA_BUNDLE=$bundle
  case ":$PATH:" in *":$bundle/bin:"*) ;; *) export PATH=$bundle/bin:$PATH ;; esac
  # Open MPI 4.1 (opal installdirs) and PMIx 4 (pinstalldirs) read these in place of their build-time paths.
  export OPAL_PREFIX=$bundle OPAL_EXEC_PREFIX=$bundle OPAL_BINDIR=$bundle/bin OPAL_LIBDIR=$bundle/lib \
    OPAL_PKGLIBDIR=$bundle/lib/openmpi OPAL_DATAROOTDIR=$bundle/share OPAL_DATADIR=$bundle/share \
    OPAL_PKGDATADIR=$bundle/share/openmpi OPAL_SYSCONFDIR=$bundle/etc
  export OMPI_MCA_mca_base_component_path=$bundle/lib/openmpi
  export PMIX_PREFIX=$bundle PMIX_EXEC_PREFIX=$bundle PMIX_BINDIR=$bundle/bin PMIX_LIBDIR=$bundle/lib \
    PMIX_PKGLIBDIR=$bundle/lib/pmix PMIX_DATAROOTDIR=$bundle/share PMIX_DATADIR=$bundle/share \
    PMIX_PKGDATADIR=$bundle/share/pmix PMIX_SYSCONFDIR=$bundle/etc
  export PMIX_MCA_mca_base_component_path=$bundle/lib/pmix
  export HWLOC_PLUGINS_PATH=$bundle/lib/hwloc

  # glibc
  local glibc_need glibc_have
  glibc_need=$(cat "$bundle/glibc-min.txt" 2>/dev/null || echo 0)
  glibc_have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  if [[ -z $glibc_have ]]; then
    _tb_problem "cannot tell this machine's glibc version (getconf GNU_LIBC_VERSION); the bundle needs glibc >= $glibc_need"
  elif [[ $(printf '%s\n%s\n' "$glibc_need" "$glibc_have" | sort -t. -k1,1n -k2,2n | head -1) != "$glibc_need" ]]; then
    _tb_problem "glibc $glibc_have here; the bundle needs >= $glibc_need: build the bundle on an older distribution"
  else
    _tb_say "glibc $glibc_have (needs >= $glibc_need)"
  fi

  # The processor.
  local baseline flags have_flags missing_flags=""
  baseline=$(head -1 "$bundle/cpu-baseline.txt" 2>/dev/null)
  flags=$(sed -n 2p "$bundle/cpu-baseline.txt" 2>/dev/null)
  have_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  local flag
  for flag in $flags; do
    [[ $have_flags == *" $flag "* ]] || missing_flags+=" $flag"
  done
  export TESSERA_BUNDLE_CPU_MISSING=${missing_flags# }
  if [[ -n $missing_flags ]]; then
    _tb_problem "this processor lacks${missing_flags} (the bundle's host code is built for ${baseline%%:*}):" \
      "its programs would die with SIGILL. Build the bundle with a lower -DTESSERA_PORTABLE_ARCH (scripts/gpu-bundle.sh)"
  else
    _tb_say "processor: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') has what ${baseline%%:*} needs"
  fi

  # The C++ and GCC runtimes: the system's when new enough, else the bundle's.
  local ldconfig="" system_cxx="" fallback=0 need
  ldconfig=$(command -v ldconfig || ls /sbin/ldconfig /usr/sbin/ldconfig 2>/dev/null | head -1 || true)
  _tb_cache() {  # _tb_cache SONAME: its path in the loader's cache
    [[ -n $ldconfig ]] && "$ldconfig" -p 2>/dev/null | awk -v s="$1" '$1 == s && /x86-64/ {print $NF; exit}'
  }
  system_cxx=$(_tb_cache libstdc++.so.6)
  for d in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib64 /lib64; do
    [[ -z $system_cxx && -e $d/libstdc++.so.6 ]] && system_cxx=$d/libstdc++.so.6
  done
  if [[ -z $system_cxx ]]; then
    fallback=1
  else
    for need in $(awk '$1 == "libstdc++.so.6" {$1 = ""; print}' "$bundle/lib/fallback/REQUIRES" 2>/dev/null); do
      grep -qaF "$need" "$system_cxx" 2>/dev/null || fallback=1
    done
    local system_gcc_s
    system_gcc_s=$(_tb_cache libgcc_s.so.1)
    for need in $(awk '$1 == "libgcc_s.so.1" {$1 = ""; print}' "$bundle/lib/fallback/REQUIRES" 2>/dev/null); do
      [[ -n $system_gcc_s ]] && grep -qaF "$need" "$system_gcc_s" 2>/dev/null || fallback=1
    done
  fi
  local ld_dirs=()
  if ((fallback)); then
    ld_dirs+=("$bundle/lib/fallback")
    _tb_say "libstdc++/libgcc_s: the bundle's (${system_cxx:-none here} lacks $(awk '$1 == "libstdc++.so.6" {$1 = ""; print}' "$bundle/lib/fallback/REQUIRES"))"
  else
    _tb_say "libstdc++/libgcc_s: this machine's ($system_cxx)"
  fi

  # CUDA libraries.
  local candidates=() dir py sp
  if [[ -n ${TESSERA_CUDA_LIBRARY_PATH:-} ]]; then
    IFS=: read -r -a candidates <<<"$TESSERA_CUDA_LIBRARY_PATH"
  fi
  [[ -n ${CUDA_HOME:-} ]] && candidates+=("$CUDA_HOME/lib64" "$CUDA_HOME/lib")
  candidates+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib)
  local pythons=() seen_py=" "
  [[ -n ${TESSERA_PYTHON:-} ]] && pythons+=("$TESSERA_PYTHON")
  pythons+=(/opt/torch/.venv/bin/python3)
  py=$(command -v python3 2>/dev/null) && pythons+=("$py")
  for py in "${pythons[@]}"; do
    [[ -x $py && $seen_py != *" $py "* ]] || continue
    seen_py+="$py "
    # The wheels' folders, asked of the interpreter itself (before LD_LIBRARY_PATH changes).
    while read -r sp; do
      for dir in "$sp"/nvidia/*/lib; do [[ -d $dir ]] && candidates+=("$dir"); done
    done < <(timeout 30 env -u LD_LIBRARY_PATH "$py" -c \
      'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  done
  for dir in /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib; do [[ -d $dir ]] && candidates+=("$dir"); done

  local so found where sonames=() optional=(libnvrtc.so.13 libnvJitLink.so.13)
  mapfile -t sonames <"$bundle/cuda-libraries.txt"
  for so in "${sonames[@]}" "${optional[@]}"; do
    [[ -n $so && $so != libcuda.so.1 ]] || continue
    found=""
    for dir in "${candidates[@]}"; do
      if [[ -e $dir/$so ]]; then found=$dir/$so; break; fi
    done
    if [[ -n $found ]]; then
      where=$(dirname "$found")
      case " ${ld_dirs[*]} " in *" $where "*) ;; *) ld_dirs+=("$where") ;; esac
      _tb_say "$so: $(readlink -f "$found")"
    elif found=$(_tb_cache "$so") && [[ -n $found ]]; then
      _tb_say "$so: $(readlink -f "$found") (the loader's cache)"
    elif [[ " ${optional[*]} " == *" $so "* ]]; then
      _tb_say "$so: not found (optional: cuDNN's runtime-compiled engines need it)"
    else
      _tb_problem "$so not found: install the CUDA toolkit, cuDNN and NCCL, or PyTorch's nvidia-* wheels," \
        "or name its folder in TESSERA_CUDA_LIBRARY_PATH"
    fi
  done
  # The driver.
  found=$(_tb_cache libcuda.so.1)
  if [[ -z $found && -e /usr/local/nvidia/lib64/libcuda.so.1 ]]; then
    found=/usr/local/nvidia/lib64/libcuda.so.1
    ld_dirs+=(/usr/local/nvidia/lib64)
  fi
  if [[ -n $found ]]; then
    _tb_say "libcuda.so.1 (driver): $(readlink -f "$found")$(awk '/NVRM version/ {
      for (i = 1; i <= NF; ++i) if ($i ~ /^[0-9]+[.][0-9.]+$/) { print ", kernel module " $i; exit } }' \
      /proc/driver/nvidia/version 2>/dev/null)"
  else
    # Not a problem for the bundle's programs, which start without it (and find no GPU).
    _tb_say "libcuda.so.1 (the NVIDIA driver) not found: no GPU can be used here"
  fi
  export TESSERA_BUNDLE_DRIVER=${found:+1}

  if ((${#ld_dirs[@]})); then
    local joined
    joined=$(IFS=:; echo "${ld_dirs[*]}")
    export LD_LIBRARY_PATH=$joined${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  _tb_say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  export TESSERA_BUNDLE_PROBLEMS=$problems
  unset -f _tb_say _tb_problem _tb_cache
  ((problems == 0))
}
_tb_options=$(set +o)   # (a command substitution reports errexit off: $- says whether it is on)
[[ $- == *e* ]] && _tb_options+=$'\nset -o errexit'
set +o errexit +o nounset +o pipefail
_tb_main
_tb_status=$?
eval "$_tb_options"
unset -f _tb_main
unset _tb_options
# shellcheck disable=SC2317  # return when sourced, exit when run
return $_tb_status 2>/dev/null || exit $_tb_status
