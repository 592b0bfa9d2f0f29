#!/usr/bin/env python3
# Prometheus metrics on Kubernetes (k8s/components/monitoring, the monitoring
# overlay): the overlay renders and validates (MPIJob against its CRD, the
# PodMonitor against prometheus-operator's, vendored in k8s/schemas); the
# worker declares port 9500 named `metrics` and tessera gets --metrics-port
# 9500; the PodMonitor selects the pod of rank 0 (worker 0) and nothing else;
# the component composes with other overlays and survives k8s/render --name;
# broken PodMonitors are rejected with a message naming them; the Grafana
# dashboard parses, every panel has a query, every tessera_* name in a query is
# one that tessera serves (the list of docs/metrics.md, "Prometheus"), no
# panel reads DCGM exporter's series (tessera_gpu_* are the ranks' own), and
# rank filters are only on series that carry a rank. With a tessera that has
# --metrics-port, a short run is scraped for real.
import copy
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import unittest
import urllib.request
from pathlib import Path

import yaml

import k8s_test_support as support
from k8s_test_support import k8scheck

SCHEMAS = support.require_schemas()
KUBECTL = support.require_kubectl()
OVERLAY = k8scheck.OVERLAYS / "monitoring"
COMPONENT = k8scheck.K8S / "components" / "monitoring"
DASHBOARD = COMPONENT / "tessera-dashboard.json"
RENDERED = k8scheck.render(OVERLAY, KUBECTL)
PORT = 9500
PODMONITOR = ("monitoring.coreos.com/v1", "PodMonitor")

# What `tessera train --metrics-port` serves (rank 0, every rank's series with
# rank="<r>" and node="<its host>" unless said otherwise): name -> (type,
# labels besides rank and node).
METRICS = {
    "tessera_step": ("gauge", set()),
    "tessera_loss": ("gauge", set()),
    "tessera_learning_rate": ("gauge", set()),
    "tessera_tokens_per_second": ("gauge", set()),
    "tessera_samples_per_second": ("gauge", set()),
    "tessera_step_seconds": ("gauge", set()),
    "tessera_data_wait_seconds": ("gauge", set()),
    "tessera_grad_norm": ("gauge", set()),
    "tessera_skipped_steps_total": ("counter", set()),
    "tessera_comm_bytes_total": ("counter", {"axis"}),
    "tessera_comm_seconds_total": ("counter", {"axis"}),
    "tessera_checkpoint_stall_seconds_total": ("counter", set()),
    "tessera_checkpoint_write_seconds": ("gauge", set()),
    "tessera_memory_allocated_bytes": ("gauge", {"device"}),
    "tessera_memory_reserved_bytes": ("gauge", {"device"}),
    "tessera_memory_peak_bytes": ("gauge", {"device"}),
    "tessera_eval_loss": ("gauge", set()),
    "tessera_straggler_rank": ("gauge", set()),
    "tessera_straggler_slowdown_ratio": ("gauge", set()),
    "tessera_rank_compute_seconds": ("gauge", set()),
    "tessera_rank_communication_seconds": ("gauge", set()),
    "tessera_gpu_utilization_ratio": ("gauge", {"gpu"}),
    "tessera_gpu_memory_used_bytes": ("gauge", {"gpu"}),
    "tessera_gpu_memory_total_bytes": ("gauge", {"gpu"}),
    "tessera_gpu_power_watts": ("gauge", {"gpu"}),
    "tessera_gpu_temperature_celsius": ("gauge", {"gpu"}),
    "tessera_gpu_sm_clock_hertz": ("gauge", {"gpu"}),
    "tessera_gpu_memory_clock_hertz": ("gauge", {"gpu"}),
    "tessera_info": ("gauge", {"version", "model", "layout", "job_id"}),
    # --num-experts runs only: the whole job's figures of the last step, per mixture-of-experts block.
    "tessera_moe_expert_tokens": ("gauge", {"layer", "stat"}),
    "tessera_moe_imbalance": ("gauge", {"layer"}),
    "tessera_moe_aux_loss": ("gauge", set()),
    "tessera_moe_z_loss": ("gauge", set()),
    "tessera_moe_dropped_fraction": ("gauge", set()),
}
MOE = {name for name in METRICS if name.startswith("tessera_moe_")}
WITHOUT_RANK = {"tessera_straggler_rank", "tessera_straggler_slowdown_ratio"} | MOE
# One series for the job, with or without a rank label: panels must not filter them by rank.
RANK_OPTIONAL = {"tessera_eval_loss", "tessera_info"}
# Labels only Prometheus (its scrape configuration) or the Pushgateway (its grouping key) attach.
SCRAPE_LABELS = {"namespace", "job", "instance"}


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def job_of(docs):
    return of_kind(docs, "MPIJob")[0]


