#!/usr/bin/env python3
"""The floors check (scripts/check_floors.py) on the real tree and on planted violations.

The source tree must pass. Then, in a copy of its floors, one violation at a
time is planted into a random real file of a floor, after its includes: an
upward include at each floor boundary, a library header below the floor that
owns it, a library call that ends the process (MPI_Abort, std::_Exit,
raise(SIGKILL), std::abort). Each copy must fail, naming that file, its line
and what is wrong, and the untouched copy must still pass (so it is the
plant that fails it). Label `unit`.
"""
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_floors.py"
sys.path.insert(0, str(CHECK.parent))
from check_floors import MAY_END_PROCESS  # noqa: E402  (the checker's own exemption)
FLOORS = ["core", "kernels", "nn", "parallel", "models", "plan", "io", "apps"]

# (a file's floor, a line it must not hold, what the report must say of it):
# each floor boundary, library headers, and library code ending the process.
PLANTS = [
    ("core", '#include "kernels/ops/matmul.h"', "includes kernels/ops/matmul.h of floor kernels/"),
    ("kernels", '#include "nn/module.h"', "includes nn/module.h of floor nn/"),
    ("nn", '#include "parallel/communicator.h"', "includes parallel/communicator.h of floor parallel/"),
    ("parallel", '#include "models/decoder.h"', "includes models/decoder.h of floor models/"),
    ("models", '#include "plan/planner.h"', "includes plan/planner.h of floor plan/"),
    ("plan", '#include "io/checkpoint.h"', "includes io/checkpoint.h of floor io/"),
    ("io", '#include "apps/train_config.h"', "includes apps/train_config.h of floor apps/"),
    ("core", '#include "apps/trainer.h"', "includes apps/trainer.h of floor apps/"),
    ("kernels", "#include <mpi.h>", "includes mpi.h of floor parallel/"),
    ("nn", "#include <nccl.h>", "includes nccl.h of floor parallel/"),
    ("parallel", "#include <hdf5.h>", "includes hdf5.h of floor io/"),
    ("io", "#include <CLI/CLI.hpp>", "includes CLI/CLI.hpp of floor apps/"),
    ("parallel", "inline void stop() { MPI_Abort(MPI_COMM_WORLD, 1); }", "ends the process itself (MPI_Abort)"),
    ("core", "inline void stop() { std::_Exit(1); }", "ends the process itself (std::_Exit)"),
    ("io", "inline void stop() { std::raise(SIGKILL); }", "ends the process itself (raise(SIGKILL))"),
    ("nn", "inline void stop() { std::abort(); }", "ends the process itself (std::abort)"),
]


def run_check(root: pathlib.Path):
    result = subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


def copy_floors(destination: pathlib.Path):
    for floor in FLOORS:
        shutil.copytree(ROOT / floor, destination / floor,
                        ignore=shutil.ignore_patterns("*.md", "*.txt", "*.cmake", "CMakeLists.txt"))


def plant(root: pathlib.Path, floor: str, line: str, rng: random.Random):
    """Puts `line` into a random source file of `floor` after its last include; returns (file, line number)."""
    # Not the one file allowed to end the process (check_floors.MAY_END_PROCESS): a plant there is no violation.
    files = sorted(p for p in (root / floor).rglob("*")
                   if p.suffix in {".h", ".cpp"} and p.is_file()
                   and p.relative_to(root).as_posix() not in MAY_END_PROCESS)
    path = rng.choice(files)
    lines = path.read_text().splitlines()
    last_include = max((i for i, text in enumerate(lines) if text.lstrip().startswith("#include")), default=0)
    at = last_include + 1
    lines.insert(at, line)
    path.write_text("\n".join(lines) + "\n")
    return path.relative_to(root).as_posix(), at + 1


def main() -> int:
    failures = []
    status, output = run_check(ROOT)
    print(output.strip())
    if status != 0:
        failures.append(f"the source tree fails the floors check:\n{output}")

    seed = int(os.environ.get("TESSERA_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed} (replay: TESSERA_TEST_SEED={seed})")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tessera-floors-") as scratch:
        clean = pathlib.Path(scratch) / "clean"
        copy_floors(clean)
        status, output = run_check(clean)
        if status != 0:
            failures.append(f"an unmodified copy fails:\n{output}")
        for index, (floor, line, said) in enumerate(PLANTS):
            tree = pathlib.Path(scratch) / f"planted{index}"
            shutil.copytree(clean, tree)
            where, number = plant(tree, floor, line, rng)
            status, output = run_check(tree)
            expected = f"{where}:{number}: {said}"
            if status != 1 or expected not in output:
                failures.append(f"planted `{line}` at {where}:{number}: exit {status}, expected 1 and "
                                f"'{expected}' in:\n{output}")
            else:
                print(f"caught: {output.splitlines()[0][:160]}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
