#!/usr/bin/env python3
"""Functions that must stay short, checked: each entry of LIMITS names a file,
a function defined in it and the most lines its definition may take, from the
first line of its signature to its closing brace.

The trainer's run_on is the first: it sets a run up and drives the steps, and
every run feature (metrics, monitoring, tracking, samples, evaluation,
checkpoint cadence, stop decisions) attaches to the loop as a component
(io/training_events.h) instead of adding its glue there.

    scripts/check_function_lengths.py [ROOT]    ROOT: the source tree (default: this script's repository)

Prints one line per function over its limit (file:line, the function, its
length, the limit, what to do) or not found, and exits 1 when there is any;
otherwise prints each function's length and exits 0.
"""
import pathlib
import re
import sys

# (file, function, most lines, what to do instead of growing it)
LIMITS = [
    ("apps/trainer.cpp", "run_on", 150,
     "a run feature is a component of the training loop: add a class deriving from io::TrainingComponent "
     "(io/training_events.h) and one line registering it (CONTRIBUTING.md, 'Adding a run feature'); "
     "set-up steps go into helper functions"),
]


def skip_literal_or_comment(text: str, i: int) -> int:
    """If a comment, string or character literal starts at text[i], the index just past it; else i."""
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        end = text.find("*/", i + 2)
        return len(text) if end < 0 else end + 2
    raw = re.match(r'R"([^(\s]*)\(', text[i:i + 20])
    if raw:
        end = text.find(")" + raw.group(1) + '"', i)
        return len(text) if end < 0 else end + len(raw.group(1)) + 2
    if text[i] in "\"'":
        quote, j = text[i], i + 1
        while j < len(text) and text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def matching(text: str, i: int, opening: str, closing: str) -> int:
    """The index of the bracket that closes the one at text[i] (-1: none)."""
    depth = 0
    while i < len(text):
        after = skip_literal_or_comment(text, i)
        if after != i:
            i = after
            continue
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def definitions(text: str, name: str):
    """(first line, last line) of every definition of `name` (a function with a body) in `text`, 1-based."""
    found = []
    for match in re.finditer(r"^[^\n#]*?(?<![\w.>])(?:\w+::)*" + re.escape(name) + r"\s*\(", text, re.M):
        open_paren = match.end() - 1
        close_paren = matching(text, open_paren, "(", ")")
        if close_paren < 0:
            continue
        # After the parameters: qualifiers, a trailing return type or a member initialiser list, then
        # the body's brace; a ';', ',' or ')' first means a declaration or a call.
        i = close_paren + 1
        while i < len(text) and text[i] not in "{;,)":
            after = skip_literal_or_comment(text, i)
            if text[i] == "(":  # an initialiser's arguments
                after = matching(text, i, "(", ")") + 1
            i = after if after != i else i + 1
        if i >= len(text) or text[i] != "{":
            continue
        body_end = matching(text, i, "{", "}")
        if body_end < 0:
            continue
        first = text.count("\n", 0, match.start()) + 1
        found.append((first, text.count("\n", 0, body_end) + 1))
    return found


def check(root: pathlib.Path) -> int:
    problems = []
    for file, name, limit, instead in LIMITS:
        path = root / file
        if not path.is_file():
            problems.append(f"{file}: no such file (scripts/check_function_lengths.py names it; update LIMITS)")
            continue
        spans = definitions(path.read_text(), name)
        if not spans:
            problems.append(f"{file}: no definition of {name} (renamed or moved? update LIMITS in "
                            f"scripts/check_function_lengths.py)")
        for first, last in spans:
            lines = last - first + 1
            if lines > limit:
                problems.append(f"{file}:{first}: {name} is {lines} lines, over its limit of {limit}; {instead}")
            else:
                print(f"{file}:{first}: {name}: {lines} lines (limit {limit})")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(check(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1]))
