#!/usr/bin/env python3
# The validator itself (k8s/tools/k8scheck.py): it must reject deliberately
# broken manifests (a misspelled field, a wrong type, a bad enum, duplicate
# list-map keys, a launcher with 2 replicas, restartPolicy Always, a name too
# long for the worker pods, -np that does not match, GPUs that do not, RDMA
# without IPC_LOCK, ...) and accept what the API server accepts (nulls it
# prunes, int-or-string quantities). Also the CRD-to-JSON-Schema conversion on
# a small hand-written CRD, the k8s/validate command's exit status, and Katib
# Experiments broken in the ways the Katib checks look for.
import copy
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import yaml

import k8s_test_support as support
from k8s_test_support import k8scheck

SCHEMAS = support.require_schemas()
KUBECTL = support.require_kubectl()
GOOD = k8scheck.render(k8scheck.OVERLAYS / "gpu", KUBECTL)
RDMA = k8scheck.render(k8scheck.OVERLAYS / "rdma-ib", KUBECTL)
KATIB = k8scheck.render(k8scheck.K8S / "katib", KUBECTL)


def errors_of(docs):
    return k8scheck.document_errors(docs, SCHEMAS["mpijob"], swagger=SCHEMAS["swagger"])


def broken(docs, change):
    """A deep copy of `docs` with `change(job)` applied to the MPIJob (or Experiment)."""
    docs = copy.deepcopy(docs)
    target = next(d for d in docs if d["kind"] in ("MPIJob", "Experiment"))
    change(target)
    return docs


def worker(job):
    return job["spec"]["mpiReplicaSpecs"]["Worker"]


def worker_container(job):
    return worker(job)["template"]["spec"]["containers"][0]


def launcher_container(job):
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


class SchemaConversion(unittest.TestCase):
    CRD = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "names": {"kind": "Widget", "plural": "widgets"}, "scope": "Namespaced",
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object",
                     "properties": {
                         "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                         "metadata": {"type": "object"},
                         "spec": {"type": "object", "required": ["size"], "properties": {
                             "size": {"type": "integer", "minimum": 1},
                             "port": {"x-kubernetes-int-or-string": True,
                                      "anyOf": [{"type": "integer"}, {"type": "string"}]},
                             "note": {"type": "string", "nullable": True},
                             "mode": {"type": "string", "enum": ["a", "b"]},
                             "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                             "items": {"type": "array", "x-kubernetes-list-type": "map",
                                       "x-kubernetes-list-map-keys": ["name"],
                                       "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
                         }}}}}}]}}

    def setUp(self):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(self.CRD, f)
        self.entry = k8scheck.load_crd(Path(f.name))[("example.com/v1", "Widget")]
        Path(f.name).unlink()

    def errors(self, spec):
        return k8scheck.schema_errors({"apiVersion": "example.com/v1", "kind": "Widget",
                                       "metadata": {"name": "w"}, "spec": spec}, self.entry)

    def test_valid(self):
        self.assertEqual(self.errors({"size": 2, "port": "http", "note": None, "mode": "a",
                                      "free": {"anything": [1, {"x": 2}]}, "items": [{"name": "p"}, {"name": "q"}]}),
                         [])
        self.assertEqual(self.errors({"size": 2, "port": 8080}), [])

    def test_unknown_field_rejected(self):
        self.assertIn("'sise' was unexpected", "\n".join(self.errors({"size": 2, "sise": 3})))

    def test_wrong_type_missing_field_bad_enum_and_minimum(self):
        self.assertIn("'2' is not of type 'integer'", "\n".join(self.errors({"size": "2"})))
        self.assertIn("'size' is a required property", "\n".join(self.errors({"port": 1})))
        self.assertIn("is not one of ['a', 'b']", "\n".join(self.errors({"size": 1, "mode": "c"})))
        self.assertIn("less than the minimum", "\n".join(self.errors({"size": 0})))
        self.assertIn("is not valid under any of the given schemas", "\n".join(self.errors({"size": 1, "port": 1.5})))

    def test_nulls_of_non_nullable_fields_are_pruned_like_the_api_server_does(self):
        self.assertEqual(self.errors({"size": 1, "mode": None}), [])

    def test_duplicate_list_map_keys_rejected(self):
        self.assertIn("duplicate entry", "\n".join(self.errors({"size": 1, "items": [{"name": "p"}, {"name": "p"}]})))

    def test_metadata_checked(self):
        errors = k8scheck.schema_errors({"apiVersion": "example.com/v1", "kind": "Widget",
                                         "metadata": {"name": "Bad_Name", "labels": {"a": 1}, "lables": {}},
                                         "spec": {"size": 1}}, self.entry)
        text = "\n".join(errors)
        self.assertIn("not a DNS-1123 subdomain", text)
        self.assertIn("label values must be strings", text)
        self.assertIn("lables", text)


