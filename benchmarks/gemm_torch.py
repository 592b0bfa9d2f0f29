#!/usr/bin/env python3
"""GEMM benchmark for PyTorch on the CPU, printing the same lines as
build/bin/benchmarks/gemm (benchmarks/gemm.cpp) so the two can be compared:

    gemm impl=torch version=2.15.0 threads=2
    gemm n=1024 impl=torch sgemm_gflops=372.1
    gemm n=1024 impl=torch bf16_gflops=2150.3
    gemm shape=4096x1024x256:nt impl=torch bf16_gflops=1830.2

torch.matmul on square f32 and bf16 matrices and on bf16 products of the
--bf16-shapes (MxNxK[:nn|:nt|:tn|:tt], as gemm.cpp reads them: a transposed
operand is a transposed view of a contiguous tensor, as ops::matmul's
transpose_a / transpose_b), 2 threads, the median of at least --repeats
timed runs (and of at least --min-seconds of them) after a warm-up. Without
PyTorch it prints `gemm impl=torch skipped=torch-not-installed` and exits
successfully.
"""
import argparse
import re
import statistics
import sys
import time


def median_seconds(fn, repeats, min_seconds=0.0):
    fn()  # warm-up
    times = []
    while len(times) < repeats or sum(times) < min_seconds:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_shape(text):
    """'4096x1024x256:nt' -> (m, n, k, transpose_a, transpose_b)."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?::([nt])([nt]))?", text)
    if not match or 0 in (int(match[1]), int(match[2]), int(match[3])):
        sys.exit(f"gemm_torch.py: --bf16-shapes: '{text}' is not MxNxK[:nn|:nt|:tn|:tt] (e.g. 4096x1024x256:nt)")
    return int(match[1]), int(match[2]), int(match[3]), match[4] == "t", match[5] == "t"


def bf16_gflops(torch, generator, shape, repeats, min_seconds):
    m, n, k, transpose_a, transpose_b = shape

    def operand(rows, cols, transposed):
        stored = (cols, rows) if transposed else (rows, cols)
        x = (torch.rand(*stored, generator=generator) * 2 - 1).to(torch.bfloat16)
        return x.t() if transposed else x

    a, b = operand(m, k, transpose_a), operand(k, n, transpose_b)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    secs = median_seconds(lambda: torch.matmul(a, b, out=c), repeats, min_seconds)
    return 2.0 * m * n * k / secs * 1e-9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="matrix sizes M = N = K, comma-separated (default 1024,2048,4096 without "
                        "--bf16-shapes)")
    parser.add_argument("--bf16-shapes", default="", help="more bf16 products, MxNxK[:nn|:nt|:tn], comma-separated")
    parser.add_argument("--bf16-only", action="store_true", help="only the bf16 products")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--min-seconds", type=float, default=0.0, help="time each bf16 product for at least this long")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = parser.parse_args()
    shapes = [parse_shape(s) for s in args.bf16_shapes.split(",") if s]
    sizes = args.sizes if args.sizes is not None else ("" if shapes else "1024,2048,4096")
    try:
        import torch
    except ImportError:
        print("gemm impl=torch skipped=torch-not-installed", flush=True)
        return
    torch.set_num_threads(args.threads)
    print(f"gemm impl=torch version={torch.__version__} threads={torch.get_num_threads()}", flush=True)
    generator = torch.Generator().manual_seed(1234)
    for n in (int(s) for s in sizes.split(",") if s):
        if not args.bf16_only:
            a = torch.rand(n, n, generator=generator) * 2 - 1
            b = torch.rand(n, n, generator=generator) * 2 - 1
            c = torch.empty(n, n)
            secs = median_seconds(lambda: torch.matmul(a, b, out=c), args.repeats)
            print(f"gemm n={n} impl=torch sgemm_gflops={2.0 * n**3 / secs * 1e-9:.1f}", flush=True)
        gflops = bf16_gflops(torch, generator, (n, n, n, False, False), args.repeats, args.min_seconds)
        print(f"gemm n={n} impl=torch bf16_gflops={gflops:.1f}", flush=True)
    for text, shape in zip((s for s in args.bf16_shapes.split(",") if s), shapes):
        gflops = bf16_gflops(torch, generator, shape, args.repeats, args.min_seconds)
        print(f"gemm shape={text} impl=torch bf16_gflops={gflops:.1f}", flush=True)


if __name__ == "__main__":
    main()
