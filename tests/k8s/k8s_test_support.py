# Shared by the `k8s` tests (tests/k8s/test_*.py, run by CTest): imports
# k8s/tools/k8scheck.py, finds kubectl, the CRD schemas and the tessera binary,
# and decides what happens when one is missing: a skip with a message (exit 77,
# CTest's SKIP_RETURN_CODE) on a developer's machine, a failure under CI
# (CI=true), where scripts/install-deps.sh and ../shared provide everything.
import json
import os
import sys
import unittest
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "k8s" / "tools"))
import k8scheck  # noqa: E402

SKIP = 77


def tessera_binary() -> str:
    """$TESSERA_BINARY (CTest passes the built target), else build/bin/tessera."""
    return os.environ.get("TESSERA_BINARY", str(REPO / "build" / "bin" / "tessera"))


def missing(what: str) -> None:
    """A prerequisite is absent: skip locally, fail in CI."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        print(f"FAIL (CI): {what}", file=sys.stderr)
        sys.exit(1)
    print(f"SKIP: {what}")
    sys.exit(SKIP)


def require_schemas() -> dict:
    """{'mpijob': CRD entries, 'swagger': Katib's swagger.json, 'dir': Path}."""
    crd = k8scheck.find_mpijob_crd()
    if crd is None or not crd.is_file():
        missing("no MPIJob CRD schema: set TESSERA_MPIJOB_CRD (a CRD file, e.g. `kubectl get crd "
                "mpijobs.kubeflow.org -o yaml`) or TESSERA_K8S_SCHEMAS (a directory like ../shared/k8s-schemas); "
                f"looked in {', '.join(map(str, k8scheck.schema_search_path()))}")
    swagger = k8scheck.find_katib_swagger()
    if swagger is None or not swagger.is_file():
        missing("no Katib swagger.json: set TESSERA_KATIB_SWAGGER or TESSERA_K8S_SCHEMAS")
    if k8scheck.jsonschema is None:
        missing("python3 jsonschema is not installed (scripts/install-deps.sh installs python3-jsonschema)")
    return {"mpijob": k8scheck.load_crd(crd), "swagger": json.loads(swagger.read_text()), "dir": crd.parent}


def require_kubectl() -> list[str]:
    kubectl = k8scheck.find_kubectl()
    if kubectl is None:
        missing("no kubectl or kustomize: scripts/install-deps.sh installs kubectl into /opt/tessera-tools "
                "(or set TESSERA_KUBECTL)")
    return kubectl


def require_tessera() -> str:
    binary = tessera_binary()
    if not Path(binary).is_file():
        missing(f"no tessera binary at {binary} (build first, or set TESSERA_BINARY)")
    return binary


def run_tests() -> None:
    """unittest.main, printing which tools were used."""
    kubectl = k8scheck.find_kubectl()
    print(f"kubectl: {' '.join(kubectl) if kubectl else 'none'}; schemas: {k8scheck.find_schema_dir()}")
    unittest.main(verbosity=2)
