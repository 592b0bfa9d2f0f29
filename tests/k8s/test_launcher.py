#!/usr/bin/env python3
# The launcher's side of a Tessera MPIJob, run here without a cluster:
# k8s/image/tessera-mpirun around a stand-in mpirun (argument passing, exit
# statuses, SIGTERM -> SIGUSR1, waiting for the hostfile's hosts on a loopback
# port), then around the real mpirun and tessera, with each rank started
# through scripts/tessera-rank as in the manifests: SIGTERM to the launcher
# checkpoints and exits 143; a signal to one rank (a worker's preStop) exits
# 75; the same command again resumes and finishes with 0; and the launcher's
# output carries every metric the Katib Experiment reads, parsed with its own
# metricsFormat.
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest
from pathlib import Path

import yaml

import k8s_test_support as support

REPO = support.REPO
WRAPPER = str(REPO / "k8s" / "image" / "tessera-mpirun")
RANK_WRAPPER = str(REPO / "scripts" / "tessera-rank")
TESSERA = support.require_tessera()
MPIRUN = subprocess.run(["which", "mpirun"], capture_output=True, text=True).stdout.strip()

FAKE_MPIRUN = """#!/bin/bash
# Stands in for mpirun: prints its arguments, acts on the first one.
trap 'echo "stopping: SIGUSR1 received by rank 0; stopped after step 3"; exit 0' USR1
echo "args: $*"
case "$1" in
  fail) exit 3 ;;
  stopped) echo "stopping: SIGUSR1 received by rank 1; stopped after step 7; checkpoint x written"; exit 0 ;;
  interval) echo "stopping: --exit-interval 5 reached at step 5"; exit 0 ;;
  slow) for i in $(seq 100); do sleep 0.1; done ;;
esac
exit 0
"""


class Listener:
    """A TCP port on 127.0.0.1 that accepts connections (the workers' sshd stand-in)."""

    def __init__(self, delay=0.0):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, args=(delay,), daemon=True)
        self.thread.start()

    def serve(self, delay):
        time.sleep(delay)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", self.port))
            server.listen()
            server.settimeout(0.2)
            while not self.stop.is_set():
                try:
                    server.accept()[0].close()
                except socket.timeout:
                    pass

    def close(self):
        self.stop.set()
        self.thread.join(5)


