# Offline checks of Tessera's Kubernetes manifests, shared by k8s/validate,
# k8s/render and tests/k8s: finding kubectl and the CRD schemas, rendering a
# kustomization, validating objects against a CRD's OpenAPI schema the way
# `kubectl apply` (strict field validation) would, the MPI Operator's own
# rules (pkg/apis/kubeflow/validation), and Tessera's consistency rules (-np =
# workers x slots, GPUs, RDMA, shm, checkpoints on a shared volume, ...), and
# the PodMonitor of components/monitoring against prometheus-operator's CRD and
# the job it scrapes (it selects rank 0's pod, its port is the one tessera
# serves /metrics on).
#
# No cluster is needed: the schema comes from the CRD file
# (`kubectl get crd mpijobs.kubeflow.org -o yaml` on a real cluster gives the
# same document); the CRDs in k8s/schemas (PodMonitor) are used unless one is
# passed. Python 3 with PyYAML and jsonschema (Debian: python3-yaml,
# python3-jsonschema).
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable

import yaml

try:
    import jsonschema
except ImportError:  # reported by the callers that need it
    jsonschema = None

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = K8S / "overlays"
# CRDs vendored into the repository (provenance in SOURCES.txt there).
BUNDLED_SCHEMAS = K8S / "schemas"

# The image's layout and conventions (k8s/image/*), checked against the manifests.
IMAGE_BIN = "/opt/tessera/bin"
RANK_WRAPPER = f"{IMAGE_BIN}/tessera-rank"
TESSERA_BINARY = f"{IMAGE_BIN}/tessera"
LAUNCH_WRAPPER = f"{IMAGE_BIN}/tessera-mpirun"
SSHD_WRAPPER = f"{IMAGE_BIN}/tessera-sshd"
IMAGE_USER_UID = 1000
IMAGE_USER_HOME = "/home/mpiuser"
SSH_PORT = 2222
# The labels the MPI Operator puts on every pod it makes (pkg/controller/mpi_job_controller.go).
MPI_LABEL_PREFIX = "training.kubeflow.org/"
HOSTFILE = "/etc/mpi/hostfile"
# Set in the image (ENV) and so safe to forward with -x without a pod env entry.
IMAGE_ENV = {"PATH", "LD_LIBRARY_PATH"}
# Variables the ranks read: set on the launcher, they must reach the ranks with -x
# (ranks are started through ssh, so the worker pod's env never reaches them).
RANK_ENV_PREFIXES = ("NCCL_", "UCX_", "TESSERA_", "OMP_", "CUDA_")
GPU_RESOURCE = re.compile(r"^nvidia\.com/(gpu|mig-.+)$")

DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class CheckError(Exception):
    """A setup problem (no kubectl, no schema, a kustomization that does not build)."""


# ---------------------------------------------------------------------------
# Tools and schemas
# ---------------------------------------------------------------------------

TOOLS_DIR = Path(os.environ.get("TESSERA_TOOLS_DIR", "/opt/tessera-tools"))


