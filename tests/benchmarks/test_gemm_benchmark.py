#!/usr/bin/env python3
"""The bf16 GEMM benchmark's shapes (benchmarks/gemm.cpp --bf16-shapes and
benchmarks/gemm_compare.py's cases): every case of gemm_compare.py is a shape
that build/bin/benchmarks/gemm reads, and it prints one bf16 figure per shape
asked for (and no square ones then); a malformed shape is refused, naming the
flag and the form. With PyTorch at hand (/opt/tessera-tools/torch, or this
interpreter's), benchmarks/gemm_torch.py reads the same shapes and prints
the same lines.

Usage: test_gemm_benchmark.py BUILD_DIR
"""
import os
import re
import subprocess
import sys

import failures as failures_report  # tests/benchmarks/failures.py, beside this file

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SOURCE, "benchmarks"))
import gemm_compare  # noqa: E402  (the cases to check)

# Small shapes of every layout, odd sizes included; each stands for the cases' forms.
SMALL = ["96x80x64:nt", "64x48x96:tn", "33x17x9:nn", "20x30x40:tt", "8x8x8"]


def run(command):
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))


def check_figures(command, impl, failures):
    result = run([*command, "--bf16-shapes", ",".join(SMALL), "--repeats", "1"])
    if result.returncode != 0:
        failures.append(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
        return
    for shape in SMALL:
        if not re.search(rf"^gemm shape={re.escape(shape)} impl={impl} bf16_gflops=[0-9]+\.[0-9]$", result.stdout,
                         re.MULTILINE):
            failures.append(f"{impl}: no bf16_gflops line for {shape} in:\n{result.stdout}")
    if re.search(r"^gemm n=", result.stdout, re.MULTILINE):
        failures.append(f"{impl}: square products measured though only --bf16-shapes were asked for:\n{result.stdout}")


def check_refused(command, failures):
    for bad in ("12x3", "1x2x3:ntx", "0x4x4", "4x4x4:xy"):
        result = run([*command, "--bf16-shapes", bad])
        if result.returncode == 0 or f"--bf16-shapes: '{bad}' is not MxNxK" not in result.stderr:
            failures.append(f"{' '.join(command)} --bf16-shapes {bad}: exit {result.returncode}, {result.stderr!r}")


def torch_python():
    venv = os.path.join(os.environ.get("TESSERA_TOOLS_DIR", "/opt/tessera-tools"), "torch", "bin", "python")
    for python in (venv, sys.executable):
        if os.path.exists(python) and run([python, "-c", "import torch"]).returncode == 0:
            return python
    return None


def main():
    gemm = os.path.join(sys.argv[1], "bin", "benchmarks", "gemm")
    failures = []
    for case, shape in gemm_compare.CASES.items():
        if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*:[nt][nt]", shape):
            failures.append(f"gemm_compare.py case {case}: '{shape}' is not MxNxK:layout")
    check_figures([gemm], "tessera", failures)
    check_refused([gemm], failures)
    python = torch_python()
    if python:
        torch_script = [python, os.path.join(SOURCE, "benchmarks", "gemm_torch.py")]
        check_figures(torch_script, "torch", failures)
        check_refused(torch_script, failures)
    else:
        print("PyTorch not installed (scripts/install-deps.sh --with-benchmarks): gemm_torch.py not checked")
    return failures_report.report(failures, "gemm benchmark shapes")


if __name__ == "__main__":
    sys.exit(main())
