#!/usr/bin/env python3
"""The function-length check (scripts/check_function_lengths.py) on the real
tree and on copies made to break it.

The source tree must pass. In a copy of each file the check names, the
function is padded to exactly its limit (must pass) and then one line past it
(must fail, naming the file and line, the function, its length, the limit and
what to do: add a component). The counting itself is checked on generated
functions of random lengths whose bodies hold braces in strings, characters,
raw strings and comments, beside a declaration and a call of the same name;
and a function that is not there is reported. Label `unit`.
"""
import os
import pathlib
import random
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_function_lengths.py"
sys.path.insert(0, str(CHECK.parent))
import check_function_lengths as lengths  # noqa: E402  (the checker's own list and counting)


def run_check(root: pathlib.Path):
    result = subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def copy_checked_files(destination: pathlib.Path):
    for file, _, _, _ in lengths.LIMITS:
        (destination / file).parent.mkdir(parents=True, exist_ok=True)
        (destination / file).write_text((ROOT / file).read_text())


def pad(path: pathlib.Path, name: str, lines: int):
    """Makes the first definition of `name` in `path` `lines` lines long by adding comment lines to its body;
    returns its first line (None: it is longer already, which the check of the tree reports)."""
    text = path.read_text()
    first, last = lengths.definitions(text, name)[0]
    rows = text.splitlines(keepends=True)
    add = lines - (last - first + 1)
    if add < 0:
        return None
    rows[last - 1:last - 1] = ["  // padding\n"] * add  # before the closing brace
    path.write_text("".join(rows))
    return first


def generated_function(rng: random.Random, name: str, body_lines: int) -> str:
    """A definition of `name` with a two-line signature and `body_lines` lines that hold stray braces."""
    tricky = ['  const char* open = "{{{";', "  char close = '}';", "  // a comment with } and {",
              '  auto raw = R"x(}}})x";', "  /* { */ int x = 0;", "  if (x) { x = 1; }",
              '  const char* quote = "\\"}";']
    body = [rng.choice(tricky) for _ in range(body_lines)]
    return "\n".join([f"int {name}(int a,", "         int b) {", *body, "}"]) + "\n"


def main() -> int:
    failures = []
    status, output = run_check(ROOT)
    print(output.strip())
    if status != 0:
        failures.append(f"the source tree fails the function-length check:\n{output}")

    seed = int(os.environ.get("TESSERA_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed} (replay: TESSERA_TEST_SEED={seed})")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tessera-lengths-") as scratch:
        for file, name, limit, _ in lengths.LIMITS:
            tree = pathlib.Path(scratch) / "at_limit"
            copy_checked_files(tree)
            if pad(tree / file, name, limit) is None:
                continue
            status, output = run_check(tree)
            if status != 0:
                failures.append(f"{name} padded to its limit of {limit} lines fails:\n{output}")
            tree = pathlib.Path(scratch) / "over_limit"
            copy_checked_files(tree)
            first = pad(tree / file, name, limit + 1)
            status, output = run_check(tree)
            expected = f"{file}:{first}: {name} is {limit + 1} lines, over its limit of {limit}; "
            if status != 1 or expected not in output or "component" not in output:
                failures.append(f"{name} padded to {limit + 1} lines: exit {status}, expected 1 and '{expected}' "
                                f"and what to do (a component) in:\n{output}")
            else:
                print(f"caught: {output.strip()[:200]}")

    for _ in range(20):
        body_lines = rng.randrange(0, 40)
        before = "int counted(int a, int b);\nint caller() { return counted(1, 2); }\n"
        text = before + generated_function(rng, "counted", body_lines) + "int after() { return 0; }\n"
        spans = lengths.definitions(text, "counted")
        expected = [(3, 3 + body_lines + 2)]  # two signature lines, the body, the closing brace
        if spans != expected:
            failures.append(f"counted a generated function of {body_lines} body lines as {spans}, "
                            f"expected {expected}:\n{text}")
    if lengths.definitions("int other() { return 0; }\n", "counted"):
        failures.append("found a function that is not there")
    with tempfile.TemporaryDirectory(prefix="tessera-lengths-") as scratch:
        tree = pathlib.Path(scratch)
        copy_checked_files(tree)
        file, name, _, _ = lengths.LIMITS[0]
        (tree / file).write_text((tree / file).read_text().replace(f"{name}(", f"{name}_renamed("))
        status, output = run_check(tree)
        if status != 1 or f"no definition of {name}" not in output:
            failures.append(f"a renamed {name}: exit {status}, expected 1 and 'no definition of {name}' in:\n{output}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
