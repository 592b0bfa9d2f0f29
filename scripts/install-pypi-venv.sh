#!/usr/bin/env bash
# Installs pinned PyPI packages into a virtual environment of their own,
# TESSERA_TOOLS_DIR/NAME (default /opt/tessera-tools/NAME), so that what they
# pin pins nothing else. Idempotent: quiet and quick when the stamp file says
# the same pins are in place and CHECK (a path inside the venv) exists; with
# root, sudo or a writable TESSERA_TOOLS_DIR. Shared by scripts/install-mlflow.sh
# (the MLflow server of the tracking tests), scripts/install-torch.sh
# (PyTorch for the side-by-side benchmarks) and scripts/install-hf.sh
# (transformers over Debian's python3-torch for the Hugging Face tests).
# --system-site-packages: the venv also sees Debian's Python packages.
#
#   scripts/install-pypi-venv.sh [--system-site-packages] NAME CHECK WHEEL...    e.g. mlflow bin/mlflow mlflow==3.17.2
set -euo pipefail
venv_options=()
if [[ ${1:-} == --system-site-packages ]]; then venv_options=(--system-site-packages); shift; fi
(($# >= 3)) || { echo "usage: install-pypi-venv.sh [--system-site-packages] NAME CHECK WHEEL..." >&2; exit 2; }
name=$1 check=$2
shift 2
wheels=("$@")
dir=${TESSERA_TOOLS_DIR:-/opt/tessera-tools}/$name
stamp="$dir/.tessera-$name"
pins="${venv_options[*]}${venv_options[*]:+ }${wheels[*]}"  # what the stamp records
[[ -e $dir/$check && "$(cat "$stamp" 2>/dev/null)" == "$pins" ]] && exit 0

sudo=()
parent=$(dirname "$dir")
if ((EUID != 0)) && ! { [[ -d $dir && -w $dir ]] || [[ ! -e $dir && -w $parent ]]; }; then
  command -v sudo >/dev/null || { echo "install-$name: need root, sudo or a writable TESSERA_TOOLS_DIR for $dir" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-$name: installing ${wheels[*]} into $dir"
log=$(mktemp)
if ! { "${sudo[@]}" mkdir -p "$parent" &&
       "${sudo[@]}" /usr/bin/python3 -m venv "${venv_options[@]}" "$dir" &&
       "${sudo[@]}" "$dir/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}" &&
       echo "$pins" | "${sudo[@]}" tee "$stamp" >/dev/null; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-$name: failed; see the output above" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
