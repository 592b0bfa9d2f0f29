#!/usr/bin/env bash
# Installs every system package Tessera needs, from Debian's archive, quietly
# and idempotently: when everything is present it changes nothing and prints
# nothing. The CUDA toolkit is not a Debian package here; when nvcc is absent
# the build is CPU-only (TESSERA_CUDA=AUTO).
#
#   scripts/install-deps.sh                     build and test dependencies
#   scripts/install-deps.sh --with-benchmarks   also a current PyTorch for side-by-side benchmarks (PyPI's, in
#                                               /opt/tessera-tools/torch: install-torch.sh; Debian's is a default)
set -euo pipefail

packages=(
  g++ cmake ninja-build pkg-config
  libopenmpi-dev openmpi-bin          # MPI ranks
  slurm-wlm munge libpmix-dev         # the `slurm` tests: a real single-host Slurm cluster (srun --mpi=pmix)
  util-linux                          # taskset: CPU binding in scripts/tessera-rank
  libhdf5-dev                         # datasets and checkpoints
  python3-h5py hdf5-tools             # the checkpoint tests: h5py and h5dump read sharded checkpoints' tensors whole
  libcli11-dev                        # the command line
  libtomlplusplus-dev                 # the --config TOML files of `tessera train`
  nlohmann-json3-dev                  # JSON: safetensors headers and config.json of `tessera export`
  libpcre2-dev                        # Unicode regular expressions: the BPE tokenizer's pre-tokenization (io/tokenizer.h)
  libcpp-httplib-dev                  # HTTP: the /metrics endpoint and Pushgateway pushes (io/prometheus.h)
  prometheus prometheus-pushgateway   # the observability tests: a real server scrapes /metrics, a real gateway takes pushes
  libopenblas-openmp-dev              # f32 GEMM, sharing OpenMP with our kernels
  libdnnl-dev ocl-icd-opencl-dev      # oneDNN: bf16 GEMM (AMX), convolutions
  libgtest-dev                        # tests
  clang libclang-rt-dev libomp-dev    # the `fuzz` tests: clang, its libFuzzer/ASan/UBSan runtimes, its OpenMP
  dataset-fashion-mnist               # real-data test and demo (IDX files in /usr/share/datasets/fashion-mnist)
  fortunes                            # a text corpus for byte-level token preparation (/usr/share/games/fortunes)
  python3-yaml python3-jsonschema python3-venv  # the `k8s` tests: manifest validation; venv for k8s/install-tools.sh
  python3-torch                       # the Hugging Face tests: torch 1.13 under transformers (scripts/install-hf.sh; ~540 MB)
  patchelf xz-utils                   # the GPU bundle (scripts/gpu-bundle.sh): $ORIGIN RUNPATHs, compression
)
with_benchmarks=0
for arg in "$@"; do
  case "$arg" in
    --with-benchmarks) packages+=(python3 python3-numpy); with_benchmarks=1 ;;
    *) echo "install-deps.sh: unknown option '$arg' (use --with-benchmarks)" >&2; exit 2 ;;
  esac
done

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ $status == "install ok installed" ]] || missing+=("$pkg")
done
# Steps after the Debian packages, run also when none was missing:
# kubectl (kustomize), hadolint and an unpacked sshd into /opt/tessera-tools (k8s/install-tools.sh);
# an MLflow tracking server for the tracking tests into /opt/tessera-tools/mlflow (scripts/install-mlflow.sh);
# transformers over python3-torch for the Hugging Face tests into /opt/tessera-tools/hf (scripts/install-hf.sh);
# with --with-benchmarks, PyPI's PyTorch into /opt/tessera-tools/torch (scripts/install-torch.sh).
after_packages() {
  "$(dirname "$0")/../k8s/install-tools.sh"
  "$(dirname "$0")/install-mlflow.sh"
  "$(dirname "$0")/install-hf.sh"
  if ((with_benchmarks)); then "$(dirname "$0")/install-torch.sh"; fi
}
((${#missing[@]} == 0)) && { after_packages; exit 0; }

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "install-deps.sh: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-deps.sh: apt-get failed; see the output above" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
after_packages
