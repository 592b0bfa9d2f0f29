"""What the benchmarks print about the machine they ran on (the CPU model, its cores and the ISA
extensions that change kernel choices), the environment they run `mpirun` with, and how they run a command."""
import os
import platform
import re
import subprocess
import sys


def cpu_description():
    """'AMD EPYC ..., 2 cores, avx2 avx512f avx512_bf16' (amx_tile when there is AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
        flags = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if flags and f in flags.group(1).split()]
        return f"{model.group(1) if model else platform.processor()}, {os.cpu_count()} cores, {' '.join(isa)}"
    except OSError:
        return platform.processor()


def mpi_environment():
    """The environment for `mpirun` with one OpenMP thread per rank (as root, Open MPI's permission too)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    if os.geteuid() == 0:  # Open MPI refuses to run as root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run(cmd, env):
    """`cmd`'s stdout; on a non-zero exit, the benchmark stops with the command and its output."""
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"failed ({' '.join(cmd)}):\n{result.stdout}\n{result.stderr}")
    return result.stdout