def monitor_of(docs):
    return of_kind(docs, "PodMonitor")[0]


def worker_container(job):
    return k8scheck.container0(k8scheck.replica_specs(job)[1])


def errors_of(docs, train_flags=None):
    return k8scheck.document_errors(docs, SCHEMAS["mpijob"], train_flags)


def broken(change, docs=RENDERED):
    """A deep copy of `docs` with change(podmonitor, job) applied."""
    docs = copy.deepcopy(docs)
    change(monitor_of(docs), job_of(docs))
    return docs


def render_with_component(resource):
    """`resource` (an overlay) plus the component, in a kustomization of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(resource, tmp)], "components": [os.path.relpath(COMPONENT, tmp)]}))
        return k8scheck.render(Path(tmp), KUBECTL)


class TheOverlay(unittest.TestCase):
    def test_renders_the_job_and_the_component_objects(self):
        self.assertEqual(sorted(d["kind"] for d in RENDERED),
                         ["ConfigMap", "ConfigMap", "MPIJob", "PersistentVolumeClaim", "PodMonitor"])

    def test_validates_mpijob_and_podmonitor_against_their_crds(self):
        errors = errors_of(RENDERED)
        self.assertEqual(errors, [], "\n".join(errors))
        # The PodMonitor was checked against the vendored CRD (not skipped for want of a schema).
        crds = k8scheck.bundled_crds()
        self.assertIn(PODMONITOR, crds)
        self.assertIn("podMetricsEndpoints", crds[PODMONITOR]["openapi"]["properties"]["spec"]["properties"])
        self.assertEqual(k8scheck.schema_errors(monitor_of(RENDERED), crds[PODMONITOR]), [])

    def test_the_validate_command_accepts_it(self):
        result = subprocess.run([sys.executable, str(k8scheck.K8S / "validate"), str(OVERLAY)],
                                capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("PodMonitor/tessera", result.stdout)

    def test_worker_declares_the_metrics_port_and_tessera_serves_on_it(self):
        job = job_of(RENDERED)
        ports = worker_container(job)["ports"]
        self.assertIn({"name": "metrics", "containerPort": PORT, "protocol": "TCP"}, ports)
        self.assertIn({"name": "ssh", "containerPort": 2222}, ports)  # the base's port is kept
        launcher = k8scheck.container0(k8scheck.replica_specs(job)[0])
        _, rank_command = k8scheck.mpirun_options(k8scheck.command_line(launcher))
        self.assertEqual(rank_command[-4:], ["--config", "/etc/tessera/train.toml", "--metrics-port", str(PORT)])
        flags, problems = k8scheck.train_settings(job, RENDERED)
        self.assertEqual((flags["--metrics-port"], problems), (str(PORT), []))
        # Not also in train.toml, where a second value could disagree.
        configmap = next(d for d in of_kind(RENDERED, "ConfigMap") if d["metadata"]["name"] == "tessera-train-config")
        self.assertNotIn("metrics-port", tomllib.loads(configmap["data"]["train.toml"]))

    def test_podmonitor_selects_worker_0_only(self):
        job, monitor = job_of(RENDERED), monitor_of(RENDERED)
        spec = monitor["spec"]
        # Worker 0's labels written out by hand: the template's, then the operator's.
        template = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
        worker0 = {**template, "training.kubeflow.org/operator-name": "mpi-operator",
                   "training.kubeflow.org/job-name": "tessera-train", "training.kubeflow.org/job-role": "worker",
                   "training.kubeflow.org/replica-index": "0"}
        self.assertNotIn("matchExpressions", spec["selector"])
        self.assertLessEqual(spec["selector"]["matchLabels"].items(), worker0.items())
        self.assertEqual(k8scheck.pod_labels(job, "Worker", 0), worker0)
        self.assertTrue(k8scheck.selector_matches(spec["selector"], worker0))
        self.assertFalse(k8scheck.selector_matches(spec["selector"], k8scheck.pod_labels(job, "Worker", 1)))
        self.assertFalse(k8scheck.selector_matches(spec["selector"], k8scheck.pod_labels(job, "Launcher")))
        self.assertEqual(spec["jobLabel"], "training.kubeflow.org/job-name")
        [endpoint] = spec["podMetricsEndpoints"]
        self.assertEqual((endpoint["port"], endpoint["path"], endpoint["interval"]), ("metrics", "/metrics", "15s"))
        self.assertIn({"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"},
                      endpoint["relabelings"])
        # The series carry their own `node` and `rank`: a target label of either name would rename theirs.
        self.assertEqual({r.get("targetLabel") for r in endpoint["relabelings"]} & {"node", "rank"}, set())
        self.assertEqual(monitor["metadata"]["labels"]["release"], "kube-prometheus-stack")

    def test_the_component_composes_with_other_overlays(self):
        for overlay in ("gpu", "roce"):
            with self.subTest(overlay=overlay):
                docs = render_with_component(k8scheck.OVERLAYS / overlay)
                errors = errors_of(docs)
                self.assertEqual(errors, [], "\n".join(errors))
                job = job_of(docs)
                self.assertTrue(k8scheck.selector_matches(monitor_of(docs)["spec"]["selector"],
                                                          k8scheck.pod_labels(job, "Worker", 0)))
        # roce's pod annotation (the Multus network) survives the component's label patch.
        metadata = job_of(render_with_component(k8scheck.OVERLAYS / "roce"))["spec"]["mpiReplicaSpecs"]["Worker"][
            "template"]["metadata"]
        self.assertEqual(metadata["annotations"]["k8s.v1.cni.cncf.io/networks"], "roce-net")
        self.assertEqual(metadata["labels"]["app.kubernetes.io/name"], "tessera")

    def test_the_component_inside_roce_is_caught(self):
        """Listed in roce's own components, the component runs before roce's patch that
        replaces the worker template's metadata: the label goes, and the validator says so."""
        roce = yaml.safe_load((k8scheck.OVERLAYS / "roce" / "kustomization.yaml").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            roce["resources"] = [os.path.relpath(k8scheck.OVERLAYS / "gpu", tmp)]
            roce["components"] = [os.path.relpath(k8scheck.K8S / "components" / "rdma", tmp),
                                  os.path.relpath(COMPONENT, tmp)]
            Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(roce))
            docs = k8scheck.render(Path(tmp), KUBECTL)
        self.assertTrue(any(e.startswith("PodMonitor/tessera .spec.selector:") and "selects the pod of rank 0 of no "
                            "MPIJob here" in e for e in errors_of(docs)), errors_of(docs))

    def test_render_renames_the_job_and_the_podmonitor_still_finds_it(self):
        result = subprocess.run([sys.executable, str(k8scheck.K8S / "render"), "monitoring", "--workers", "3",
                                 "--name", "smoke", "--namespace", "ml"], capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        docs = k8scheck.load_yaml_documents(result.stdout)
        job, monitor = job_of(docs), monitor_of(docs)
        self.assertEqual((job["metadata"]["name"], monitor["metadata"]["namespace"]), ("smoke", "ml"))
        self.assertTrue(k8scheck.selector_matches(monitor["spec"]["selector"], k8scheck.pod_labels(job, "Worker", 0)))
        self.assertEqual(errors_of(docs), [])


class BrokenPodMonitors(unittest.TestCase):
    def assertRejected(self, docs, expected):
        errors = errors_of(docs)
        self.assertTrue(any(expected in e for e in errors), f"expected {expected!r} among:\n" + "\n".join(errors))

    def test_a_port_name_no_container_has(self):
        docs = broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].update(port="metric"))
        self.assertRejected(docs, "PodMonitor/tessera .spec.podMetricsEndpoints[0].port: no container of "
                                  "MPIJob/tessera-train's worker pods declares a port named 'metric'")

    def test_fields_of_the_wrong_type_and_unknown_fields(self):
        self.assertRejected(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].update(interval=15)),
                            "PodMonitor/tessera .spec.podMetricsEndpoints[0].interval: 15 is not of type 'string'")
        self.assertRejected(broken(lambda m, j: m["spec"].update(
            podMetricEndpoints=m["spec"].pop("podMetricsEndpoints"))), "'podMetricEndpoints' was unexpected")
        self.assertRejected(broken(lambda m, j: m["spec"].pop("selector")),
                            "PodMonitor/tessera .spec: 'selector' is a required property")
        self.assertRejected(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0]["relabelings"][0].update(
            action="Copy")), "PodMonitor/tessera .spec.podMetricsEndpoints[0].relabelings[0].action")

    def test_a_selector_that_misses_rank_0(self):
        self.assertRejected(broken(lambda m, j: m["spec"]["selector"]["matchLabels"].update(
            {"training.kubeflow.org/replica-index": "1"})), "selects the pod of rank 0 of no MPIJob here")
        self.assertRejected(broken(lambda m, j: m["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/name": "tesera"})), "selects the pod of rank 0 of no MPIJob here")
        # The job's template lost the label the selector relies on.
        self.assertRejected(broken(lambda m, j: j["spec"]["mpiReplicaSpecs"]["Worker"]["template"].pop("metadata")),
                            "selects the pod of rank 0 of no MPIJob here")
        self.assertRejected(broken(lambda m, j: m["spec"].update(selector={"matchLabels": {
            "training.kubeflow.org/job-name": "tessera-train"}})), "selects the launcher pod of MPIJob/tessera-train")

    def test_the_port_tessera_serves_on(self):
        def other_flag(monitor, job):
            args = k8scheck.container0(k8scheck.replica_specs(job)[0])["args"]
            args[args.index("--metrics-port") + 1] = "9600"
        docs = broken(other_flag)
        self.assertRejected(docs, "port 'metrics' is 9500, but tessera serves /metrics on --metrics-port 9600")
        self.assertRejected(docs, "the worker container declares no containerPort 9600")

        def no_flag(monitor, job):
            args = k8scheck.container0(k8scheck.replica_specs(job)[0])["args"]
            del args[args.index("--metrics-port"):]
        self.assertRejected(broken(no_flag), "runs tessera train without --metrics-port")

        def ssh_port(monitor, job):
            args = k8scheck.container0(k8scheck.replica_specs(job)[0])["args"]
            args[args.index("--metrics-port") + 1] = "2222"
        self.assertRejected(broken(ssh_port), "is the port of the workers' sshd")
        self.assertRejected(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].update(
            port=None, portNumber=9501)), "port 9501 is not declared")

    def test_endpoint_rules(self):
        self.assertRejected(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].pop("port")),
                            "names no port, so Prometheus scrapes every declared port (ssh=2222, metrics=9500)")
        self.assertRejected(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].update(path="/stats")),
                            ".path: '/stats', but tessera serves /metrics")
        self.assertRejected(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].update(scheme="HTTPS")),
                            "tessera serves plain HTTP")
        self.assertRejected(broken(lambda m, j: m["spec"].update(jobLabel="training.kubeflow.org/job")),
                            "is not a label of MPIJob/tessera-train's rank-0 pod")

    def test_a_podmonitor_alone_gets_the_schema_check_only(self):
        monitor = monitor_of(RENDERED)
        self.assertEqual(errors_of([monitor]), [])
        bad = copy.deepcopy(monitor)
        bad["spec"]["podMetricsEndpoints"][0]["port"] = 9500
        self.assertIn("PodMonitor/tessera .spec.podMetricsEndpoints[0].port: 9500 is not of type 'string'",
                      errors_of([bad]))

    def test_label_selectors(self):
        labels = {"a": "1", "b": "2"}
        self.assertTrue(k8scheck.selector_matches({}, labels))
        self.assertTrue(k8scheck.selector_matches({"matchExpressions": [
            {"key": "a", "operator": "In", "values": ["1", "3"]}, {"key": "b", "operator": "NotIn", "values": ["3"]},
            {"key": "b", "operator": "Exists"}, {"key": "c", "operator": "DoesNotExist"}]}, labels))
        for expression in ({"key": "a", "operator": "In", "values": ["3"]},
                           {"key": "a", "operator": "NotIn", "values": ["1"]},
                           {"key": "c", "operator": "Exists"}, {"key": "a", "operator": "DoesNotExist"}):
            with self.subTest(expression=expression):
                self.assertFalse(k8scheck.selector_matches({"matchExpressions": [expression]}, labels))
        self.assertFalse(k8scheck.selector_matches({"matchLabels": {"a": "2"}}, labels))

    def test_the_validate_command_rejects_and_takes_another_crd(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp, "bad.yaml")
            bad.write_text(yaml.safe_dump_all(broken(lambda m, j: m["spec"]["podMetricsEndpoints"][0].update(
                port="metric"))))
            validate = [sys.executable, str(k8scheck.K8S / "validate")]
            result = subprocess.run(validate + [str(bad)], capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
            self.assertIn("PodMonitor/tessera .spec.podMetricsEndpoints[0].port", result.stdout)
            # --podmonitor-crd wins over the vendored CRD: one whose spec knows no podMetricsEndpoints.
            crd = yaml.safe_load(Path(k8scheck.BUNDLED_SCHEMAS, "podmonitor-v1-crd.yaml").read_text())
            del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
                "podMetricsEndpoints"]
            Path(tmp, "crd.yaml").write_text(yaml.safe_dump(crd))
            result = subprocess.run(validate + ["--podmonitor-crd", str(Path(tmp, "crd.yaml")), str(OVERLAY)],
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
            self.assertIn("'podMetricsEndpoints' was unexpected", result.stdout)
            result = subprocess.run(validate + ["--podmonitor-crd", str(Path(tmp, "absent.yaml")), str(OVERLAY)],
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 2)


def dashboard_queries(dashboard):
    """[(panel title, expr)] of every panel that is not a row."""
    return [(panel["title"], target.get("expr", "")) for panel in dashboard["panels"] if panel["type"] != "row"
            for target in panel.get("targets") or [{}]]


def selectors(expr):
    """[(metric name, {label: (operator, value)})] of every `name{...}` in a PromQL expression."""
    found = []
    for match in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        matchers = {m.group(1): (m.group(2), m.group(3))
                    for m in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"', match.group(2))}
        found.append((match.group(1), matchers))
    return found


class Dashboard(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.text = DASHBOARD.read_text()
        cls.dashboard = json.loads(cls.text)
        cls.queries = dashboard_queries(cls.dashboard)

    def test_every_panel_has_a_query_on_the_datasource_variable(self):
        panels = [p for p in self.dashboard["panels"] if p["type"] != "row"]
        self.assertGreaterEqual(len(panels), 12)
        for panel in panels:
            with self.subTest(panel=panel["title"]):
                self.assertTrue(panel.get("targets"))
                for target in panel["targets"]:
                    self.assertTrue(target.get("expr", "").strip())
                    self.assertEqual(target["datasource"], {"type": "prometheus", "uid": "${datasource}"})
                    self.assertEqual(target["expr"].count("("), target["expr"].count(")"))
                    self.assertEqual(target["expr"].count("{"), target["expr"].count("}"))
                self.assertEqual(panel["datasource"]["uid"], "${datasource}")

    def test_metric_names_are_the_ones_tessera_serves_and_all_are_shown(self):
        used = {name for _, expr in self.queries for name in re.findall(r"\btessera_[a-z0-9_]+", expr)}
        self.assertEqual(used - set(METRICS), set(), "not served by tessera")
        self.assertEqual(set(METRICS) - used, set(), "served but on no panel")
        # The GPU panels read the ranks' own tessera_gpu_* series, not DCGM exporter's.
        self.assertFalse(any("DCGM_" in expr for _, expr in self.queries))

    def test_label_filters_fit_the_series(self):
        for title, expr in self.queries:
            for name, matchers in selectors(expr):
                if not name.startswith("tessera_"):
                    continue
                with self.subTest(panel=title, metric=name):
                    labels = SCRAPE_LABELS | METRICS[name][1]
                    if name not in WITHOUT_RANK | RANK_OPTIONAL:
                        labels |= {"rank", "node"}
                    # A rank filter on a series without a rank label would empty the panel
                    # as soon as one rank is picked.
                    self.assertLessEqual(set(matchers), labels)
                    self.assertEqual(matchers.get("job"), ("=~", "$job"))
        self.assertTrue(any(("rank", ("=~", "$rank")) in m.items() for _, e in self.queries
                            for _, m in selectors(e)))

    def test_counters_are_shown_as_rates_or_totals_only(self):
        for title, expr in self.queries:
            for name in re.findall(r"\btessera_[a-z0-9_]+_total\b", expr):
                with self.subTest(panel=title, metric=name):
                    self.assertRegex(expr, rf"(rate|increase|max)\(\s*{name}\b")

    def test_variables(self):
        variables = {v["name"]: v for v in self.dashboard["templating"]["list"]}
        self.assertEqual((variables["datasource"]["type"], variables["datasource"]["query"]),
                         ("datasource", "prometheus"))
        for name in ("job", "instance", "namespace", "rank"):
            with self.subTest(variable=name):
                self.assertEqual(variables[name]["type"], "query")
                self.assertEqual(variables[name]["datasource"]["uid"], "${datasource}")
                self.assertIn(f", {name})", variables[name]["query"])
        # Every variable a query uses is defined.
        for _, expr in self.queries:
            self.assertLessEqual(set(re.findall(r"\$([a-z_]+)", expr)) - {"__rate_interval"}, set(variables))

    def test_panels_do_not_overlap(self):
        cells = {}
        for panel in self.dashboard["panels"]:
            grid = panel["gridPos"]
            self.assertLessEqual(grid["x"] + grid["w"], 24, panel["title"])
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    self.assertNotIn((x, y), cells, f"{panel['title']} overlaps {cells.get((x, y))}")
                    cells[(x, y)] = panel["title"]
        ids = [p["id"] for p in self.dashboard["panels"]]
        self.assertEqual(len(ids), len(set(ids)))

    def test_the_configmap_carries_it_for_grafanas_sidecar(self):
        configmap = next(d for d in of_kind(RENDERED, "ConfigMap")
                         if d["metadata"]["name"] == "tessera-grafana-dashboard")
        self.assertEqual(configmap["metadata"]["labels"]["grafana_dashboard"], "1")
        self.assertEqual(json.loads(configmap["data"]["tessera-dashboard.json"]), self.dashboard)

    def test_docs_list_every_metric(self):
        text = (k8scheck.REPO / "docs" / "metrics.md").read_text()
        self.assertIn("\n## Prometheus\n", text)
        section = text.split("\n## Prometheus\n", 1)[1].split("\n## ", 1)[0]
        listed = set(re.findall(r"`(tessera_[a-z0-9_]+)", section))
        self.assertEqual(listed, set(METRICS))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_exposition(text):
    """Prometheus text format -> ({name: type}, [(name, {label: value}, value)])."""
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?', line)
            if match is None:
                raise AssertionError(f"not a sample line: {line!r}")
            labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return types, samples


class Served(unittest.TestCase):
    """A short CPU run of the real tessera with --metrics-port, scraped while it trains."""

    def test_a_run_serves_the_documented_metrics(self):
        binary = support.tessera_binary()
        if not Path(binary).is_file():
            support.missing(f"no tessera binary at {binary} (build first, or set TESSERA_BINARY)")
        if "--metrics-port" not in k8scheck.tessera_train_flags(binary):
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                self.fail(f"{binary} train has no --metrics-port, which components/monitoring passes")
            self.skipTest(f"{binary} train has no --metrics-port yet")
        configmap = next(d for d in of_kind(RENDERED, "ConfigMap") if d["metadata"]["name"] == "tessera-train-config")
        settings = tomllib.loads(configmap["data"]["train.toml"])
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp, "text.txt")
            text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
            subprocess.run([binary, "prepare", "text", "-o", f"{tmp}/fortunes.h5", str(text)], check=True,
                           capture_output=True, timeout=60)
            for key in ("data", "eval-data", "save", "metrics"):
                settings[key] = tmp + "/" + Path(settings[key]).name
            settings.update({"train-steps": 100000, "log-interval": 1, "eval-interval": 2, "eval-iters": 1,
                             "save-interval": 0})
            lines = [f"{k} = {json.dumps(v) if isinstance(v, str) else str(v).lower()}" for k, v in settings.items()]
            Path(tmp, "train.toml").write_text("\n".join(lines) + "\n")
            log = open(Path(tmp, "log.txt"), "w")  # a file, not a pipe: a full pipe would stop the training
            process = subprocess.Popen([binary, "train", "--config", f"{tmp}/train.toml", "--threads", "1",
                                        "--metrics-port", str(port)], cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
            body = ""
            try:
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and process.poll() is None:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                            self.assertEqual(response.status, 200)
                            body = response.read().decode()
                        # Done once an evaluation has run (a number, not the NaN served before).
                        if re.search(r"^tessera_eval_loss(\{[^}]*\})? [-+]?[0-9.]", body, re.M):
                            break
                    except OSError:
                        pass
                    time.sleep(0.5)
            finally:
                process.terminate()  # SIGTERM: tessera stops at the step's end (a checkpoint into tmp)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=30)
                log.close()
                output = Path(tmp, "log.txt").read_text(errors="replace")
        self.assertTrue(body, "nothing served on /metrics; tessera's output:\n" + output[-3000:])
        types, samples = parse_exposition(body)
        names = {name for name, _, _ in samples}
        self.assertEqual({n for n in names if n.startswith("tessera_")} - set(METRICS), set(),
                         "served but not documented (docs/metrics.md) nor known to the dashboard")
        self.assertLessEqual({"tessera_step", "tessera_loss", "tessera_info", "tessera_eval_loss",
                              "tessera_comm_seconds_total"}, names)
        # A CPU rank has no GPU to read: no tessera_gpu_* series at all.
        self.assertEqual({n for n in names if n.startswith("tessera_gpu_")}, set())
        for name, kind in types.items():
            if name in METRICS:
                self.assertEqual(kind, METRICS[name][0], name)
        for name, labels, _ in samples:
            if name not in METRICS:
                continue
            with self.subTest(metric=name, labels=labels):
                expected = set(METRICS[name][1])
                if name in RANK_OPTIONAL:
                    expected |= {"rank"} & set(labels)
                elif name not in WITHOUT_RANK:
                    expected |= {"rank", "node"}
                self.assertEqual(set(labels), expected)
                # Prometheus would rename a target's own job or instance to exported_job, exported_instance.
                self.assertEqual(set(labels) & SCRAPE_LABELS, set())
                if "rank" in labels:
                    self.assertEqual(labels["rank"], "0")  # one process: rank 0 only
                if "node" in labels:
                    self.assertEqual(labels["node"], socket.gethostname())
                if "axis" in labels:
                    self.assertIn(labels["axis"], ("dp", "tp", "pp"))


if __name__ == "__main__":
    support.run_tests()
