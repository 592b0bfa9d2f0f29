#!/usr/bin/env python3
# k8s/render: an overlay rendered for N workers x G GPUs (or S CPU ranks) per
# worker keeps every number that must agree in step (-np, slotsPerWorker, GPU
# requests and limits, minAvailable, OMP_NUM_THREADS), renames consistently,
# validates its own output, and refuses shapes that cannot work.
import subprocess
import sys
import unittest

import yaml

import k8s_test_support as support
from k8s_test_support import k8scheck

SCHEMAS = support.require_schemas()
support.require_kubectl()
RENDER = str(k8scheck.K8S / "render")


def render(*args):
    result = subprocess.run([sys.executable, RENDER, *args], capture_output=True, text=True, timeout=120)
    docs = k8scheck.load_yaml_documents(result.stdout) if result.returncode == 0 else []
    return result, docs


def shape(docs):
    job = next(d for d in docs if d["kind"] == "MPIJob")
    launcher, worker = k8scheck.replica_specs(job)
    options, _ = k8scheck.mpirun_options(k8scheck.command_line(k8scheck.container0(launcher)))
    return job, int(options["-np"][0]), worker["replicas"], job["spec"]["slotsPerWorker"]


class Render(unittest.TestCase):
    def assertValid(self, docs):
        errors = k8scheck.document_errors(docs, SCHEMAS["mpijob"])
        self.assertEqual(errors, [], "\n".join(errors))

    def test_gpu_shape(self):
        result, docs = render("gpu", "--workers", "4", "--gpus-per-worker", "8")
        self.assertEqual(result.returncode, 0, result.stderr)
        job, np, workers, slots = shape(docs)
        self.assertEqual((np, workers, slots), (32, 4, 8))
        container = k8scheck.container0(k8scheck.replica_specs(job)[1])
        self.assertEqual(k8scheck.gpu_resources(container), {"nvidia.com/gpu": (8, 8)})
        self.assertEqual(job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"], 4)
        # 32 CPUs per worker shared by 8 ranks
        env = k8scheck.env_names(k8scheck.container0(k8scheck.replica_specs(job)[0]))
        self.assertEqual(env["OMP_NUM_THREADS"], "4")
        self.assertValid(docs)

    def test_every_gpu_overlay_takes_a_shape(self):
        for overlay in ("rdma-ib", "roce", "gang-volcano", "gang-scheduler-plugins", "kueue", "mig"):
            with self.subTest(overlay=overlay):
                result, docs = render(overlay, "--workers", "3", "--gpus-per-worker", "2")
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertEqual(shape(docs)[1:], (6, 3, 2))
                self.assertValid(docs)

    def test_cpu_shape_name_namespace_image(self):
        result, docs = render("cpu", "--workers", "3", "--slots", "2", "--name", "smoke", "--namespace", "ml",
                              "--image", "registry.example.com/team/tessera:cpu-7")
        self.assertEqual(result.returncode, 0, result.stderr)
        job, np, workers, slots = shape(docs)
        self.assertEqual((np, workers, slots), (6, 3, 2))
        self.assertEqual(job["metadata"]["name"], "smoke")
        self.assertTrue(all(d["metadata"]["namespace"] == "ml" for d in docs))
        configmap = next(d for d in docs if d["kind"] == "ConfigMap")
        self.assertEqual(configmap["metadata"]["name"], "smoke-config")
        self.assertIn('save = "/data/checkpoints/smoke"', configmap["data"]["train.toml"])
        self.assertIn('/data/runs/smoke/metrics.jsonl', configmap["data"]["train.toml"])
        images = {c["image"] for role in ("Launcher", "Worker")
                  for c in job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"].get("initContainers", [])
                  + job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]}
        self.assertEqual(images, {"registry.example.com/team/tessera:cpu-7"})
        env = k8scheck.env_names(k8scheck.container0(k8scheck.replica_specs(job)[0]))
        self.assertEqual(env["OMP_NUM_THREADS"], "1")  # 2 CPUs per worker, 2 ranks
        self.assertValid(docs)

    def test_output_is_plain_yaml_kubectl_can_read(self):
        result, _ = render("cpu")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("train.toml: |", result.stdout)  # scripts and settings stay readable blocks
        self.assertEqual(len(list(yaml.safe_load_all(result.stdout))), 3)

    def test_refusals(self):
        for args, message in ((["cpu", "--gpus-per-worker", "2"], "have no GPUs"),
                              (["gpu", "--slots", "3"], "give --gpus-per-worker"),
                              (["gpu", "--gpus-per-worker", "4", "--slots", "2"], "must equal --gpus-per-worker"),
                              (["gpu", "--workers", "0"], "at least 1"),
                              (["cpu", "--name", "x" * 60], "DNS-1035"),
                              (["no-such-overlay"], "no overlay")):
            with self.subTest(args=args):
                result, _ = render(*args)
                self.assertEqual(result.returncode, 1)
                self.assertIn(message, result.stderr)


if __name__ == "__main__":
    support.run_tests()
