#!/usr/bin/env python3
"""PyTorch's side of the training-step benchmark (benchmarks/train_compare.py).

Builds the same models Tessera builds (nn/models.cpp), with the same
optimizer, batch and thread count, on synthetic data of the model's shapes,
times full training steps (zero_grad, forward, loss, backward, optimizer step)
and prints one machine-readable line:

    torch case=gpt_bf16 ms_per_step=452.3 steps=20 threads=2 version=1.13.0a0

Models:
  mlp  784-1024-1024-10, ReLU
  cnn  conv5x5 32 (pad 2) - ReLU - maxpool 2 - conv5x5 64 (pad 2) - ReLU - maxpool 2 - fc 1024 - ReLU - fc 10
  gpt  decoder-only, pre-LN, learned positions, tied embedding, GELU (tanh), no dropout
bf16 runs under torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's mixed
precision on the CPU (f32 weights, bf16 matrix products).
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, ffn)
        self.out = nn.Linear(ffn, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, "scaled_dot_product_attention") \
            else self._attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    @staticmethod
    def _attention(q, k, v):
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class Gpt(nn.Module):
    def __init__(self, vocab, seq, layers, heads, hidden):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, 4 * hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def build(case, batch, seq, generator):
    model_name = case.split("_")[0]
    if model_name == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        inputs = torch.rand(batch, 1, 28, 28, generator=generator)
        targets = torch.randint(0, 10, (batch,), generator=generator)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif model_name == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                              nn.Linear(64 * 7 * 7, 1024), nn.ReLU(), nn.Linear(1024, 10))
        inputs = torch.rand(batch, 1, 28, 28, generator=generator)
        targets = torch.randint(0, 10, (batch,), generator=generator)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif model_name == "gpt":
        model = Gpt(256, seq, 4, 4, 256)
        inputs = torch.randint(0, 256, (batch, seq), generator=generator)
        targets = torch.randint(0, 256, (batch, seq), generator=generator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    else:
        raise SystemExit(f"unknown case {case}")
    return model, inputs, targets, optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="mlp_f32, mlp_bf16, cnn_f32, cnn_bf16, gpt_f32, gpt_bf16")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    model, inputs, targets, optimizer = build(args.case, args.batch, args.seq_length, generator)
    bf16 = args.case.endswith("bf16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"torch case={args.case} ms_per_step={statistics.median(times):.2f} steps={args.steps} "
          f"threads={torch.get_num_threads()} version={torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
