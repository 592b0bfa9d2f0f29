#!/usr/bin/env python3
# An MPIJob's launch path run for real on this machine, in a private mount
# namespace that lays out what the MPI Operator and the image give the pods:
# the job's ssh key mounted at sshAuthMountPath (0644 root-owned files under
# /home/mpiuser/.ssh for the non-root job, 0600 under /root/.ssh for the RDMA
# overlays' root job), the image's user and ssh client settings (taken from
# k8s/image/setup-runtime.sh), the operator's hostfile for one worker with 2
# slots, "worker-0" (a loopback address in /etc/hosts). k8s/image/tessera-sshd
# runs Debian 12's sshd (unpacked by k8s/install-tools.sh) as the worker;
# tessera-mpirun runs the real mpirun, which starts its daemon on the worker
# through ssh, and the ranks start through scripts/tessera-rank. A second
# launcher run resumes from the first one's checkpoint. Needs root (mount
# namespaces). One worker, not two: two Open MPI daemons of one job on one
# machine race to create the same session directory under the shared /tmp,
# which separate pods never do.
import os
import re
import shutil
import socket
import subprocess
import tempfile
import unittest
from pathlib import Path

import k8s_test_support as support
from k8s_test_support import k8scheck

REPO = support.REPO
TESSERA = support.require_tessera()
OPENSSH = k8scheck.TOOLS_DIR / "openssh"
SSHD = OPENSSH / "usr" / "sbin" / "sshd"
if not SSHD.is_file():
    support.missing(f"no sshd at {SSHD}: scripts/install-deps.sh unpacks Debian's openssh-server there")
if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
    support.missing("needs root, unshare and setpriv (util-linux) for a private mount namespace")
if not shutil.which("mpirun"):
    support.missing("no mpirun")

