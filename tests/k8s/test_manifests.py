#!/usr/bin/env python3
# Every overlay under k8s/overlays and the Katib Experiment rendered with
# `kubectl kustomize` and validated: MPIJob v2beta1 CRD schema with unknown
# fields rejected, the MPI Operator's rules, Tessera's consistency rules (-np =
# workers x slots, GPUs = slots, RDMA settings, shm, checkpoints on the shared
# volume, train flags known to the real `tessera train --help`), plus what each
# overlay is for, the PodGroups the operator would create for the gang
# overlays (validated against Volcano's and scheduler-plugins' CRDs), and the
# cpu overlay's train.toml accepted by the real tessera for a few steps. The
# monitoring overlay is validated here like the others (its PodMonitor too);
# what it adds is checked in test_monitoring.py.
import subprocess
import tempfile
import tomllib
import unittest
from pathlib import Path

import k8s_test_support as support
from k8s_test_support import k8scheck

SCHEMAS = support.require_schemas()
KUBECTL = support.require_kubectl()
TESSERA = support.require_tessera()
TRAIN_FLAGS = k8scheck.tessera_train_flags(TESSERA)
OVERLAYS = ["cpu", "gpu", "rdma-ib", "roce", "gang-volcano", "gang-scheduler-plugins", "kueue", "mig", "monitoring"]
# What an overlay adds besides the MPIJob, its ConfigMap and its PVC (monitoring: tests/k8s/test_monitoring.py).
EXTRA_KINDS = {"monitoring": ["ConfigMap", "PodMonitor"]}
RENDERED = {name: k8scheck.render(k8scheck.OVERLAYS / name, KUBECTL) for name in OVERLAYS}


def job_of(name):
    return next(d for d in RENDERED[name] if d["kind"] == "MPIJob")


def worker_container(job):
    return k8scheck.container0(k8scheck.replica_specs(job)[1])


def launcher_env(job):
    return k8scheck.env_names(k8scheck.container0(k8scheck.replica_specs(job)[0]))


class EveryOverlay(unittest.TestCase):
    def test_the_overlay_list_is_complete(self):
        self.assertEqual(sorted(OVERLAYS), sorted(p.name for p in k8scheck.OVERLAYS.iterdir() if p.is_dir()))

    def test_each_renders_and_validates(self):
        for name in OVERLAYS:
            with self.subTest(overlay=name):
                kinds = sorted(d["kind"] for d in RENDERED[name])
                self.assertEqual(kinds, sorted(["ConfigMap", "MPIJob", "PersistentVolumeClaim"]
                                               + EXTRA_KINDS.get(name, [])))
                errors = k8scheck.document_errors(RENDERED[name], SCHEMAS["mpijob"], TRAIN_FLAGS)
                self.assertEqual(errors, [], "\n".join(errors))

    def test_np_is_workers_times_slots(self):
        # Also checked inside document_errors; spelled out here for the record.
        for name in OVERLAYS:
            with self.subTest(overlay=name):
                job = job_of(name)
                options, _ = k8scheck.mpirun_options(k8scheck.command_line(
                    k8scheck.container0(k8scheck.replica_specs(job)[0])))
                workers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
                self.assertEqual(int(options["-np"][0]), workers * job["spec"].get("slotsPerWorker", 1))
                self.assertEqual(options["--hostfile"], ["/etc/mpi/hostfile"])

    def test_launcher_is_one_replica_and_restart_policies_are_allowed(self):
        for name in OVERLAYS:
            with self.subTest(overlay=name):
                specs = job_of(name)["spec"]["mpiReplicaSpecs"]
                self.assertEqual(specs["Launcher"]["replicas"], 1)
                self.assertEqual(specs["Launcher"]["restartPolicy"], "OnFailure")
                self.assertIn(specs["Worker"]["restartPolicy"], ("Never", "OnFailure"))


