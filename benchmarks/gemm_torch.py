#!/usr/bin/env python3
"""GEMM benchmark for PyTorch on the CPU, printing the same lines as
build/bin/benchmarks/gemm (benchmarks/gemm.cpp) so the two can be compared:

    gemm impl=torch version=2.1.0 threads=2
    gemm n=1024 impl=torch sgemm_gflops=372.1
    gemm n=1024 impl=torch bf16_gflops=2150.3

torch.matmul on square f32 and bf16 matrices, 2 threads, the median of
--repeats timed runs after a warm-up. Without PyTorch it prints
`gemm impl=torch skipped=torch-not-installed` and exits successfully.
"""
import argparse
import statistics
import time


def median_seconds(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096", help="matrix sizes M = N = K, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("gemm impl=torch skipped=torch-not-installed", flush=True)
        return
    torch.set_num_threads(args.threads)
    print(f"gemm impl=torch version={torch.__version__} threads={torch.get_num_threads()}", flush=True)
    generator = torch.Generator().manual_seed(1234)
    for n in (int(s) for s in args.sizes.split(",") if s):
        flop = 2.0 * n * n * n
        for dtype, key in ((torch.float32, "sgemm_gflops"), (torch.bfloat16, "bf16_gflops")):
            a = (torch.rand(n, n, generator=generator) * 2 - 1).to(dtype)
            b = (torch.rand(n, n, generator=generator) * 2 - 1).to(dtype)
            c = torch.empty(n, n, dtype=dtype)
            secs = median_seconds(lambda: torch.matmul(a, b, out=c), args.repeats)
            print(f"gemm n={n} impl=torch {key}={flop / secs * 1e-9:.1f}", flush=True)


if __name__ == "__main__":
    main()
