#!/usr/bin/env python3
"""The pipeline bubble benchmark's lines (benchmarks/pipeline_bubble.cpp) under mpirun on 2 ranks: one line
per schedule (gpipe, 1f1b and interleaved 1f1b, zb-h1, zbv) and micro-batch count, interleaving skipped where M
is not a multiple of P; its simulated figure equal to each schedule's bubble at unit costs as the papers give it
(ZBV: P - 1 chunk-units idle per stage once M >= 2P - 1), written here independently; its closed form at
the timed costs (B and W apart from F), none for zbv; diff_pp the measured figure minus the closed form (zbv:
minus the simulated one); and --backward-ms and --weight-ms defaulting to --forward-ms. No timing is judged.

Usage: test_pipeline_bubble_benchmark.py BUILD_DIR
"""
import os
import re
import shutil
import subprocess
import sys

import failures as failures_report  # tests/benchmarks/failures.py, beside this file

STAGES = 2
MICRO_BATCHES = [3, 4]


def run(build, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [shutil.which("mpirun") or "mpirun", "-np", str(STAGES), "--bind-to", "none", "--oversubscribe",
               os.path.join(build, "bin", "benchmarks", "pipeline_bubble"), "--micro-batches",
               *map(str, MICRO_BATCHES), "--schedule", "gpipe", "1f1b", "zb-h1", "zbv", "--virtual-stages", "1", "2",
               "--repeats", "1", *flags]
    return command, subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def lines_of(stdout):
    """{(schedule, chunks, M): {name: value}} of the benchmark's lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("pipeline_bubble "):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out[(fields["schedule"], int(fields["virtual_stages"]), int(fields["micro_batches"]))] = fields
    return out


def unit_cost_bubble(schedule, chunks, p, m):
    """Idle share at F = B = W = 1 (a whole backward 2)."""
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zbv":  # 2 chunks of 3 units per micro-batch, P - 1 units idle per stage
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (chunks * m + p - 1)


def closed_form(schedule, chunks, p, m, f, b, w):
    if schedule == "zbv":
        return None
    if schedule == "zb-h1":
        return (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))
    return (p - 1) / (chunks * m + p - 1)


def expected_configurations():
    out = [("gpipe", 1, m) for m in MICRO_BATCHES] + [("1f1b", 1, m) for m in MICRO_BATCHES]
    out += [("1f1b", 2, m) for m in MICRO_BATCHES if m % STAGES == 0]
    return out + [("zb-h1", 1, m) for m in MICRO_BATCHES] + [("zbv", 2, m) for m in MICRO_BATCHES]


def check_run(build, costs, flags, failures):
    command, result = run(build, *flags)
    if result.returncode != 0:
        failures.append(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
        return
    lines = lines_of(result.stdout)
    if sorted(lines) != sorted(expected_configurations()):
        failures.append(f"configurations {sorted(lines)}, expected {sorted(expected_configurations())}:\n"
                        f"{result.stdout}")
    f, b, w = costs
    for key, fields in lines.items():
        schedule, chunks, m = key
        timed = tuple(float(fields[k]) for k in ("forward_ms", "backward_ms", "weight_ms"))
        if timed != costs:
            failures.append(f"{key}: timed F, B, W {timed}, expected {costs}")
        simulated, measured = float(fields["simulated"]), float(fields["measured"])
        if abs(simulated - unit_cost_bubble(schedule, chunks, STAGES, m)) > 1e-4:
            failures.append(f"{key}: simulated {simulated}, expected {unit_cost_bubble(schedule, chunks, STAGES, m)}")
        theory = closed_form(schedule, chunks, STAGES, m, f, b, w)
        if (theory is None) != ("theory" not in fields):
            failures.append(f"{key}: theory {fields.get('theory')}, expected {theory}")
        elif theory is not None and abs(float(fields["theory"]) - theory) > 1e-4:
            failures.append(f"{key}: theory {fields['theory']}, expected {theory:.4f}")
        reference = theory if theory is not None else simulated
        if not 0.0 <= measured < 1.0 or abs(float(fields["diff_pp"]) - 100 * (measured - reference)) > 0.02:
            failures.append(f"{key}: measured {measured}, diff_pp {fields['diff_pp']} against {reference:.4f}")


def main():
    build = sys.argv[1]
    failures = []
    check_run(build, (1.0, 1.0, 1.0), ["--forward-ms", "1"], failures)
    check_run(build, (1.0, 1.5, 0.5), ["--forward-ms", "1", "--backward-ms", "1.5", "--weight-ms", "0.5"], failures)
    return failures_report.report(failures, "pipeline bubble benchmark")


if __name__ == "__main__":
    sys.exit(main())