INSIDE = r"""#!/bin/bash
# Runs in a private mount namespace: what a pod of the MPIJob would see.
set -euo pipefail
T=$1 MODE=$2 PORT=$3
mount -t tmpfs tmpfs /run && mkdir -m 755 /run/sshd    # sshd's privilege separation directory (root)
for f in passwd group hosts; do mount --bind "$T/etc/$f" "/etc/$f"; done
mount --bind "$T/etc/ssh_config.d" /etc/ssh/ssh_config.d
if [[ $MODE == user ]]; then
  mount -t tmpfs tmpfs /home
  mkdir -p /home/mpiuser/.ssh && chown 1000:1000 /home/mpiuser
  mount --bind "$T/keys" /home/mpiuser/.ssh           # the operator's Secret: root-owned, 0644
  as=(setpriv --reuid=1000 --regid=1000 --clear-groups env HOME=/home/mpiuser USER=mpiuser LOGNAME=mpiuser)
else
  mount -t tmpfs tmpfs /root
  mkdir -m 700 /root/.ssh && cp "$T"/keys/* /root/.ssh/ && chmod 600 /root/.ssh/*   # under /root/.ssh: 0600
  as=(env HOME=/root OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
fi
"${as[@]}" TESSERA_SSHD="$SSHD" LD_LIBRARY_PATH="$SSHD_LIB" TESSERA_SSH_PORT="$PORT" \
  "$REPO/k8s/image/tessera-sshd" >"$T/sshd.log" 2>&1 &
sshd=$!
trap 'kill $sshd 2>/dev/null || true' EXIT
for run in 1 2; do
  steps=$((run == 1 ? 4 : 8))
  status=0
  "${as[@]}" PATH="$PATH" OMP_NUM_THREADS=1 TESSERA_PROGRESS=lines TESSERA_SSH_PORT="$PORT" TESSERA_WAIT_FOR_WORKERS=30 \
    "$REPO/k8s/image/tessera-mpirun" -np 2 --hostfile "$T/hostfile" -x PATH -x OMP_NUM_THREADS -x TESSERA_PROGRESS \
    --bind-to none "$REPO/scripts/tessera-rank" "$TESSERA" train --model gpt --data "$T/data/text.h5" \
    --eval-data "$T/data/text.eval.h5" --vocab-size 256 --seq-length 32 --num-layers 1 --num-heads 2 \
    --hidden-size 32 --micro-batch-size 4 --train-steps $steps --warmup-steps 1 --eval-interval 4 --eval-iters 1 \
    --threads 1 --save "$T/data/ckpt" --resume auto >"$T/run$run.log" 2>&1 || status=$?
  echo $status >"$T/run$run.status"
done
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_ssh_client_config(port):
    """The ssh client settings k8s/image/setup-runtime.sh writes, port changed."""
    setup = (REPO / "k8s" / "image" / "setup-runtime.sh").read_text()
    block = re.search(r"tessera\.conf <<'CONFIG'\n(.*?)\nCONFIG", setup, re.S).group(1)
    assert "Port 2222" in block
    return block.replace("Port 2222", f"Port {port}") + "\n"


class SshLaunch(unittest.TestCase):
    def launch(self, mode):
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            t.chmod(0o755)
            (t / "etc" / "ssh_config.d").mkdir(parents=True)
            (t / "keys").mkdir()
            (t / "data").mkdir()
            # The image's user (uid 1000) and sshd's privilege-separation user, replacing any uid 1000 here.
            passwd = [l for l in Path("/etc/passwd").read_text().splitlines()
                      if l.split(":")[2] != "1000" and l.split(":")[0] not in ("mpiuser", "sshd")]
            passwd += ["mpiuser:x:1000:1000::/home/mpiuser:/bin/bash", "sshd:x:64999:65534::/run/sshd:/usr/sbin/nologin"]
            (t / "etc" / "passwd").write_text("\n".join(passwd) + "\n")
            group = [l for l in Path("/etc/group").read_text().splitlines()
                     if l.split(":")[2] != "1000" and l.split(":")[0] != "mpiuser"]
            (t / "etc" / "group").write_text("\n".join(group + ["mpiuser:x:1000:"]) + "\n")
            (t / "etc" / "hosts").write_text(Path("/etc/hosts").read_text() + "127.0.0.2 worker-0\n")
            port = free_port()
            (t / "etc" / "ssh_config.d" / "tessera.conf").write_text(image_ssh_client_config(port))
            # The operator's key: ECDSA P-521, as id_rsa, id_rsa.pub and authorized_keys.
            subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-N", "", "-C", "job",
                            "-f", str(t / "keys" / "id_rsa")], check=True)
            shutil.copy(t / "keys" / "id_rsa.pub", t / "keys" / "authorized_keys")
            for key in (t / "keys").iterdir():
                key.chmod(0o644)
            # The operator's hostfile for 1 worker x 2 slots.
            (t / "hostfile").write_text("worker-0 slots=2\n")
            text = t / "data" / "text.txt"
            text.write_text("".join(f"{i}: every rank goes through sshd on port 2222\n" for i in range(500)))
            subprocess.run([TESSERA, "prepare", "text", "-o", str(t / "data" / "text.h5"), str(text)], check=True,
                           capture_output=True, timeout=60)
            if mode == "user":
                os.chown(t / "data", 1000, 1000)
            (t / "inside.sh").write_text(INSIDE)
            env = dict(os.environ, REPO=str(REPO), TESSERA=TESSERA, SSHD=str(SSHD),
                       SSHD_LIB=str(OPENSSH / "usr" / "lib" / "x86_64-linux-gnu"),
                       PATH=f"{Path(TESSERA).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            result = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", str(t / "inside.sh"),
                                     str(t), mode, str(port)], capture_output=True, text=True, env=env, timeout=240)
            logs = {name: (t / name).read_text() if (t / name).exists() else ""
                    for name in ("sshd.log", "run1.log", "run2.log", "run1.status", "run2.status")}
            latest = (t / "data" / "ckpt" / "latest").read_text().strip() if (t / "data" / "ckpt" / "latest").exists() \
                else None
        report = f"namespace script: {result.returncode} {result.stderr}\n" + "\n".join(
            f"--- {name}\n{text}" for name, text in logs.items())
        self.assertEqual(result.returncode, 0, report)
        self.assertEqual(logs["run1.status"].strip(), "0", report)
        self.assertEqual(logs["run2.status"].strip(), "0", report)
        user = "mpiuser" if mode == "user" else "root"
        # Each launcher run reached the worker through its sshd, with the job's key.
        self.assertGreaterEqual(logs["sshd.log"].count(f"Accepted publickey for {user}"), 2, report)
        for run in ("run1.log", "run2.log"):
            self.assertIn("ranks: world 2 ranks", logs[run], report)
        self.assertIn("eval step", logs["run1.log"], report)
        self.assertIn("resumed from", logs["run2.log"], report)
        self.assertIn("step_00000004", logs["run2.log"], report)
        self.assertEqual(latest, "step_00000008", report)

    def test_non_root_job(self):
        """The base's job: uid 1000, keys in /home/mpiuser/.ssh (root-owned, 0644)."""
        self.launch("user")

    def test_root_job(self):
        """The RDMA overlays' job: root, keys in /root/.ssh (0600)."""
        self.launch("root")


if __name__ == "__main__":
    support.run_tests()
