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
  llama  decoder-only as Hugging Face's LlamaForCausalLM (models/llama.cpp): RMSNorm (eps 1e-5, weight only),
         rotary embeddings (base 10000, rotate_half's half-split pairs), grouped-query attention (8 query heads,
         2 key/value groups, K/V repeated as Hugging Face's repeat_kv), SwiGLU MLP (gate, up, down), no biases,
         untied head, no dropout
Attention (gpt, llama): F.scaled_dot_product_attention where the PyTorch has it (2.0 on; Hugging Face's "sdpa"),
else softmax(q k^T / sqrt(d) + causal mask) v written out (1.13; Hugging Face's "eager").
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
        y = causal_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def causal_attention(q, k, v):
    """q, k, v [B, heads, T, Dh] -> [B, heads, T, Dh], causal."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
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


class RmsNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: in f32, the weight applied in the input's dtype."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(seq, head_dim, base, dtype):
    """cos, sin [T, Dh] of Hugging Face's LlamaRotaryEmbedding (angles in f32): pairs (i, i + Dh/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, hidden, heads, groups):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.groups, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.groups, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        repeats = self.heads // self.groups  # Hugging Face's repeat_kv: query head h uses group h // repeats
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        y = causal_attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LlamaMlp(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden, heads, groups, ffn):
        super().__init__()
        self.input_layernorm = RmsNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, groups)
        self.post_attention_layernorm = RmsNorm(hidden)
        self.mlp = LlamaMlp(hidden, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab, layers, heads, groups, hidden, ffn):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, heads, groups, ffn) for _ in range(layers))
        self.norm = RmsNorm(hidden)


class Llama(nn.Module):
    """Parameter names are LlamaForCausalLM's, so its state_dict loads into Hugging Face's model as it is."""

    def __init__(self, vocab, layers, heads, groups, hidden, ffn, rotary_base=10000.0):
        super().__init__()
        self.head_dim, self.rotary_base = hidden // heads, rotary_base
        self.model = LlamaModel(vocab, layers, heads, groups, hidden, ffn)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        cos, sin = rotary_cos_sin(ids.shape[1], self.head_dim, self.rotary_base, torch.float32)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


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
    elif model_name == "llama":
        model = Llama(256, 4, 8, 2, 256, 704)
        inputs = torch.randint(0, 256, (batch, seq), generator=generator)
        targets = torch.randint(0, 256, (batch, seq), generator=generator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    else:
        raise SystemExit(f"unknown case {case}")
    return model, inputs, targets, optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True,
                        help="mlp_f32, mlp_bf16, cnn_f32, cnn_bf16, gpt_f32, gpt_bf16, llama_f32, llama_bf16")
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
