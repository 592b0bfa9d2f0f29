"""How the benchmark tests (tests/benchmarks/test_*.py) end: each failure on a line, a count, the exit status."""


def report(failures, what):
    """Prints each failure and `what: N failures`; returns the exit status (1 if any failed)."""
    for failure in failures:
        print("FAIL:", failure)
    print(f"{what}: {len(failures)} failures")
    return 1 if failures else 0
