#!/usr/bin/env python3
"""Loads `flashlm export`'s safetensors file into the CS336 Transformer LM written in PyTorch (flashlm's
parameter names, load_state_dict(strict=True)) and prints the logits of the next token after a prompt.

    python3 examples/load_in_pytorch.py data/model.safetensors --prompt "This License"

Needs torch (Debian's python3-torch from scripts/setup-deps.sh, or scripts/setup-torch.sh's environment); the
`safetensors` package is used where installed, else the file is read by hand (its format is an 8-byte
length, a JSON header and the raw little-endian tensors). The prompt is encoded with the byte-level
tokenizer (prepare's default, vocabulary 256). The model is also the one tests/python/ checks flashlm's
logits and gradients against.
"""
import argparse
import json
import math
import struct
import sys

import torch

nn = torch.nn

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, theta):
    """Rotates interleaved pairs (x[..., 2i], x[..., 2i+1]) of [batch, seq, heads, head_dim] by t·theta^(-2i/d)."""
    b, t, h, d = x.shape
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[None, :, None, :], ang.sin().float()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d, heads, theta):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.heads, self.theta = heads, theta

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rope(q, self.theta), rope(k, self.theta)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return self.output_proj(o.transpose(1, 2).reshape(b, t, d))


class FFN(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), nn.Linear(d, f, bias=False)

    def forward(self, x):
        u = self.w1(x)
        return self.w2(u * torch.sigmoid(u) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, f, heads, theta, eps):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.ffn = RMSNorm(d, eps), Attention(d, heads, theta), RMSNorm(d, eps), FFN(d, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab, d, f, layers, heads, theta, eps):
        super().__init__()
        self.token_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, heads, theta, eps) for _ in range(layers))
        self.ln_final = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.token_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def read_safetensors_by_hand(path):
    """(tensors, metadata) of a safetensors file, without the safetensors package."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8: 8 + n])
    metadata = header.pop("__metadata__", {})
    data = blob[8 + n:]
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        tensors[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[t["dtype"]]).view(t["shape"])
    return tensors, metadata


def read_safetensors(path):
    try:
        from safetensors import safe_open
    except ImportError:
        return read_safetensors_by_hand(path)
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


def load_model(path):
    """The CS336 LM with the exported weights; its configuration comes from the file's metadata."""
    tensors, meta = read_safetensors(path)
    try:
        model = LM(int(meta["flashlm.vocab"]), int(meta["flashlm.d_model"]), int(meta["flashlm.d_ff"]),
                   int(meta["flashlm.layers"]), int(meta["flashlm.heads"]), float(meta["flashlm.rope_theta"]),
                   float(meta["flashlm.norm_eps"]))
    except KeyError as e:
        sys.exit(f"error: {path}: no {e} in the metadata: give a file written by flashlm export")
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a safetensors file from flashlm export")
    p.add_argument("--prompt", default="This License", help="text, encoded byte by byte")
    p.add_argument("--top", type=int, default=5, help="how many of the most likely next tokens to print")
    args = p.parse_args()
    model = load_model(args.model)
    tokens = torch.tensor([list(args.prompt.encode("utf-8"))])
    if tokens.numel() == 0:
        sys.exit("error: --prompt: give at least one character")
    with torch.no_grad():
        logits = model(tokens)[0, -1]  # the next token's
    print(f"logits of the next token: shape {tuple(logits.shape)}")
    values, ids = logits.topk(min(args.top, logits.numel()))
    for value, i in zip(values.tolist(), ids.tolist()):
        print(f"{i}\t{bytes([i]) if i < 256 else i!r}\t{value:.6f}")
    print("logits " + " ".join(f"{x:.7g}" for x in logits.tolist()))


if __name__ == "__main__":
    main()
