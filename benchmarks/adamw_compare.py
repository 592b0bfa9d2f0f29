#!/usr/bin/env python3
"""Tessera's AdamW beside torch.optim.AdamW on the same numbers, over many steps.

For beta2 = 0.95 and 0.999 it draws initial parameters and --steps gradients
(uniform in [-1, 1), f32), runs build/bin/benchmarks/adamw_steps
(ops::adamw_step) and torch.optim.AdamW (CPU, the single-tensor path and the
foreach path) on them, and prints per case

    adamw_vs_torch beta2=0.999 impl=tessera param_max_abs=... m_max_rel=... v_max_rel=... v_mean_rel=...
        identical_param=... identical_m=... identical_v=...

(one line) where param_max_abs is the largest |param - torch's| (parameters of
order one), *_max_rel the largest |x - torch| / |torch| over the elements,
v_mean_rel the mean signed relative difference of exp_avg_sq (a drift, not
rounding, when it is far from 0) and identical_* the share of elements equal
to torch's bit for bit. impl=f32_betas is torch itself
with beta1 and beta2 rounded to f32 first (what holding the betas in f32 does:
1 - beta2 and 1 - beta2^step move by ~1e-5 of themselves), for scale.

Usage: /opt/tessera-tools/torch/bin/python benchmarks/adamw_compare.py [--steps 2000] [--size 4096]
(PyTorch 2.15 from PyPI in /opt/tessera-tools/torch: scripts/install-deps.sh --with-benchmarks)
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def torch_adamw(initial, grads, settings, foreach):
    """torch.optim.AdamW on the CPU: the final parameters, exp_avg and exp_avg_sq."""
    param = torch.nn.Parameter(torch.from_numpy(initial.copy()))
    optimizer = torch.optim.AdamW([param], foreach=foreach, **settings)
    for grad in grads:
        param.grad = torch.from_numpy(grad.copy())
        optimizer.step()
    state = optimizer.state[param]
    return [param.detach().numpy().copy(), state["exp_avg"].numpy().copy(), state["exp_avg_sq"].numpy().copy()]


def tessera_adamw(binary, initial, grads, settings):
    """build/bin/benchmarks/adamw_steps on the same numbers."""
    with tempfile.TemporaryDirectory() as scratch:
        data, result = os.path.join(scratch, "in.f32"), os.path.join(scratch, "out.f32")
        np.concatenate([initial[None, :], grads]).astype("<f4").tofile(data)
        beta1, beta2 = settings["betas"]
        subprocess.run([binary, "--size", str(initial.size), "--steps", str(len(grads)), "--input", data,
                        "--output", result, "--lr", repr(settings["lr"]), "--beta1", repr(beta1), "--beta2",
                        repr(beta2), "--eps", repr(settings["eps"]), "--weight-decay",
                        repr(settings["weight_decay"])], check=True)
        return list(np.fromfile(result, dtype="<f4").reshape(3, initial.size))


def compare(name, beta2, mine, reference):
    diff = [a.astype(np.float64) - b for a, b in zip(mine, reference)]
    m_rel = np.abs(diff[1]) / np.abs(reference[1].astype(np.float64))
    v_rel = diff[2] / reference[2]
    same = [np.mean(a.view(np.uint32) == b.view(np.uint32)) for a, b in zip(mine, reference)]
    print(f"adamw_vs_torch beta2={beta2} impl={name} param_max_abs={np.abs(diff[0]).max():.3g} "
          f"m_max_rel={m_rel.max():.3g} v_max_rel={np.abs(v_rel).max():.3g} v_mean_rel={v_rel.mean():.3g} "
          f"identical_param={same[0]:.3f} identical_m={same[1]:.3f} identical_v={same[2]:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--adamw-steps", default=os.path.join(HERE, "..", "build", "bin", "benchmarks", "adamw_steps"))
    args = parser.parse_args()
    if not os.path.exists(args.adamw_steps):
        sys.exit(f"{args.adamw_steps} not found: build it with cmake --build build --target tessera_bench_adamw_steps")
    torch.set_num_threads(1)
    print(f"adamw_vs_torch torch={torch.__version__} steps={args.steps} size={args.size} lr=3e-4 beta1=0.9 "
          f"eps=1e-8 weight_decay=0.1")
    rng = np.random.default_rng(args.seed)
    for beta2 in (0.95, 0.999):
        settings = {"lr": 3e-4, "betas": (0.9, beta2), "eps": 1e-8, "weight_decay": 0.1}
        initial = rng.uniform(-1, 1, args.size).astype(np.float32)
        grads = rng.uniform(-1, 1, (args.steps, args.size)).astype(np.float32)
        reference = torch_adamw(initial, grads, settings, foreach=False)
        compare("tessera", beta2, tessera_adamw(args.adamw_steps, initial, grads, settings), reference)
        compare("torch_foreach", beta2, torch_adamw(initial, grads, settings, foreach=True), reference)
        f32_betas = dict(settings, betas=tuple(float(np.float32(b)) for b in settings["betas"]))
        compare("f32_betas", beta2, torch_adamw(initial, grads, f32_betas, foreach=False), reference)


if __name__ == "__main__":
    main()