class WhatEachOverlayChanges(unittest.TestCase):
    def test_cpu_has_no_gpus_and_a_readwriteonce_volume(self):
        self.assertEqual(k8scheck.gpu_resources(worker_container(job_of("cpu"))), {})
        pvc = next(d for d in RENDERED["cpu"] if d["kind"] == "PersistentVolumeClaim")
        self.assertEqual(pvc["spec"]["accessModes"], ["ReadWriteOnce"])

    def test_gpu_requests_equal_limits_equal_slots_on_gpu_nodes(self):
        for name in ("gpu", "rdma-ib", "roce", "gang-volcano", "gang-scheduler-plugins", "kueue"):
            with self.subTest(overlay=name):
                job = job_of(name)
                resources = worker_container(job)["resources"]
                slots = job["spec"]["slotsPerWorker"]
                self.assertEqual(resources["requests"]["nvidia.com/gpu"], slots)
                self.assertEqual(resources["limits"]["nvidia.com/gpu"], slots)
                pod = k8scheck.pod_spec(k8scheck.replica_specs(job)[1])
                self.assertEqual(pod["nodeSelector"], {"nvidia.com/gpu.present": "true"})
                self.assertIn("nvidia.com/gpu", [t["key"] for t in pod["tolerations"]])
                self.assertTrue(worker_container(job)["image"].endswith(":cuda"))

    def test_rdma_overlays_have_ipc_lock_shm_and_the_hca_resource(self):
        for name in ("rdma-ib", "roce"):
            with self.subTest(overlay=name):
                job = job_of(name)
                container = worker_container(job)
                pod = k8scheck.pod_spec(k8scheck.replica_specs(job)[1])
                self.assertIn("IPC_LOCK", k8scheck.capabilities(container))
                self.assertEqual(pod["securityContext"]["runAsUser"], 0)
                self.assertEqual(job["spec"]["sshAuthMountPath"], "/root/.ssh")
                shm = k8scheck.volume_for("/dev/shm", k8scheck.volume_mounts(pod, container))
                self.assertEqual(shm[1]["emptyDir"]["medium"], "Memory")
                self.assertEqual(container["resources"]["limits"]["rdma/rdma_shared_device_a"], 1)
                self.assertEqual(launcher_env(job)["OMPI_ALLOW_RUN_AS_ROOT"], "1")

    def test_roce_has_the_multus_network_and_a_gid_index(self):
        job = job_of("roce")
        annotations = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"]
        self.assertEqual(annotations["k8s.v1.cni.cncf.io/networks"], "roce-net")
        self.assertEqual(launcher_env(job)["NCCL_IB_GID_INDEX"], "3")
        self.assertNotIn("NCCL_IB_GID_INDEX", launcher_env(job_of("rdma-ib")))  # IB: no GID index

    def test_gang_overlays_make_valid_podgroups_with_min_member_the_worker_count(self):
        cases = (("gang-volcano", "volcano", "volcano-podgroup-v1beta1-crd.yaml"),
                 ("gang-scheduler-plugins", "scheduler-plugins-scheduler",
                  "scheduler-plugins-podgroup-v1alpha1-crd.yaml"))
        for overlay, scheduler, crd_file in cases:
            with self.subTest(overlay=overlay):
                job = job_of(overlay)
                for role in ("Launcher", "Worker"):
                    self.assertEqual(job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["schedulerName"],
                                     scheduler)
                group = k8scheck.podgroup_for(job, "volcano" if scheduler == "volcano" else scheduler)
                self.assertEqual(group["spec"]["minMember"], job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"])
                crds = k8scheck.load_crd(SCHEMAS["dir"] / crd_file)
                errors = k8scheck.schema_errors(group, crds[(group["apiVersion"], "PodGroup")])
                self.assertEqual(errors, [], "\n".join(errors))
        self.assertEqual(job_of("gang-volcano")["spec"]["runPolicy"]["schedulingPolicy"]["queue"], "default")
        self.assertEqual(
            job_of("gang-scheduler-plugins")["spec"]["runPolicy"]["schedulingPolicy"]["scheduleTimeoutSeconds"], 600)

    def test_kueue_labels_the_job_with_its_queue(self):
        self.assertEqual(job_of("kueue")["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], "user-queue")

    def test_mig_requests_one_slice_per_rank(self):
        job = job_of("mig")
        resources = worker_container(job)["resources"]
        self.assertEqual(k8scheck.gpu_resources(worker_container(job)), {"nvidia.com/mig-3g.40gb": (1, 1)})
        self.assertNotIn("nvidia.com/gpu", resources["limits"])
        self.assertEqual(job["spec"]["slotsPerWorker"], 1)


class TrainSettings(unittest.TestCase):
    def test_cpu_overlay_settings_train_for_real(self):
        """The cpu overlay's train.toml, with the paths moved to a temporary
        directory and 3 steps, run by the real tessera."""
        configmap = next(d for d in RENDERED["cpu"] if d["kind"] == "ConfigMap")
        settings = tomllib.loads(configmap["data"]["train.toml"])
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp, "text.txt")
            text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
            subprocess.run([TESSERA, "prepare", "text", "-o", f"{tmp}/fortunes.h5", str(text)], check=True,
                           capture_output=True, timeout=60)
            for key in ("data", "eval-data", "save", "metrics"):
                settings[key] = tmp + "/" + Path(settings[key]).name
            settings.update({"train-steps": 3, "warmup-steps": 1, "eval-interval": 3, "eval-iters": 1, "save-interval": 0})
            lines = []
            for key, value in settings.items():
                value = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) \
                    else str(value)
                lines.append(f"{key} = {value}")
            Path(tmp, "train.toml").write_text("\n".join(lines) + "\n")
            result = subprocess.run([TESSERA, "train", "--config", f"{tmp}/train.toml", "--threads", "1"],
                                    capture_output=True, text=True, timeout=120, cwd=tmp)
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            # One human line per interval; Katib's name=value lines only where asked (the Katib trials).
            self.assertIn("eval step", result.stdout)
            self.assertEqual("eval_loss=" in result.stdout, bool(settings.get("katib-metrics")), result.stdout)
            self.assertTrue(Path(settings["save"], "latest").is_file())


    def test_launcher_init_container_prepares_the_data_once(self):
        """The launcher's init container script, /data moved to a temporary directory,
        run twice with the real tessera and the fortunes text (as in the image)."""
        if not Path("/usr/share/games/fortunes").is_dir():
            support.missing("no /usr/share/games/fortunes (Debian package fortunes; scripts/install-deps.sh)")
        pod = k8scheck.pod_spec(k8scheck.replica_specs(job_of("cpu"))[0])
        init = pod["initContainers"][0]
        self.assertEqual(init["command"], ["/bin/sh", "-c"])
        self.assertEqual(init["volumeMounts"], [{"name": "data", "mountPath": "/data"}])
        with tempfile.TemporaryDirectory() as tmp:
            script = init["args"][0].replace("/data/", f"{tmp}/")
            self.assertNotIn("/data", script)
            env = {"PATH": f"{Path(TESSERA).parent}:/usr/bin:/bin"}
            first = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=120, env=env)
            self.assertEqual(first.returncode, 0, first.stdout + first.stderr)
            self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), ["fortunes.eval.h5", "fortunes.h5"])
            second = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60, env=env)
            self.assertEqual(second.returncode, 0, second.stderr)
            self.assertIn("is there", second.stdout)


class Katib(unittest.TestCase):
    def test_experiment_and_its_trial_validate(self):
        docs = k8scheck.render(k8scheck.K8S / "katib", KUBECTL)
        self.assertEqual(sorted(d["kind"] for d in docs), ["ConfigMap", "Experiment"])
        errors = k8scheck.document_errors(docs, SCHEMAS["mpijob"], TRAIN_FLAGS, swagger=SCHEMAS["swagger"])
        self.assertEqual(errors, [], "\n".join(errors))

    def test_search_space_covers_lr_batch_and_warmup(self):
        docs = k8scheck.render(k8scheck.K8S / "katib", KUBECTL)
        experiment = next(d for d in docs if d["kind"] == "Experiment")
        names = {p["name"]: p for p in experiment["spec"]["parameters"]}
        self.assertEqual(set(names), {"lr", "micro-batch-size", "warmup-steps"})
        # Every searched parameter is a tessera train flag of the same name.
        self.assertTrue({f"--{n}" for n in names} <= TRAIN_FLAGS)
        self.assertEqual(names["lr"]["feasibleSpace"]["distribution"], "logUniform")


if __name__ == "__main__":
    support.run_tests()
