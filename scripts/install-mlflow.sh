#!/usr/bin/env bash
# Installs an MLflow tracking server (PyPI `mlflow`, pinned; not in Debian)
# into its own virtual environment, /opt/tessera-tools/mlflow
# (TESSERA_TOOLS_DIR/mlflow to change), apart from the tools' venv so that
# MLflow's many dependencies (pandas, SQLAlchemy, FastAPI, ...) pin nothing
# else. The tracking tests start it on loopback (`mlflow server`) and read
# runs back with its own Python client (tests/multiprocess/test_tracking.cpp).
# Users do not need it: `tessera train --mlflow-uri` speaks MLflow's REST API
# from C++. Idempotent and quiet when the pinned version is in place; about a
# minute and 850 MB the first time. Run by scripts/install-deps.sh.
set -euo pipefail
dir=${TESSERA_TOOLS_DIR:-/opt/tessera-tools}/mlflow
wheels=(mlflow==3.17.2)
stamp="$dir/.tessera-mlflow"
[[ -x $dir/bin/mlflow && "$(cat "$stamp" 2>/dev/null)" == "${wheels[*]}" ]] && exit 0

sudo=()
parent=$(dirname "$dir")
if ((EUID != 0)) && ! { [[ -d $dir && -w $dir ]] || [[ ! -e $dir && -w $parent ]]; }; then
  command -v sudo >/dev/null || { echo "install-mlflow.sh: need root, sudo or a writable TESSERA_TOOLS_DIR for $dir" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-mlflow.sh: installing ${wheels[*]} into $dir"
log=$(mktemp)
if ! { "${sudo[@]}" mkdir -p "$parent" &&
       "${sudo[@]}" /usr/bin/python3 -m venv "$dir" &&
       "${sudo[@]}" "$dir/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}" &&
       echo "${wheels[*]}" | "${sudo[@]}" tee "$stamp" >/dev/null; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-mlflow.sh: failed; see the output above" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
"$dir/bin/mlflow" --version >/dev/null