class WithFakeMpirun(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.fake = Path(self.tmp.name, "mpirun")
        self.fake.write_text(FAKE_MPIRUN)
        self.fake.chmod(0o755)
        self.hostfile = Path(self.tmp.name, "hostfile")
        self.hostfile.write_text("# the operator's format\nlocalhost slots=2\n")
        self.env = dict(os.environ, TESSERA_MPIRUN=str(self.fake), TESSERA_WAIT_FOR_WORKERS="0")

    def tearDown(self):
        self.tmp.cleanup()

    def run_wrapper(self, *args, env=None, timeout=30):
        return subprocess.run([WRAPPER, *args], capture_output=True, text=True, timeout=timeout, env=env or self.env)

    def test_arguments_pass_through_and_statuses(self):
        result = self.run_wrapper("ok", "-np", "4", "--hostfile", str(self.hostfile), "a b")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"args: ok -np 4 --hostfile {self.hostfile} a b", result.stdout)
        self.assertEqual(self.run_wrapper("fail").returncode, 3)

    def test_ranks_stopped_by_a_signal_exit_75(self):
        result = self.run_wrapper("stopped")
        self.assertEqual(result.returncode, 75)
        self.assertIn("stopping: SIGUSR1 received by rank 1", result.stdout)  # still on stdout
        self.assertIn("exiting 75", result.stderr)
        # --exit-interval is a planned stop: status 0
        self.assertEqual(self.run_wrapper("interval").returncode, 0)

    def test_sigterm_becomes_sigusr1_and_exits_143(self):
        process = subprocess.Popen([WRAPPER, "slow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=self.env)
        start = time.monotonic()
        self.assertEqual(process.stdout.readline(), "args: slow\n")
        self.assertLess(time.monotonic() - start, 5, "output must stream, line by line, while mpirun runs")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
        self.assertEqual(process.returncode, 143)
        self.assertIn("stopping: SIGUSR1 received by rank 0", out)
        self.assertIn("every rank checkpoints and stops", err)

    def test_waits_for_the_hosts_port(self):
        listener = Listener(delay=1.5)
        try:
            env = dict(self.env, TESSERA_WAIT_FOR_WORKERS="30", TESSERA_SSH_PORT=str(listener.port))
            start = time.monotonic()
            result = self.run_wrapper("ok", "--hostfile", str(self.hostfile), env=env)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertGreaterEqual(time.monotonic() - start, 1.0)
            self.assertIn(f"waiting for localhost:{listener.port}", result.stderr)
        finally:
            listener.close()

    def test_gives_up_on_a_host_that_never_answers(self):
        Path(self.hostfile).write_text("localhost slots=1\nno-such-host.invalid slots=1\n")
        listener = Listener()
        try:
            env = dict(self.env, TESSERA_WAIT_FOR_WORKERS="2", TESSERA_SSH_PORT=str(listener.port))
            result = self.run_wrapper("ok", "--hostfile", str(self.hostfile), env=env)
        finally:
            listener.close()
        self.assertEqual(result.returncode, 1)
        self.assertIn("no-such-host.invalid", result.stderr)
        self.assertIn("giving up", result.stderr)
        self.assertNotIn("args:", result.stdout)  # mpirun never ran

    def test_sigterm_while_waiting_exits_at_once(self):
        Path(self.hostfile).write_text("no-such-host.invalid slots=1\n")
        env = dict(self.env, TESSERA_WAIT_FOR_WORKERS="60")
        process = subprocess.Popen([WRAPPER, "ok", "--hostfile", str(self.hostfile)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(1)
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=20)
        self.assertEqual(process.returncode, 143)


@unittest.skipIf(not MPIRUN, "no mpirun")
class WithRealMpirunAndTessera(unittest.TestCase):
    """Three launcher runs of one command on 2 ranks, as after two preemptions."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        tmp = Path(self.tmp.name)
        text = tmp / "text.txt"
        text.write_text("".join(f"{i}: a stitch in time saves nine, said the {i % 7}th tailor\n" for i in range(600)))
        subprocess.run([TESSERA, "prepare", "text", "-o", str(tmp / "data.h5"), str(text)], check=True,
                       capture_output=True, timeout=60)
        (tmp / "hostfile").write_text("localhost slots=2\n")
        self.listener = Listener()
        self.env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        OMP_NUM_THREADS="1", TESSERA_PROGRESS="lines", TESSERA_SSH_PORT=str(self.listener.port),
                        PATH=f"{Path(TESSERA).parent}:{os.environ['PATH']}")
        self.env.pop("TESSERA_MPIRUN", None)
        self.ckpt = tmp / "ckpt"

    def tearDown(self):
        self.listener.close()
        self.tmp.cleanup()

    def command(self, train_steps):
        tmp = self.tmp.name
        return [WRAPPER, "-np", "2", "--hostfile", f"{tmp}/hostfile", "--oversubscribe", "-x", "PATH",
                "-x", "OMP_NUM_THREADS", "-x", "TESSERA_PROGRESS", "--bind-to", "none",
                RANK_WRAPPER, TESSERA, "train", "--model", "gpt", "--data", f"{tmp}/data.h5",
                "--eval-data", f"{tmp}/data.eval.h5", "--vocab-size", "256", "--seq-length", "32",
                "--num-layers", "1", "--num-heads", "2", "--hidden-size", "32", "--micro-batch-size", "4",
                "--train-steps", str(train_steps), "--warmup-steps", "2", "--eval-interval", "4", "--eval-iters", "1",
                "--log-interval", "1", "--threads", "1", "--save", str(self.ckpt), "--resume", "auto",
                "--metrics", f"{tmp}/metrics.jsonl", "--katib-metrics"]  # as k8s/katib/train.toml asks

    def start(self, train_steps):
        process = subprocess.Popen(self.command(train_steps), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=self.env, start_new_session=True)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
        reader.start()
        return process, lines, reader

    def wait_for_step(self, lines, step, process, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.match(rf"step {step}/", line) for line in list(lines)):
                return
            if process.poll() is not None:
                break
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
        self.fail(f"no 'step {step}/N' progress line; output:\n{''.join(lines)}")

    def finish(self, process, reader, timeout=60):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        reader.join(10)
        process.stdout.close()
        return process.returncode

    def latest(self):
        return int((self.ckpt / "latest").read_text().strip().split("_")[1])

    def test_preempted_twice_then_finishes(self):
        # 1. SIGTERM to the launcher's PID 1 (eviction, drain): every rank checkpoints, exit 143.
        process, lines, reader = self.start(100000)
        self.wait_for_step(lines, 3, process)
        process.send_signal(signal.SIGTERM)
        status = self.finish(process, reader)
        output = "".join(lines)
        self.assertEqual(status, 143, output)
        self.assertRegex(output, r"stopping: SIGUSR1 received by rank \d")
        first = self.latest()
        self.assertGreaterEqual(first, 3)

        # 2. The same command resumes; SIGUSR1 to one rank (a worker's preStop hook): exit 75.
        process, lines, reader = self.start(100000)
        self.wait_for_step(lines, first + 3, process)
        mpirun = subprocess.run(["pgrep", "-P", str(process.pid), "-x", "mpirun"], capture_output=True,
                                text=True).stdout.split()
        ranks = subprocess.run(["pgrep", "-P", mpirun[0], "-x", "tessera"], capture_output=True,
                               text=True).stdout.split()
        self.assertEqual(len(ranks), 2, f"ranks of mpirun {mpirun}: {ranks}")
        os.kill(int(ranks[1]), signal.SIGUSR1)
        status = self.finish(process, reader)
        output2 = "".join(lines)
        self.assertEqual(status, 75, output2)
        self.assertIn(f"step_{first:08d}", output2)  # it resumed from the first checkpoint
        second = self.latest()
        self.assertGreater(second, first)

        # 3. Again, now to the end (as a launcher restart with a finite run would).
        end = second + 8
        process, lines, reader = self.start(end)
        status = self.finish(process, reader)
        output3 = "".join(lines)
        self.assertEqual(status, 0, output3)
        self.assertEqual(self.latest(), end)

        # What Katib's StdOut collector would read from the launcher: every metric
        # of the Experiment, found with the Experiment's own filter.
        experiment = yaml.safe_load((REPO / "k8s" / "katib" / "experiment.yaml").read_text())
        objective = experiment["spec"]["objective"]
        names = [objective["objectiveMetricName"], *objective["additionalMetricNames"]]
        pattern = re.compile(experiment["spec"]["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"][0])
        seen = {}
        for line in (output + output2 + output3).splitlines():
            if not any(name in line for name in names):  # Katib looks only at lines naming a metric
                continue
            for match in pattern.finditer(line):
                if match.group(1) in names and match.group(2) not in ("", "+", "-"):
                    seen.setdefault(match.group(1), []).append(float(match.group(2)))
        self.assertEqual(sorted(seen), sorted(names), f"found {seen}")
        self.assertTrue(all(v > 0 for v in seen[objective["objectiveMetricName"]]))


if __name__ == "__main__":
    support.run_tests()