def find_kubectl() -> list[str] | None:
    """The command that renders a kustomization: $TESSERA_KUBECTL, the kubectl that
    scripts/install-deps.sh installs (k8s/install-tools.sh), kubectl on PATH, or a
    standalone kustomize. Returns the argv prefix before the directory."""
    explicit = os.environ.get("TESSERA_KUBECTL")
    if explicit:
        return [explicit, "kustomize"] if Path(explicit).name != "kustomize" else [explicit, "build"]
    for candidate in (TOOLS_DIR / "bin" / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return [str(candidate), "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build"]
    return None


def find_hadolint() -> str | None:
    for candidate in (os.environ.get("TESSERA_HADOLINT"), TOOLS_DIR / "bin" / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def schema_search_path() -> list[Path]:
    """Where the CRD schemas are looked for, first match wins: $TESSERA_K8S_SCHEMAS,
    ../shared/k8s-schemas beside the repository, /work/shared/k8s-schemas."""
    paths = []
    if os.environ.get("TESSERA_K8S_SCHEMAS"):
        paths.append(Path(os.environ["TESSERA_K8S_SCHEMAS"]))
    paths += [REPO.parent / "shared" / "k8s-schemas", Path("/work/shared/k8s-schemas")]
    return paths


def find_schema_dir() -> Path | None:
    for path in schema_search_path():
        if path.is_dir():
            return path
    return None


def find_mpijob_crd() -> Path | None:
    """The MPIJob CRD: $TESSERA_MPIJOB_CRD (a file, e.g. saved from
    `kubectl get crd mpijobs.kubeflow.org -o yaml`), else mpijob-v2beta1-crd.yaml in
    the schema directory."""
    if os.environ.get("TESSERA_MPIJOB_CRD"):
        return Path(os.environ["TESSERA_MPIJOB_CRD"])
    directory = find_schema_dir()
    if directory and (directory / "mpijob-v2beta1-crd.yaml").is_file():
        return directory / "mpijob-v2beta1-crd.yaml"
    return None


def find_katib_swagger() -> Path | None:
    """Katib's API schema: $TESSERA_KATIB_SWAGGER, else katib-v1beta1-swagger.json in
    the schema directory (Katib's Experiment CRD itself validates nothing)."""
    if os.environ.get("TESSERA_KATIB_SWAGGER"):
        return Path(os.environ["TESSERA_KATIB_SWAGGER"])
    directory = find_schema_dir()
    if directory and (directory / "katib-v1beta1-swagger.json").is_file():
        return directory / "katib-v1beta1-swagger.json"
    return None


@functools.lru_cache(maxsize=None)
def bundled_crds() -> dict[tuple[str, str], dict]:
    """The CRDs in k8s/schemas (*-crd.yaml), as load_crd gives them; loaded once.
    document_errors uses them for kinds its caller passed no CRD for."""
    result: dict[tuple[str, str], dict] = {}
    for path in sorted(BUNDLED_SCHEMAS.glob("*-crd.yaml")):
        result.update(load_crd(path))
    return result


def load_yaml_documents(text: str) -> list[dict]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the 670 KB CRD in a fraction of the time
    return [doc for doc in yaml.load_all(text, Loader=loader) if doc is not None]


# ---------------------------------------------------------------------------
# CRD OpenAPI v3 -> JSON Schema (draft 7), with kubectl's strictness
# ---------------------------------------------------------------------------

def openapi_to_jsonschema(node: Any) -> Any:
    """A structural CRD schema as JSON Schema: objects with `properties` reject unknown
    fields (unless x-kubernetes-preserve-unknown-fields), `nullable` admits null,
    x-kubernetes-int-or-string admits both. Other keywords (type, enum, pattern,
    required, minimum, anyOf, ...) mean the same in both."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: openapi_to_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = openapi_to_jsonschema(value)
        elif key == "description":
            continue
        else:
            out[key] = value
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") is True:
        if "type" in out:
            out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else list(out["type"]) + ["null"]
        if "enum" in out and None not in out["enum"]:
            out["enum"] = list(out["enum"]) + [None]
    return out


def load_crd(path: Path) -> dict[tuple[str, str], dict]:
    """{(apiVersion, kind): (openAPIV3Schema, JSON Schema)} for every served version of
    every CRD in the file (a CRD list from `kubectl get -o yaml` works too)."""
    result = {}
    docs = load_yaml_documents(path.read_text())
    crds = []
    for doc in docs:
        if doc.get("kind") == "List":
            crds += doc.get("items", [])
        else:
            crds.append(doc)
    for crd in crds:
        if crd.get("kind") != "CustomResourceDefinition":
            continue
        group = crd["spec"]["group"]
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version.get("served", True):
                continue
            openapi = version["schema"]["openAPIV3Schema"]
            result[(f"{group}/{version['name']}", kind)] = {
                "openapi": openapi,
                "jsonschema": openapi_to_jsonschema(openapi),
            }
    if not result:
        raise CheckError(f"{path}: no CustomResourceDefinition with a schema in it")
    return result


def swagger_to_jsonschema(swagger: dict, root: str) -> dict:
    """One definition of a Swagger 2.0 document (Katib's swagger.json) as a JSON
    Schema: $refs resolved inside it, $refs to definitions it lacks (the core
    Kubernetes types) accepting anything, unknown fields rejected."""
    definitions = swagger["definitions"]

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            name = node["$ref"].split("/")[-1]
            return {"$ref": f"#/definitions/{name}"} if name in definitions else {}
        out = {}
        for key, value in node.items():
            if key == "properties":
                out[key] = {name: convert(sub) for name, sub in value.items()}
            elif key in ("items", "additionalProperties", "allOf", "anyOf", "oneOf"):
                out[key] = convert(value)
            elif key in ("description", "default") or key.startswith("x-"):
                continue
            else:
                out[key] = value
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    schema = convert(definitions[root])
    schema["definitions"] = {name: convert(body) for name, body in definitions.items()}
    return schema


# ---------------------------------------------------------------------------
# Validation against a schema
# ---------------------------------------------------------------------------

def json_path(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text or "."


def prune_nulls(value: Any, schema: dict) -> Any:
    """Drop `field: null` where the schema does not say nullable, as the API server
    does before validating (kustomize and hand-written YAML leave such nulls)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, sub in value.items():
            sub_schema = props.get(key, extra if isinstance(extra, dict) else {})
            if sub is None and not sub_schema.get("nullable"):
                continue
            out[key] = prune_nulls(sub, sub_schema)
        return out
    if isinstance(value, list):
        items = schema.get("items", {})
        return [prune_nulls(item, items if isinstance(items, dict) else {}) for item in value]
    return value


def list_map_errors(value: Any, schema: dict, path: list) -> list[str]:
    """x-kubernetes-list-type map/set: the API server rejects duplicate keys
    (two containers of one name, two env entries of one name, ...)."""
    errors = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_schema = props.get(key, extra if isinstance(extra, dict) else {})
            errors += list_map_errors(sub, sub_schema, path + [key])
    elif isinstance(value, list):
        items = schema.get("items", {}) if isinstance(schema.get("items"), dict) else {}
        list_type = schema.get("x-kubernetes-list-type")
        seen = set()
        for index, item in enumerate(value):
            if list_type == "map" and isinstance(item, dict):
                key = tuple(json.dumps(item.get(k), sort_keys=True) for k in schema.get("x-kubernetes-list-map-keys", []))
            elif list_type == "set":
                key = json.dumps(item, sort_keys=True)
            else:
                key = None
            if key is not None:
                if key in seen:
                    errors.append(f"{json_path(path + [index])}: duplicate entry {key} (x-kubernetes-list-type {list_type})")
                seen.add(key)
            errors += list_map_errors(item, items, path + [index])
    return errors


def metadata_errors(metadata: Any, path: list, top_level: bool) -> list[str]:
    """What the API server checks in ObjectMeta that a CRD schema leaves out."""
    if metadata is None:
        return [f"{json_path(path)}: missing"] if top_level else []
    if not isinstance(metadata, dict):
        return [f"{json_path(path)}: must be an object"]
    errors = []
    allowed = {"name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences", "uid",
               "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
               "deletionGracePeriodSeconds", "managedFields", "selfLink"}
    for key in metadata:
        if key not in allowed:
            errors.append(f"{json_path(path + [key])}: field not declared in ObjectMeta")
    name = metadata.get("name")
    if top_level and not name:
        errors.append(f"{json_path(path + ['name'])}: required")
    if name is not None and (not isinstance(name, str) or len(name) > 253 or not DNS1123_SUBDOMAIN.match(name)):
        errors.append(f"{json_path(path + ['name'])}: {name!r} is not a DNS-1123 subdomain")
    namespace = metadata.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or len(namespace) > 63
                                  or not DNS1123_LABEL.match(namespace)):
        errors.append(f"{json_path(path + ['namespace'])}: {namespace!r} is not a DNS-1123 label")
    for key, value in (metadata.get("labels") or {}).items():
        errors += label_errors(key, value, path + ["labels", key])
    for key, value in (metadata.get("annotations") or {}).items():
        if not isinstance(value, str):
            errors.append(f"{json_path(path + ['annotations', key])}: annotation values must be strings, got {value!r}")
        errors += label_key_errors(key, path + ["annotations", key])
    return errors


def label_key_errors(key: Any, path: list) -> list[str]:
    if not isinstance(key, str):
        return [f"{json_path(path)}: keys must be strings"]
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return [f"{json_path(path)}: prefix {prefix!r} is not a DNS-1123 subdomain"]
    if not name or len(name) > 63 or not LABEL_NAME.match(name):
        return [f"{json_path(path)}: {name!r} is not a valid label/annotation name"]
    return []


def label_errors(key: Any, value: Any, path: list) -> list[str]:
    errors = label_key_errors(key, path)
    if not isinstance(value, str):
        errors.append(f"{json_path(path)}: label values must be strings, got {value!r}")
    elif value and (len(value) > 63 or not LABEL_NAME.match(value)):
        errors.append(f"{json_path(path)}: {value!r} is not a valid label value")
    return errors


def schema_errors(obj: dict, crd_entry: dict) -> list[str]:
    """Every way `obj` breaks the CRD schema, as `<path>: <message>` lines."""
    if jsonschema is None:
        raise CheckError("python3 jsonschema is missing (Debian: python3-jsonschema; scripts/install-deps.sh)")
    cleaned = prune_nulls(obj, crd_entry["openapi"])
    validator = jsonschema.Draft7Validator(crd_entry["jsonschema"])
    errors = []
    for error in sorted(validator.iter_errors(cleaned), key=lambda e: list(map(str, e.absolute_path))):
        errors.append(f"{json_path(error.absolute_path)}: {error.message}")
    errors += list_map_errors(cleaned, crd_entry["openapi"], [])
    errors += metadata_errors(cleaned.get("metadata"), ["metadata"], top_level=True)
    return errors


def swagger_errors(obj: dict, schema: dict) -> list[str]:
    if jsonschema is None:
        raise CheckError("python3 jsonschema is missing (Debian: python3-jsonschema; scripts/install-deps.sh)")
    validator = jsonschema.Draft7Validator(schema)
    return [f"{json_path(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]


# ---------------------------------------------------------------------------
# The MPI Operator's own rules (kubeflow/mpi-operator pkg/apis/kubeflow/validation)
# ---------------------------------------------------------------------------

def replica_specs(job: dict) -> tuple[dict | None, dict | None]:
    specs = (job.get("spec") or {}).get("mpiReplicaSpecs") or {}
    return specs.get("Launcher"), specs.get("Worker")


def operator_errors(job: dict) -> list[str]:
    """Rules the operator applies after the API server accepted the object; a job that
    breaks one only gets a ValidationError event and never starts."""
    errors = []
    name = (job.get("metadata") or {}).get("name", "")
    spec = job.get("spec") or {}
    launcher, worker = replica_specs(job)
    workers = (worker or {}).get("replicas", 0)
    last_worker = f"{name}-worker-{max(workers - 1, 0)}"
    for pod_name in (last_worker, f"{name}-launcher"):
        if len(pod_name) > 63 or not DNS1035_LABEL.match(pod_name):
            errors.append(f"metadata.name: {pod_name!r} (a pod name the operator makes) is not a DNS-1035 label "
                          "(lower-case letters, digits, '-', starting with a letter, at most 63 characters)")
    run_policy = spec.get("runPolicy") or {}
    if run_policy.get("cleanPodPolicy", "None") not in ("None", "Running", "All"):
        errors.append(f".spec.runPolicy.cleanPodPolicy: {run_policy['cleanPodPolicy']!r} is not None, Running or All")
    for field in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if field in run_policy and run_policy[field] < 0:
            errors.append(f".spec.runPolicy.{field}: must be >= 0")
    if spec.get("slotsPerWorker", 1) < 0:
        errors.append(".spec.slotsPerWorker: must be >= 0")
    managed_by = run_policy.get("managedBy")
    if managed_by is not None and managed_by not in ("kubeflow.org/mpi-operator", "kueue.x-k8s.io/multikueue"):
        errors.append(f".spec.runPolicy.managedBy: {managed_by!r} is not handled by the MPI Operator")
    if launcher is None:
        errors.append(".spec.mpiReplicaSpecs.Launcher: required")
    elif launcher.get("replicas", 1) != 1:
        errors.append(f".spec.mpiReplicaSpecs.Launcher.replicas: must be 1, got {launcher.get('replicas')}")
    if worker is not None and worker.get("replicas", 0) < 1:
        errors.append(".spec.mpiReplicaSpecs.Worker.replicas: must be >= 1")
    for role, replica in (("Launcher", launcher), ("Worker", worker)):
        if replica is None:
            continue
        policy = replica.get("restartPolicy", "OnFailure" if role == "Launcher" else "Never")
        if policy not in ("Never", "OnFailure"):
            errors.append(f".spec.mpiReplicaSpecs.{role}.restartPolicy: {policy!r} is not Never or OnFailure")
        containers = (((replica.get("template") or {}).get("spec")) or {}).get("containers") or []
        if not containers:
            errors.append(f".spec.mpiReplicaSpecs.{role}.template.spec.containers: at least one container")
    return errors


# ---------------------------------------------------------------------------
# Tessera's consistency rules
# ---------------------------------------------------------------------------

def pod_spec(replica: dict | None) -> dict:
    return ((replica or {}).get("template") or {}).get("spec") or {}


def container0(replica: dict | None) -> dict:
    containers = pod_spec(replica).get("containers") or [{}]
    return containers[0]


def command_line(container: dict) -> list[str]:
    return [str(x) for x in (container.get("command") or []) + (container.get("args") or [])]


def mpirun_options(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Splits `<launch wrapper> [mpirun options] program args...` into the options
    ({name: [values]}) and the rank command. Options that take no value are listed."""
    flags_without_value = {"--oversubscribe", "--allow-run-as-root", "--tag-output", "--timestamp-output",
                           "--report-bindings", "--display-map", "-v", "--verbose", "--quiet", "-q",
                           "--display-allocation", "--merge-stderr-to-stdout"}
    options: dict[str, list[str]] = {}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            break
        if arg in flags_without_value:
            options.setdefault(arg, []).append("")
            i += 1
        elif arg in ("--mca", "-mca", "--gmca", "-gmca"):
            options.setdefault("--mca", []).append(f"{argv[i + 1]}={argv[i + 2]}" if i + 2 < len(argv) else "")
            i += 3
        else:
            options.setdefault(arg, []).append(argv[i + 1] if i + 1 < len(argv) else "")
            i += 2
    return options, argv[i:]


def env_names(container: dict) -> dict[str, Any]:
    return {entry["name"]: entry.get("value") for entry in container.get("env") or [] if "name" in entry}


def volume_mounts(pod: dict, container: dict) -> dict[str, dict]:
    """{mountPath: volume} of one container."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    return {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts") or []}


def volume_for(path: str, mounts: dict[str, dict]) -> tuple[str, dict] | None:
    best = None
    for mount, volume in mounts.items():
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            if best is None or len(mount) > len(best[0]):
                best = (mount, volume)
    return best


def train_flags(rank_command: list[str]) -> dict[str, str]:
    """`... tessera train --flag value --switch ...` -> {flag: value or ''}."""
    if "train" not in rank_command:
        return {}
    args = rank_command[rank_command.index("train") + 1:]
    flags: dict[str, str] = {}
    i = 0
    while i < len(args):
        if args[i].startswith("--"):
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                flags[args[i]] = args[i + 1]
                i += 2
                continue
            flags[args[i]] = ""
        i += 1
    return flags


def train_settings(job: dict, docs: list[dict]) -> tuple[dict[str, str], list[str]]:
    """The settings `tessera train` runs with, as {--flag: value}: the launcher's
    command line over the --config file's (the command line wins, as in tessera
    train), and the problems of reading that file."""
    launcher, _ = replica_specs(job)
    _, rank_command = mpirun_options(command_line(container0(launcher)))
    command_flags = train_flags(rank_command)
    flags: dict[str, str] = {}
    problems: list[str] = []
    if command_flags.get("--config"):
        settings, problems = config_settings(job, docs, command_flags["--config"])
        flags.update(settings)
    flags.update(command_flags)
    return flags, problems


def container_ports(container: dict) -> dict[str, Any]:
    """{name or '#<index>': containerPort} of one container's declared ports."""
    return {str(port.get("name") or f"#{index}"): port.get("containerPort")
            for index, port in enumerate(container.get("ports") or [])}


def config_settings(job: dict, docs: list[dict], config_path: str) -> tuple[dict[str, str], list[str]]:
    """The settings of `tessera train --config PATH` as {--flag: value}: the file
    comes from the ConfigMap volume the workers (where the ranks run) mount there."""
    import tomllib
    _, worker = replica_specs(job)
    found = volume_for(config_path, volume_mounts(pod_spec(worker), container0(worker)))
    if found is None or "configMap" not in found[1]:
        return {}, [f"worker: --config {config_path} is not on a ConfigMap volume mounted in the worker"]
    mount, volume = found
    name = volume["configMap"].get("name")
    key = config_path[len(mount.rstrip("/")) + 1:]
    namespace = (job.get("metadata") or {}).get("namespace")
    for doc in docs:
        meta = doc.get("metadata") or {}
        if doc.get("kind") == "ConfigMap" and meta.get("name") == name and meta.get("namespace") == namespace:
            text = (doc.get("data") or {}).get(key)
            if text is None:
                return {}, [f"ConfigMap {name} has no key {key} (--config {config_path})"]
            try:
                table = tomllib.loads(text)
            except tomllib.TOMLDecodeError as error:
                return {}, [f"ConfigMap {name} {key}: not TOML: {error}"]
            settings = {}
            for flag, value in table.items():
                if isinstance(value, bool):
                    settings[f"--{flag}"] = "" if value else "false"
                elif isinstance(value, list):
                    settings[f"--{flag}"] = ",".join(map(str, value))
                else:
                    settings[f"--{flag}"] = str(value)
            return settings, []
    return {}, [f"--config {config_path}: the ConfigMap {name} is not among the rendered objects"]


def gpu_resources(container: dict) -> dict[str, tuple[Any, Any]]:
    resources = container.get("resources") or {}
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    names = {n for n in list(requests) + list(limits) if GPU_RESOURCE.match(n)}
    return {n: (requests.get(n), limits.get(n)) for n in names}


def capabilities(container: dict) -> set[str]:
    return set(((container.get("securityContext") or {}).get("capabilities") or {}).get("add") or [])


def run_as_user(pod: dict, container: dict) -> Any:
    return (container.get("securityContext") or {}).get("runAsUser",
                                                        (pod.get("securityContext") or {}).get("runAsUser"))


def tessera_errors(job: dict, docs: list[dict] | None = None, train_help_flags: set[str] | None = None) -> list[str]:
    """Tessera's own rules for an MPIJob that runs `tessera train`; `docs` are the
    objects rendered with it (the ConfigMap of --config)."""
    errors = []
    spec = job.get("spec") or {}
    launcher, worker = replica_specs(job)
    if worker is None:
        return ["Worker: Tessera's jobs have workers (the launcher runs only mpirun)"]
    workers = worker.get("replicas", 0)
    slots = spec.get("slotsPerWorker", 1)
    lpod, wpod = pod_spec(launcher), pod_spec(worker)
    lc, wc = container0(launcher), container0(worker)

    # mpirun: explicit hostfile (Open MPI 5 ignores the operator's OMPI_MCA_orte_* variables), -np = workers x slots.
    argv = command_line(lc)
    if not argv or argv[0] != LAUNCH_WRAPPER:
        errors.append(f"launcher: command must start with {LAUNCH_WRAPPER} (mpirun with signal forwarding), got {argv[:1]}")
    options, rank_command = mpirun_options(argv)
    np_values = options.get("-np", []) + options.get("-n", []) + options.get("--np", [])
    if len(np_values) != 1:
        errors.append(f"launcher: mpirun needs exactly one -np, got {np_values}")
    elif not np_values[0].isdigit() or int(np_values[0]) != workers * slots:
        errors.append(f"launcher: mpirun -np {np_values[0]} but workers x slotsPerWorker = {workers} x {slots} = "
                      f"{workers * slots}")
    if options.get("--hostfile") != [HOSTFILE]:
        errors.append(f"launcher: mpirun needs --hostfile {HOSTFILE} (explicit, so Open MPI 4 and 5 both use it)")
    if rank_command[:1] != [RANK_WRAPPER]:
        errors.append(f"launcher: each rank must start through {RANK_WRAPPER}, got {rank_command[:1]}")
    if rank_command[1:3] != [TESSERA_BINARY, "train"]:
        errors.append(f"launcher: the ranks must run {TESSERA_BINARY} train, got {rank_command[1:3]}")

    # Environment: what the ranks read must be forwarded with -x, and -x only names what is set.
    forwarded = set(options.get("-x", []))
    launcher_env = env_names(lc)
    for name in launcher_env:
        if name.startswith(RANK_ENV_PREFIXES) and name not in forwarded:
            errors.append(f"launcher: env {name} is set but not forwarded to the ranks (mpirun -x {name})")
    for name in forwarded:
        if "=" not in name and name not in launcher_env and name not in IMAGE_ENV:
            errors.append(f"launcher: mpirun -x {name} but {name} is set neither in the launcher env nor in the image")
    for name in env_names(wc):
        if name.startswith(RANK_ENV_PREFIXES):
            errors.append(f"worker: env {name} never reaches the ranks (they start through ssh); set it on the "
                          "launcher and forward it with -x")

    # tessera train: the flags exist, checkpoints and data on a volume every pod mounts at the same path.
    flags, problems = train_settings(job, docs or [])
    errors += problems
    if train_help_flags is not None:
        for flag in flags:
            if flag not in train_help_flags:
                errors.append(f"launcher: tessera train has no flag {flag} (command line or --config)")
    if flags.get("--resume") != "auto" or not flags.get("--save"):
        errors.append("launcher: tessera train needs --save DIR and --resume auto (a restarted launcher goes on)")
    for flag in ("--save", "--data", "--eval-data", "--metrics"):
        path = flags.get(flag)
        if not path:
            continue
        for role, pod, container in (("launcher", lpod, lc), ("worker", wpod, wc)):
            if flag == "--metrics" and role == "worker":
                continue  # rank 0 writes it; it sits on the worker of rank 0, so it must be on the shared volume too
            found = volume_for(path, volume_mounts(pod, container))
            if found is None or "persistentVolumeClaim" not in found[1]:
                errors.append(f"{role}: {flag} {path} is not on a persistentVolumeClaim mounted in the {role}")
    if flags.get("--metrics"):
        found = volume_for(flags["--metrics"], volume_mounts(wpod, wc))
        if found is None or "persistentVolumeClaim" not in found[1]:
            errors.append(f"worker: --metrics {flags['--metrics']} is written by rank 0 on a worker: put it on the "
                          "shared volume")

    # Prometheus: rank 0 serves /metrics on --metrics-port; it runs on a worker, whose
    # container declares the port (a PodMonitor finds it by its name).
    metrics_port = flags.get("--metrics-port")
    if metrics_port is not None and metrics_port != "0":  # 0 (the default): off
        if not metrics_port.isdigit() or not 1 <= int(metrics_port) <= 65535:
            errors.append(f"launcher: --metrics-port {metrics_port!r} is not a port number (1-65535)")
        elif int(metrics_port) == SSH_PORT:
            errors.append(f"launcher: --metrics-port {metrics_port} is the port of the workers' sshd")
        elif int(metrics_port) not in container_ports(wc).values():
            errors.append(f"worker: tessera serves /metrics on --metrics-port {metrics_port} (rank 0, on a worker) "
                          f"but the worker container declares no containerPort {metrics_port}")

    # Workers: sshd from the image, readiness on its port (WaitForWorkersReady), a signal on preStop.
    if command_line(wc)[:1] != [SSHD_WRAPPER]:
        errors.append(f"worker: command must be {SSHD_WRAPPER} (sshd on port {SSH_PORT} for any user)")
    probe = (wc.get("readinessProbe") or {}).get("tcpSocket") or {}
    if spec.get("launcherCreationPolicy") == "WaitForWorkersReady" and probe.get("port") not in (SSH_PORT, "ssh"):
        errors.append(f"worker: WaitForWorkersReady needs a readinessProbe tcpSocket on port {SSH_PORT}")
    pre_stop = ((wc.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command") or []
    if "pkill -USR1 -x tessera" not in " ".join(pre_stop):
        errors.append("worker: lifecycle.preStop must signal the local ranks (pkill -USR1 -x tessera) so that an "
                      "evicted worker makes the job checkpoint")
    for role, pod in (("launcher", lpod), ("worker", wpod)):
        if (pod.get("terminationGracePeriodSeconds") or 30) < 120:
            errors.append(f"{role}: terminationGracePeriodSeconds must leave time for a checkpoint (>= 120)")
        if "restartPolicy" in pod:
            errors.append(f"{role}: set restartPolicy on the replica spec; the operator overrides the pod's")

    # Gang scheduling with WaitForWorkersReady: the launcher does not exist until the workers are Ready.
    scheduling = (spec.get("runPolicy") or {}).get("schedulingPolicy") or {}
    if spec.get("launcherCreationPolicy") == "WaitForWorkersReady" and scheduling.get("minAvailable") != workers:
        errors.append(f"runPolicy.schedulingPolicy.minAvailable must be the worker count {workers} with "
                      f"WaitForWorkersReady (the default, workers + 1, waits for a launcher that is not created yet)")

    # GPUs: requests = limits = ranks per worker; --device cuda exactly when there are GPUs.
    gpus = gpu_resources(wc)
    for name, (request, limit) in gpus.items():
        if request is None or limit is None or str(request) != str(limit):
            errors.append(f"worker: {name} requests {request} and limits {limit} must be equal")
        elif str(limit) != str(slots):
            errors.append(f"worker: {name} = {limit} but slotsPerWorker = {slots} (one GPU per rank)")
    if len(gpus) > 1:
        errors.append(f"worker: more than one GPU resource kind {sorted(gpus)}")
    device = flags.get("--device", "cpu")
    if gpus and not device.startswith("cuda"):
        errors.append(f"launcher: workers have GPUs {sorted(gpus)} but tessera train runs with --device {device}")
    if device.startswith("cuda") and not gpus:
        errors.append("launcher: --device cuda but the workers request no GPU")
    if gpu_resources(lc):
        errors.append("launcher: requests GPUs; it only runs mpirun")

    # /dev/shm: memory-backed in every worker (NCCL's and Open MPI's shared-memory transports).
    shm = volume_for("/dev/shm", volume_mounts(wpod, wc))
    if shm is None or shm[0] != "/dev/shm" or (shm[1].get("emptyDir") or {}).get("medium") != "Memory":
        errors.append("worker: /dev/shm must be an emptyDir with medium Memory")

    # RDMA: IPC_LOCK (verbs pin memory), which only root gets (no ambient capabilities in Kubernetes).
    resources = wc.get("resources") or {}
    rdma = [n for n in list(resources.get("limits") or {}) if n.startswith("rdma/")]
    networks = ((worker.get("template") or {}).get("metadata") or {}).get("annotations", {}).get(
        "k8s.v1.cni.cncf.io/networks")
    if rdma or networks:
        if "IPC_LOCK" not in capabilities(wc):
            errors.append("worker: RDMA needs securityContext.capabilities.add IPC_LOCK")
        if run_as_user(wpod, wc) != 0:
            errors.append("worker: IPC_LOCK only takes effect for root (Kubernetes gives non-root processes no "
                          "ambient capabilities): runAsUser 0")
        for name in rdma:
            if (resources.get("requests") or {}).get(name) != resources["limits"][name]:
                errors.append(f"worker: {name} requests and limits must be equal")
    elif "IPC_LOCK" in capabilities(wc):
        errors.append("worker: IPC_LOCK without an RDMA resource or network")

    # SSH keys: the operator mounts them at sshAuthMountPath, 0600 only under /root/.ssh.
    ssh_path = spec.get("sshAuthMountPath", "/root/.ssh")
    for role, pod, container in (("launcher", lpod, lc), ("worker", wpod, wc)):
        user = run_as_user(pod, container)
        if user == 0 and ssh_path != "/root/.ssh":
            errors.append(f"{role}: runs as root, so sshAuthMountPath must be /root/.ssh (got {ssh_path})")
        if user == 0 and (pod.get("securityContext") or {}).get("fsGroup") is not None:
            errors.append(f"{role}: root with fsGroup makes the ssh key 0640, which ssh refuses")
        if user not in (0, IMAGE_USER_UID):
            errors.append(f"{role}: runAsUser {user} is neither root nor the image's user {IMAGE_USER_UID}")
        if user == IMAGE_USER_UID and ssh_path != f"{IMAGE_USER_HOME}/.ssh":
            errors.append(f"{role}: runs as {IMAGE_USER_UID}, so sshAuthMountPath must be {IMAGE_USER_HOME}/.ssh")
    return errors


# ---------------------------------------------------------------------------
# What the operator would create for gang scheduling
# ---------------------------------------------------------------------------

def podgroup_for(job: dict, scheduler: str) -> dict:
    """The PodGroup the operator makes for `job` with --gang-scheduling=<scheduler>
    (pkg/controller/podgroup.go): minMember from minAvailable, queue and priority
    class for Volcano, scheduleTimeoutSeconds for scheduler-plugins."""
    name = job["metadata"]["name"]
    policy = (job["spec"].get("runPolicy") or {}).get("schedulingPolicy") or {}
    _, worker = replica_specs(job)
    min_member = policy.get("minAvailable", (worker or {}).get("replicas", 0) + 1)
    if scheduler == "volcano":
        spec = {"minMember": min_member}
        if policy.get("queue"):
            spec["queue"] = policy["queue"]
        if policy.get("priorityClass"):
            spec["priorityClassName"] = policy["priorityClass"]
        if policy.get("minResources"):
            spec["minResources"] = policy["minResources"]
        return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
                "metadata": {"name": name}, "spec": spec}
    spec = {"minMember": min_member}
    if "scheduleTimeoutSeconds" in policy:
        spec["scheduleTimeoutSeconds"] = policy["scheduleTimeoutSeconds"]
    if policy.get("minResources"):
        spec["minResources"] = policy["minResources"]
    return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"name": name},
            "spec": spec}


# ---------------------------------------------------------------------------
# Prometheus: the PodMonitor that scrapes rank 0's /metrics (components/monitoring)
# ---------------------------------------------------------------------------

def pod_labels(job: dict, role: str, index: int = 0) -> dict[str, str]:
    """The labels of a pod the operator makes for `job` (role "Launcher" or
    "Worker"): its template's, overwritten by the operator's own (newWorker,
    newLauncherPodTemplate in mpi_job_controller.go): operator name, job name, role,
    and the replica index of workers (shifted by one with runLauncherAsWorker,
    when the launcher is index 0)."""
    replica = ((job.get("spec") or {}).get("mpiReplicaSpecs") or {}).get(role) or {}
    template_labels = ((replica.get("template") or {}).get("metadata") or {}).get("labels") or {}
    labels = {str(key): str(value) for key, value in template_labels.items()}
    labels.update({f"{MPI_LABEL_PREFIX}operator-name": "mpi-operator",
                   f"{MPI_LABEL_PREFIX}job-name": str((job.get("metadata") or {}).get("name")),
                   f"{MPI_LABEL_PREFIX}job-role": role.lower()})
    launcher_as_worker = (job.get("spec") or {}).get("runLauncherAsWorker") is True
    if role == "Worker":
        labels[f"{MPI_LABEL_PREFIX}replica-index"] = str(index + 1 if launcher_as_worker else index)
    elif launcher_as_worker:
        labels[f"{MPI_LABEL_PREFIX}replica-index"] = "0"
    return labels


def rank0_role(job: dict) -> str:
    """Which replica hosts world rank 0: mpirun fills the hostfile's hosts in order,
    and the operator writes worker 0 first (the launcher, with runLauncherAsWorker)."""
    return "Launcher" if (job.get("spec") or {}).get("runLauncherAsWorker") is True else "Worker"


def selector_matches(selector: dict, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels and matchExpressions: In, NotIn, Exists,
    DoesNotExist) against a pod's labels; an empty selector matches every pod."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(str(key)) != str(value):
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = str(expression.get("key")), expression.get("operator")
        values = [str(v) for v in expression.get("values") or []]
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def podmonitor_errors(monitor: dict, docs: list[dict]) -> list[str]:
    """Tessera's rules for a PodMonitor rendered with an MPIJob (only the schema is
    checked when no MPIJob of its namespace is among `docs`): it selects the pod of
    rank 0, which alone serves /metrics; each endpoint names a port that pod
    declares (none named: every declared port would be scraped, sshd's too), and
    that port is tessera's --metrics-port; path /metrics over plain HTTP; jobLabel,
    if set, is a label of that pod (else the job label falls back to
    <namespace>/<PodMonitor>)."""
    errors = []
    spec = monitor.get("spec") or {}
    namespace = (monitor.get("metadata") or {}).get("namespace")
    namespaces = spec.get("namespaceSelector") or {}

    def watched(job: dict) -> bool:
        job_namespace = (job.get("metadata") or {}).get("namespace")
        if namespaces.get("any") is True:
            return True
        if namespaces.get("matchNames"):
            return job_namespace in namespaces["matchNames"]
        return job_namespace == namespace

    jobs = [d for d in docs if d.get("kind") == "MPIJob" and watched(d)]
    if not jobs:
        return []
    selector = spec.get("selector") or {}
    scraped = []
    for job in jobs:
        name = (job.get("metadata") or {}).get("name")
        if selector_matches(selector, pod_labels(job, rank0_role(job))):
            scraped.append(job)
        if rank0_role(job) == "Worker" and selector_matches(selector, pod_labels(job, "Launcher")):
            errors.append(f".spec.selector: selects the launcher pod of MPIJob/{name}, which runs only mpirun "
                          "and serves no metrics")
    if not scraped:
        job = jobs[0]
        name = (job.get("metadata") or {}).get("name")
        role = rank0_role(job)
        errors.append(f".spec.selector: {json.dumps(selector, sort_keys=True)} selects the pod of rank 0 of no MPIJob "
                      f"here, so Prometheus scrapes nothing (MPIJob/{name} {role.lower()} 0 has the labels "
                      f"{json.dumps(pod_labels(job, role), sort_keys=True)})")
        return errors
    endpoints = spec.get("podMetricsEndpoints") or []
    if not endpoints:
        errors.append(".spec.podMetricsEndpoints: none, so nothing is scraped")
    for job in scraped:
        name = (job.get("metadata") or {}).get("name")
        role = rank0_role(job)
        labels = pod_labels(job, role)
        declared = {}
        for container in pod_spec(((job.get("spec") or {}).get("mpiReplicaSpecs") or {}).get(role)).get(
                "containers") or []:
            declared.update(container_ports(container))
        listing = ", ".join(f"{port_name}={number}" for port_name, number in declared.items()) or "none"
        flags, _ = train_settings(job, docs)
        served = flags.get("--metrics-port")
        job_label = spec.get("jobLabel")
        if job_label and job_label not in labels:
            errors.append(f".spec.jobLabel: {job_label!r} is not a label of MPIJob/{name}'s rank-0 pod, so the job "
                          f"label would be <namespace>/{(monitor.get('metadata') or {}).get('name')}")
        for index, endpoint in enumerate(endpoints):
            where = f".spec.podMetricsEndpoints[{index}]"
            target_port = endpoint.get("targetPort")
            if endpoint.get("port"):
                what, number = f"port {endpoint['port']!r}", declared.get(endpoint["port"])
                if number is None:
                    errors.append(f"{where}.port: no container of MPIJob/{name}'s {role.lower()} pods declares a port "
                                  f"named {endpoint['port']!r} (declared: {listing}), so Prometheus finds no target")
                    continue
            elif endpoint.get("portNumber") is not None or isinstance(target_port, int):
                number = endpoint["portNumber"] if endpoint.get("portNumber") is not None else target_port
                what = f"port {number}"
                if number not in declared.values():
                    errors.append(f"{where}: port {number} is not declared by MPIJob/{name}'s {role.lower()} pods "
                                  f"(declared: {listing}), and Prometheus drops undeclared ports")
                    continue
            elif isinstance(target_port, str) and target_port:
                what, number = f"targetPort {target_port!r}", declared.get(target_port)
                if number is None:
                    errors.append(f"{where}.targetPort: no container of MPIJob/{name}'s {role.lower()} pods declares a "
                                  f"port named {target_port!r} (declared: {listing})")
                    continue
            else:
                errors.append(f"{where}: names no port, so Prometheus scrapes every declared port ({listing}), sshd's "
                              "included: set port to the name of the metrics port")
                continue
            if served is None or served == "0":
                errors.append(f"{where}: MPIJob/{name} runs tessera train without --metrics-port, so nothing serves "
                              "/metrics")
            elif str(number) != served:
                errors.append(f"{where}: {what} is {number}, but tessera serves /metrics on --metrics-port {served}")
            if endpoint.get("path") not in (None, "", "/metrics"):
                errors.append(f"{where}.path: {endpoint['path']!r}, but tessera serves /metrics")
            if str(endpoint.get("scheme") or "http").lower() != "http":
                errors.append(f"{where}.scheme: {endpoint['scheme']!r}, but tessera serves plain HTTP")
    return errors


# ---------------------------------------------------------------------------
# Core objects the kustomizations carry besides the MPIJob
# ---------------------------------------------------------------------------

def pvc_errors(pvc: dict) -> list[str]:
    """The PersistentVolumeClaim fields Tessera uses (no core schema offline)."""
    errors = metadata_errors(pvc.get("metadata"), ["metadata"], top_level=True)
    spec = pvc.get("spec") or {}
    for key in spec:
        if key not in ("accessModes", "resources", "storageClassName", "volumeMode", "selector", "volumeName",
                       "dataSource", "dataSourceRef", "volumeAttributesClassName"):
            errors.append(f".spec.{key}: field not declared in PersistentVolumeClaimSpec")
    modes = spec.get("accessModes") or []
    if not modes or any(m not in ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod") for m in modes):
        errors.append(f".spec.accessModes: {modes!r}")
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    if not isinstance(storage, str) or not re.match(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$", storage):
        errors.append(f".spec.resources.requests.storage: {storage!r} is not a quantity")
    return errors


def configmap_errors(configmap: dict) -> list[str]:
    errors = metadata_errors(configmap.get("metadata"), ["metadata"], top_level=True)
    for key in configmap:
        if key not in ("apiVersion", "kind", "metadata", "data", "binaryData", "immutable"):
            errors.append(f".{key}: field not declared in ConfigMap")
    for key, value in (configmap.get("data") or {}).items():
        if not isinstance(value, str):
            errors.append(f".data.{key}: values must be strings")
        if not re.match(r"^[-._a-zA-Z0-9]+$", str(key)):
            errors.append(f".data.{key}: not a valid ConfigMap key")
    return errors


# ---------------------------------------------------------------------------
# Rendering and whole-document checks
# ---------------------------------------------------------------------------

def render(directory: Path, kubectl: list[str] | None = None) -> list[dict]:
    kubectl = kubectl or find_kubectl()
    if kubectl is None:
        raise CheckError("no kubectl or kustomize found: run scripts/install-deps.sh (installs kubectl into "
                         f"{TOOLS_DIR}/bin) or set TESSERA_KUBECTL")
    result = subprocess.run(kubectl + [str(directory)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise CheckError(f"{' '.join(map(shlex.quote, kubectl))} {directory} failed:\n{result.stderr}")
    return load_yaml_documents(result.stdout)


def document_errors(docs: list[dict], crds: dict, train_help_flags: set[str] | None = None,
                    extra_docs: list[dict] | None = None, swagger: dict | None = None) -> list[str]:
    """Every problem of a rendered kustomization, each line prefixed by the object.
    `crds` are the CRD schemas by (apiVersion, kind), over those of k8s/schemas
    (PodMonitor); `extra_docs` are objects the MPIJobs may refer to (ConfigMaps)
    that are not checked themselves; `swagger` is Katib's, for Experiments."""
    errors = []
    crds = {**bundled_crds(), **crds}  # the caller's CRD of a kind wins over k8s/schemas'
    for doc in docs:
        kind, api = doc.get("kind"), doc.get("apiVersion")
        label = f"{kind}/{(doc.get('metadata') or {}).get('name')}"
        if (api, kind) in crds:
            problems = schema_errors(doc, crds[(api, kind)])
            # The rules assume the types the schema guarantees; the API server stops a
            # schema-invalid object before the operator ever sees it.
            if kind == "MPIJob" and not problems:
                problems += operator_errors(doc) + tessera_errors(doc, docs + (extra_docs or []), train_help_flags)
            if (api, kind) == ("monitoring.coreos.com/v1", "PodMonitor") and not problems:
                problems += podmonitor_errors(doc, docs + (extra_docs or []))
        elif (api, kind) == ("v1", "PersistentVolumeClaim"):
            problems = pvc_errors(doc)
        elif (api, kind) == ("v1", "ConfigMap"):
            problems = configmap_errors(doc)
        elif (api, kind) == ("kubeflow.org/v1beta1", "Experiment") and swagger is not None:
            problems = katib_errors(doc, swagger, crds, docs, train_help_flags)
        else:
            problems = [f"no schema for {api} {kind}"]
        errors += [f"{label} {p}" for p in problems]
    return errors


def tessera_train_flags(binary: str) -> set[str]:
    """The long flags `tessera train --help` lists."""
    result = subprocess.run([binary, "train", "--help"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise CheckError(f"{binary} train --help failed:\n{result.stderr}")
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", result.stdout))


# ---------------------------------------------------------------------------
# Katib Experiments whose trials are Tessera MPIJobs
# ---------------------------------------------------------------------------

KATIB_PARAMETER_TYPES = {"double", "int", "discrete", "categorical"}
KATIB_DISTRIBUTIONS = {"uniform", "logUniform", "normal", "logNormal"}
KATIB_COLLECTORS = {"StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "None"}
KATIB_ALGORITHMS = {"random", "grid", "hyperband", "bayesianoptimization", "tpe", "multivariate-tpe", "cmaes",
                    "sobol", "enas", "darts", "pbt"}
PLACEHOLDER = re.compile(r"\$\{trialParameters\.([A-Za-z0-9_-]+)\}")


def katib_trial_job(experiment: dict, trial_name: str = "tessera-gpt-tune-x7k2q9mz") -> dict:
    """The MPIJob of one trial, as Katib makes it: every ${trialParameters.X}
    replaced by a value of the parameter it references (the lowest of its range,
    or the first of its list), ${trialSpec.Name} by the trial's name."""
    spec = experiment["spec"]
    parameters = {p["name"]: p for p in spec.get("parameters") or []}
    values = {}
    for trial_parameter in spec["trialTemplate"].get("trialParameters") or []:
        reference = trial_parameter.get("reference", "")
        if reference == "${trialSpec.Name}":
            values[trial_parameter["name"]] = trial_name
        elif reference in parameters:
            space = parameters[reference].get("feasibleSpace") or {}
            values[trial_parameter["name"]] = (space.get("list") or [space.get("min")])[0]
    text = json.dumps(spec["trialTemplate"]["trialSpec"])
    text = PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), text)
    job = json.loads(text)
    job.setdefault("metadata", {})["name"] = trial_name
    job["metadata"]["namespace"] = (experiment.get("metadata") or {}).get("namespace")
    if job["metadata"]["namespace"] is None:
        del job["metadata"]["namespace"]
    return job


def katib_errors(experiment: dict, swagger: dict, crds: dict, docs: list[dict],
                 train_help_flags: set[str] | None = None) -> list[str]:
    """The Experiment against Katib's API schema (swagger.json) and the rules of
    Katib's validating webhook that matter here; its trial MPIJob, placeholders
    filled in, like any other Tessera MPIJob."""
    errors = swagger_errors(experiment, swagger_to_jsonschema(swagger, "v1beta1.Experiment"))
    errors += metadata_errors(experiment.get("metadata"), ["metadata"], top_level=True)
    if errors:
        return errors
    spec = experiment.get("spec") or {}
    objective = spec.get("objective") or {}
    if objective.get("type") not in ("minimize", "maximize"):
        errors.append(f".spec.objective.type: {objective.get('type')!r} is not minimize or maximize")
    if not objective.get("objectiveMetricName"):
        errors.append(".spec.objective.objectiveMetricName: required")
    metric_names = [objective.get("objectiveMetricName")] + list(objective.get("additionalMetricNames") or [])
    for strategy in objective.get("metricStrategies") or []:
        if strategy.get("name") not in metric_names or strategy.get("value") not in ("min", "max", "latest"):
            errors.append(f".spec.objective.metricStrategies: {strategy} (names a metric; min, max or latest)")
    algorithm = (spec.get("algorithm") or {}).get("algorithmName")
    if algorithm not in KATIB_ALGORITHMS:
        errors.append(f".spec.algorithm.algorithmName: {algorithm!r} is not a Katib suggestion service")
    collector = ((spec.get("metricsCollectorSpec") or {}).get("collector") or {}).get("kind", "StdOut")
    if collector not in KATIB_COLLECTORS:
        errors.append(f".spec.metricsCollectorSpec.collector.kind: {collector!r}")
    for pattern in (((spec.get("metricsCollectorSpec") or {}).get("source") or {}).get("filter") or {}).get(
            "metricsFormat") or []:
        try:
            if re.compile(pattern).groups < 2:
                errors.append(f"metricsFormat {pattern!r}: needs a group for the name and one for the value")
        except re.error as error:
            errors.append(f"metricsFormat {pattern!r}: {error}")
    if spec.get("parallelTrialCount", 1) > spec.get("maxTrialCount", 1 << 30):
        errors.append(".spec.parallelTrialCount exceeds maxTrialCount")
    parameters = {}
    for index, parameter in enumerate(spec.get("parameters") or []):
        where = f".spec.parameters[{index}]"
        parameters[parameter.get("name")] = parameter
        kind = parameter.get("parameterType")
        space = parameter.get("feasibleSpace") or {}
        if kind not in KATIB_PARAMETER_TYPES:
            errors.append(f"{where}.parameterType: {kind!r}")
        if kind in ("double", "int"):
            try:
                low, high = float(space["min"]), float(space["max"])
                if kind == "int" and not (space["min"].lstrip("-").isdigit() and space["max"].lstrip("-").isdigit()):
                    errors.append(f"{where}.feasibleSpace: int bounds must be integers")
                if low >= high:
                    errors.append(f"{where}.feasibleSpace: min must be below max")
                if space.get("distribution", "uniform") in ("logUniform", "logNormal") and low <= 0:
                    errors.append(f"{where}.feasibleSpace: a log distribution needs min > 0")
            except (KeyError, ValueError):
                errors.append(f"{where}.feasibleSpace: {kind} needs numeric min and max")
        elif kind in ("discrete", "categorical") and not space.get("list"):
            errors.append(f"{where}.feasibleSpace.list: required for {kind}")
        if space.get("distribution") is not None and space["distribution"] not in KATIB_DISTRIBUTIONS:
            errors.append(f"{where}.feasibleSpace.distribution: {space['distribution']!r}")
    template = spec.get("trialTemplate") or {}
    trial_parameters = {p.get("name"): p for p in template.get("trialParameters") or []}
    for name, trial_parameter in trial_parameters.items():
        reference = trial_parameter.get("reference", "")
        if reference not in parameters and not re.fullmatch(r"\$\{trialSpec\.[A-Za-z.\[\]]+\}", reference):
            errors.append(f"trialParameters {name}: reference {reference!r} is neither a parameter nor trial metadata")
    used = set(PLACEHOLDER.findall(json.dumps(template.get("trialSpec"))))
    for name in used - set(trial_parameters):
        errors.append(f"trialSpec uses ${{trialParameters.{name}}}, which trialParameters does not define")
    for name in set(trial_parameters) - used:
        errors.append(f"trialParameters {name} is never used in the trialSpec")
    for name in set(parameters) - {p.get("reference") for p in trial_parameters.values()}:
        errors.append(f"parameter {name} reaches no trial (no trialParameter references it)")

    trial = template.get("trialSpec") or {}
    if (trial.get("apiVersion"), trial.get("kind")) != ("kubeflow.org/v2beta1", "MPIJob"):
        return errors + ["trialSpec: Tessera's trials are kubeflow.org/v2beta1 MPIJobs"]
    job = katib_trial_job(experiment)
    launcher, _ = replica_specs(job)
    if template.get("primaryContainerName") != container0(launcher).get("name"):
        errors.append(f"trialTemplate.primaryContainerName {template.get('primaryContainerName')!r} is not the "
                      f"launcher's container {container0(launcher).get('name')!r} (whose stdout carries the metrics)")
    if (template.get("primaryPodLabels") or {}) != {"training.kubeflow.org/job-role": "launcher"}:
        errors.append("trialTemplate.primaryPodLabels must select the launcher: "
                      "{training.kubeflow.org/job-role: launcher} (MPIJob v2beta1's label)")
    for success in ("successCondition", "failureCondition"):
        if not template.get(success):
            errors.append(f"trialTemplate.{success}: required for an MPIJob trial")
    errors += [f"trial MPIJob {e}" for e in document_errors([job], crds, train_help_flags, extra_docs=docs)]
    return errors
