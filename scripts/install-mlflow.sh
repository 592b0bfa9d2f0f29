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
here=$(dirname "$0")
"$here/install-pypi-venv.sh" mlflow bin/mlflow mlflow==3.17.2
"${TESSERA_TOOLS_DIR:-/opt/tessera-tools}/mlflow/bin/mlflow" --version >/dev/null
