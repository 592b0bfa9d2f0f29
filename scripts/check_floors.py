#!/usr/bin/env python3
"""The floors of Tessera, checked: a file includes only its own floor and those below.

    core/ -> kernels/ -> nn/ -> parallel/ -> models/ -> plan/ -> io/ -> apps/

A file's floor is its top-level folder. An #include "X/..." of a higher
floor is an error, and so is a library header used below the floor that owns
it: MPI and NCCL (<mpi.h>, <nccl.h>) from parallel/ up, HDF5 (<hdf5.h>) from
io/ up, CLI11 and toml++ in apps/ only. And library code (every floor but
apps/) never ends the process itself (exit, _Exit, quick_exit, abort,
MPI_Abort, raise(SIGKILL)): it calls end_process() (core/process_end.h),
whose hook the program owns; core/process_end.cpp alone may. tests/ and
benchmarks/ stand above everything and are not checked.

    scripts/check_floors.py [ROOT]     ROOT: the source tree (default: this script's repository)

Prints one line per violation (file:line, what it includes, both floors, the
fix) and exits 1 when there is any, else prints a summary and exits 0.
CONTRIBUTING.md ("The floors") says why the order is what it is.
"""
import pathlib
import re
import sys

FLOORS = ["core", "kernels", "nn", "parallel", "models", "plan", "io", "apps"]
# Library headers (by the start of the name in <...>) and the lowest floor that may use them.
LIBRARY_FLOORS = {
    "mpi.h": "parallel",
    "nccl.h": "parallel",
    "hdf5.h": "io",
    "H5": "io",
    "CLI/": "apps",
    "toml++/": "apps",
}
SOURCE_SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}
# Calls that end the process, outside comments and strings (abort only as std::abort or ::abort: a
# communicator's own abort() method is not one).
ENDS_PROCESS = re.compile(
    r"(?<![\w.>:])(?:std::|::)?(?:_Exit|exit|quick_exit|MPI_Abort)\s*\(|(?:std::|::)abort\s*\(|raise\s*\(\s*SIGKILL")
MAY_END_PROCESS = {"core/process_end.cpp"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def floor_of(relative: str):
    """The floor of a path relative to the root ("kernels/ops/matmul.h" -> "kernels"), or None."""
    top = relative.split("/", 1)[0]
    return top if top in FLOORS else None


def library_floor(header: str):
    for prefix, floor in LIBRARY_FLOORS.items():
        if header.startswith(prefix):
            return floor
    return None


def code_of(text: str) -> str:
    """A line without its // comment and string literals (enough for one-line checks)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text.split("//", 1)[0]


def process_ends(root: pathlib.Path):
    """(file, line, the call) for every library line that ends the process itself."""
    found = []
    for floor in FLOORS[:-1]:
        for path in sorted((root / floor).rglob("*")):
            relative = path.relative_to(root).as_posix()
            if path.suffix not in SOURCE_SUFFIXES or not path.is_file() or relative in MAY_END_PROCESS:
                continue
            for number, text in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                match = ENDS_PROCESS.search(code_of(text))
                if match and not text.lstrip().startswith(("*", "/*")):
                    call = match.group(0).rstrip("( ")
                    found.append((relative, number, call + ")" * (call.count("(") - call.count(")"))))
    return found


def violations(root: pathlib.Path):
    """(file, line, included, its floor, the file's floor) for every upward include under `root`."""
    found = []
    for floor in FLOORS:
        folder = root / floor
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
                continue
            relative = path.relative_to(root).as_posix()
            mine = FLOORS.index(floor)
            for number, text in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                match = INCLUDE.match(text)
                if not match:
                    continue
                quote, header = match.groups()
                theirs = floor_of(header) if quote == '"' else library_floor(header)
                if theirs is not None and FLOORS.index(theirs) > mine:
                    found.append((relative, number, header, theirs, floor))
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    missing = [floor for floor in FLOORS if not (root / floor).is_dir()]
    if missing:
        print(f"check_floors: {root} has no {', '.join(missing)} folder: is it Tessera's source tree?")
        return 2
    found = violations(root)
    for relative, number, header, theirs, floor in found:
        print(f"{relative}:{number}: includes {header} of floor {theirs}/, above its own floor {floor}/ "
              f"(floors: {' -> '.join(f + '/' for f in FLOORS)}); move what it needs down to {floor}/ "
              f"or below, or move this code up to {theirs}/")
    ends = process_ends(root)
    for relative, number, call in ends:
        print(f"{relative}:{number}: ends the process itself ({call}); library code calls "
              f"tessera::end_process() (core/process_end.h), whose hook the program installs")
    if found or ends:
        print(f"check_floors: {len(found)} include(s) point up a floor, {len(ends)} call(s) end the process")
        return 1
    files = sum(1 for f in FLOORS for p in (root / f).rglob("*") if p.suffix in SOURCE_SUFFIXES)
    print(f"check_floors: {files} files on {len(FLOORS)} floors, every include points down or level, "
          "no library code ends the process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