class BrokenMPIJobs(unittest.TestCase):
    def assertRejected(self, docs, expected):
        errors = errors_of(docs)
        self.assertTrue(any(expected in e for e in errors), f"expected {expected!r} among:\n" + "\n".join(errors))

    def test_the_good_ones_pass(self):
        self.assertEqual(errors_of(GOOD), [])
        self.assertEqual(errors_of(RDMA), [])

    def test_misspelled_field(self):
        self.assertRejected(broken(GOOD, lambda j: worker_container(j).update(
            readinesProbe=worker_container(j).pop("readinessProbe"))), "'readinesProbe' was unexpected")
        self.assertRejected(broken(GOOD, lambda j: j["spec"].update(slotPerWorker=4)), "'slotPerWorker' was unexpected")

    def test_wrong_types(self):
        self.assertRejected(broken(GOOD, lambda j: worker(j).update(replicas="2")), "'2' is not of type 'integer'")
        self.assertRejected(broken(GOOD, lambda j: launcher_container(j).update(args="-np 8")),
                            "is not of type 'array'")
        self.assertRejected(broken(GOOD, lambda j: worker_container(j)["resources"]["limits"].update(
            {"nvidia.com/gpu": "four"})), "limits")

    def test_bad_enum_and_duplicate_container(self):
        self.assertRejected(broken(GOOD, lambda j: j["spec"].update(mpiImplementation="OpenMPI5")), "is not one of")
        self.assertRejected(broken(GOOD, lambda j: worker(j)["template"]["spec"]["containers"].append(
            copy.deepcopy(worker_container(j)))), "duplicate entry")

    def test_operator_rules(self):
        self.assertRejected(broken(GOOD, lambda j: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(replicas=2)),
                            "Launcher.replicas: must be 1")
        self.assertRejected(broken(GOOD, lambda j: worker(j).update(restartPolicy="Always")),
                            "is not Never or OnFailure")
        self.assertRejected(broken(GOOD, lambda j: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(
            restartPolicy="ExitCode")), "is not Never or OnFailure")
        self.assertRejected(broken(GOOD, lambda j: j["metadata"].update(name="t" * 60)), "is not a DNS-1035 label")
        self.assertRejected(broken(GOOD, lambda j: j["metadata"].update(name="9lives")), "is not a DNS-1035 label")
        self.assertRejected(broken(GOOD, lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes")),
                            "cleanPodPolicy")
        self.assertRejected(broken(GOOD, lambda j: worker(j).update(replicas=0)), "Worker.replicas: must be >= 1")

    def test_np_must_be_workers_times_slots(self):
        self.assertRejected(broken(GOOD, lambda j: worker(j).update(replicas=3)), "mpirun -np 8 but workers")
        self.assertRejected(broken(GOOD, lambda j: j["spec"].update(slotsPerWorker=2)), "mpirun -np 8 but workers")

    def test_hostfile_wrapper_and_rank_wrapper_required(self):
        def drop_hostfile(job):
            args = launcher_container(job)["args"]
            del args[2:4]
        self.assertRejected(broken(GOOD, drop_hostfile), "--hostfile /etc/mpi/hostfile")

        def no_rank_wrapper(job):
            launcher_container(job)["args"].remove("/opt/tessera/bin/tessera-rank")
        self.assertRejected(broken(GOOD, no_rank_wrapper), "through /opt/tessera/bin/tessera-rank")
        self.assertRejected(broken(GOOD, lambda j: launcher_container(j).update(command=["mpirun"])),
                            "command must start with /opt/tessera/bin/tessera-mpirun")

    def test_gpus(self):
        self.assertRejected(broken(GOOD, lambda j: worker_container(j)["resources"]["requests"].update(
            {"nvidia.com/gpu": 2})), "must be equal")
        self.assertRejected(broken(GOOD, lambda j: (worker_container(j)["resources"]["requests"].update(
            {"nvidia.com/gpu": 2}), worker_container(j)["resources"]["limits"].update({"nvidia.com/gpu": 2}))),
            "but slotsPerWorker = 4")

        def no_gpus(job):
            for part in ("requests", "limits"):
                del worker_container(job)["resources"][part]["nvidia.com/gpu"]
        self.assertRejected(broken(GOOD, no_gpus), "--device cuda but the workers request no GPU")

    def test_rdma_needs_ipc_lock_root_and_shm(self):
        self.assertRejected(broken(RDMA, lambda j: worker_container(j).pop("securityContext")), "IPC_LOCK")
        self.assertRejected(broken(RDMA, lambda j: worker(j)["template"]["spec"]["securityContext"].update(
            runAsUser=1000)), "only takes effect for root")

        def no_shm(job):
            worker_container(job)["volumeMounts"] = [m for m in worker_container(job)["volumeMounts"]
                                                     if m["mountPath"] != "/dev/shm"]
        self.assertRejected(broken(RDMA, no_shm), "/dev/shm must be an emptyDir with medium Memory")
        self.assertRejected(broken(RDMA, lambda j: j["spec"].update(sshAuthMountPath="/home/mpiuser/.ssh")),
                            "sshAuthMountPath must be /root/.ssh")

    def test_environment_must_reach_the_ranks(self):
        self.assertRejected(broken(RDMA, lambda j: launcher_container(j)["args"].remove("NCCL_SOCKET_IFNAME")),
                            "NCCL_SOCKET_IFNAME is set but not forwarded")
        def forward_unset(job):
            launcher_container(job)["args"][4:4] = ["-x", "NCCL_FOO"]
        self.assertRejected(broken(GOOD, forward_unset), "mpirun -x NCCL_FOO but NCCL_FOO is set neither")
        self.assertRejected(broken(GOOD, lambda j: worker_container(j).setdefault("env", []).append(
            {"name": "NCCL_DEBUG", "value": "INFO"})), "never reaches the ranks")

    def test_checkpoints_resume_and_gang(self):
        configmap_broken = copy.deepcopy(GOOD)
        configmap = next(d for d in configmap_broken if d["kind"] == "ConfigMap")
        configmap["data"]["train.toml"] = configmap["data"]["train.toml"].replace('resume = "auto"', "")
        self.assertTrue(any("--resume auto" in e for e in errors_of(configmap_broken)))
        configmap["data"]["train.toml"] = configmap["data"]["train.toml"].replace(
            'save = "/data/checkpoints/tessera-train"', 'save = "/tmp/ckpt"') + 'resume = "auto"\n'
        self.assertTrue(any("--save /tmp/ckpt is not on a persistentVolumeClaim" in e
                            for e in errors_of(configmap_broken)))
        self.assertRejected(broken(GOOD, lambda j: j["spec"]["runPolicy"]["schedulingPolicy"].update(minAvailable=3)),
                            "minAvailable must be the worker count 2")
        self.assertRejected(broken(GOOD, lambda j: worker_container(j).pop("readinessProbe")),
                            "readinessProbe tcpSocket on port 2222")
        self.assertRejected(broken(GOOD, lambda j: worker_container(j).pop("lifecycle")), "preStop")

    def test_unknown_train_flag_in_the_config(self):
        docs = copy.deepcopy(GOOD)
        configmap = next(d for d in docs if d["kind"] == "ConfigMap")
        configmap["data"]["train.toml"] += "learning-rate = 0.1\n"
        errors = k8scheck.document_errors(docs, SCHEMAS["mpijob"], {"--config", "--model", "--save", "--resume"})
        self.assertTrue(any("tessera train has no flag --learning-rate" in e for e in errors), errors)


class BrokenKatib(unittest.TestCase):
    def assertRejected(self, change, expected):
        errors = errors_of(broken(KATIB, change))
        self.assertTrue(any(expected in e for e in errors), f"expected {expected!r} among:\n" + "\n".join(errors))

    def test_the_good_one_passes(self):
        self.assertEqual(errors_of(KATIB), [])

    def test_schema_of_the_experiment(self):
        self.assertRejected(lambda e: e["spec"].update(maxTrialCount="24"), "is not of type 'integer'")
        self.assertRejected(lambda e: e["spec"]["objective"].update(objectiveMetricNames=["eval_loss"]),
                            "'objectiveMetricNames' was unexpected")

    def test_katib_rules(self):
        self.assertRejected(lambda e: e["spec"]["objective"].update(type="minimise"), "is not minimize or maximize")
        self.assertRejected(lambda e: e["spec"]["parameters"][0]["feasibleSpace"].update(min="0"),
                            "a log distribution needs min > 0")
        self.assertRejected(lambda e: e["spec"]["trialTemplate"]["trialParameters"][0].update(reference="learning"),
                            "is neither a parameter nor trial metadata")
        self.assertRejected(lambda e: e["spec"]["trialTemplate"].update(primaryContainerName="training-container"),
                            "primaryContainerName")
        self.assertRejected(lambda e: e["spec"]["trialTemplate"].update(primaryPodLabels={"mpi-job-role": "launcher"}),
                            "primaryPodLabels")

        def unused(experiment):
            args = experiment["spec"]["trialTemplate"]["trialSpec"]["spec"]["mpiReplicaSpecs"]["Launcher"][
                "template"]["spec"]["containers"][0]["args"]
            index = args.index("--warmup-steps")
            del args[index:index + 2]
        self.assertRejected(unused, "warmupSteps is never used")

    def test_the_trial_is_checked_as_an_mpijob(self):
        def bad_trial(experiment):
            experiment["spec"]["trialTemplate"]["trialSpec"]["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 3
        self.assertRejected(bad_trial, "trial MPIJob MPIJob/tessera-gpt-tune-x7k2q9mz launcher: mpirun -np 2 but")


class ValidateCommand(unittest.TestCase):
    def run_validate(self, *args):
        return subprocess.run([sys.executable, str(k8scheck.K8S / "validate"), *args], capture_output=True,
                              text=True, timeout=120)

    def test_exit_status(self):
        with tempfile.TemporaryDirectory() as tmp:
            good, bad = Path(tmp, "good.yaml"), Path(tmp, "bad.yaml")
            good.write_text(yaml.safe_dump_all(GOOD))
            bad.write_text(yaml.safe_dump_all(broken(GOOD, lambda j: worker(j).update(replicas="2"))))
            result = self.run_validate(str(good))
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            result = self.run_validate(str(bad))
            self.assertEqual(result.returncode, 1)
            self.assertIn("'2' is not of type 'integer'", result.stdout)
            result = self.run_validate("--crd", str(Path(tmp, "absent.yaml")), str(good))
            self.assertEqual(result.returncode, 2)


if __name__ == "__main__":
    support.run_tests()
