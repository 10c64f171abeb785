"""The PyTorch side of `tinyvit bench --compare torch`: the same ViT in PyTorch eager, with the same
weights, batch, optimizer and thread count, timed the same way.

Only `tinyvit.bench` imports this module, and only when a comparison is asked for: PyTorch is not a
dependency of tinyvit (``pip install 'tinyvit[reference]'``).

The model follows timm's VisionTransformer layout (Conv2d patch embedding, a fused qkv Linear split
as (3, heads, head_dim), pre-norm blocks, torch.nn.LayerNorm/GELU/softmax). Attention is by default
written out as timm's non-fused path is, q k^T -> softmax -> A v with the (B, H, T, T) weights
materialised, the same algorithm as tinyvit's; ``attention="sdpa"`` uses
torch.nn.functional.scaled_dot_product_attention (timm's default on PyTorch 2, a fused kernel).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .backend import to_numpy

ATTENTIONS = ("explicit", "sdpa")


class DropPath(nn.Module):
    """Stochastic depth: drop each sample's residual branch with probability p while training."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = (torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device) >= self.p)
        return x * keep.to(x.dtype) / (1.0 - self.p)


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias, attn_dropout, proj_dropout, attention):
        super().__init__()
        self.num_heads, self.head_dim, self.attention = num_heads, dim // num_heads, attention
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_dropout)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                                          # (B, H, T, dh)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)
            attn = self.attn_drop(attn.softmax(dim=-1))                  # (B, H, T, T)
            out = attn @ v
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, d)))


class Block(nn.Module):
    """x = x + MSA(LN(x)); x = x + MLP(LN(x))  (Eq. 2, 3)."""

    def __init__(self, cfg, drop_path, attention):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.attn = Attention(cfg.dim, cfg.num_heads, cfg.qkv_bias, cfg.attn_dropout, cfg.dropout, attention)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.mlp.act = nn.GELU(approximate=cfg.gelu_approximate)
        self.mlp.drop1 = nn.Dropout(cfg.dropout)
        self.mlp.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)
        self.mlp.drop2 = nn.Dropout(cfg.dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class TorchViT(nn.Module):
    """A ViT built from a tinyvit ViTConfig, with tinyvit's parameter names (torch layouts).
    images (B, C, H, W) -> logits (B, num_classes)."""

    def __init__(self, cfg, attention="explicit"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.cfg = cfg
        d, g = cfg.dim, cfg.grid_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        if cfg.pool == "token":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        if cfg.posemb == "learned-1d":
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_prefix_tokens + g * g, d))
        elif cfg.posemb == "learned-2d":
            self.pos_embed_row = nn.Parameter(torch.zeros(g, d // 2))
            self.pos_embed_col = nn.Parameter(torch.zeros(g, d // 2))
        elif cfg.posemb == "sincos-2d":                      # fixed: copied by load_tinyvit_weights
            self.register_buffer("pos_fixed", torch.zeros(1, cfg.num_prefix_tokens + g * g, d))
        self.pos_drop = nn.Dropout(cfg.dropout)
        rates = np.linspace(0.0, cfg.drop_path, cfg.depth) if cfg.depth > 1 else [cfg.drop_path]
        self.blocks = nn.ModuleList([Block(cfg, float(r), attention) for r in rates])
        self.norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        width = d
        if cfg.representation_size:
            self.pre_logits = nn.Module()
            self.pre_logits.fc = nn.Linear(d, cfg.representation_size)
            width = cfg.representation_size
        else:
            self.pre_logits = None
        self.head = nn.Linear(width, cfg.num_classes) if cfg.num_classes else None

    def position_table(self):
        cfg = self.cfg
        if cfg.posemb == "learned-1d":
            return self.pos_embed
        if cfg.posemb == "sincos-2d":
            return self.pos_fixed
        if cfg.posemb == "learned-2d":
            g, half = cfg.grid_size, cfg.dim // 2
            table = torch.cat([self.pos_embed_col[None, :, :].expand(g, g, half),    # X: the column's
                               self.pos_embed_row[:, None, :].expand(g, g, half)],   # Y: the row's
                              dim=-1).reshape(1, g * g, cfg.dim)
            if cfg.num_prefix_tokens:
                table = torch.cat([table.new_zeros(1, 1, cfg.dim), table], dim=1)
            return table
        return None

    def forward(self, images):
        x = self.patch_embed.proj(images).flatten(2).transpose(1, 2)      # (B, N, D)
        if self.cfg.pool == "token":
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = self.position_table()
        if pos is not None:
            x = x + pos
        x = self.pos_drop(x)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        x = x[:, 0] if self.cfg.pool == "token" else x.mean(dim=1)
        if self.pre_logits is not None:
            x = torch.tanh(self.pre_logits.fc(x))
        return self.head(x) if self.head is not None else x


def load_tinyvit_weights(torch_model: TorchViT, model) -> None:
    """Copy a tinyvit ViT's parameters into ``torch_model`` (our (in, out) 2-D weights transposed,
    the patch embedding E: (C*P*P, D) reshaped to the conv kernel (D, C, P, P))."""
    cfg = model.config
    state = {}
    for name, p in model.named_parameters():
        a = to_numpy(p.data)
        if name == "patch_embed.proj.weight":
            a = a.T.reshape(cfg.dim, cfg.in_channels, cfg.patch_size, cfg.patch_size)
        elif a.ndim == 2 and name not in ("pos_embed_row", "pos_embed_col"):
            a = a.T
        state[name] = torch.from_numpy(np.ascontiguousarray(a))
    if cfg.posemb == "sincos-2d":
        state["pos_fixed"] = torch.from_numpy(np.ascontiguousarray(to_numpy(model.position_embedding(np, np.float32))))
    torch_model.load_state_dict(state, strict=True)


@contextlib.contextmanager
def torch_settings(threads: int, tf32: bool):
    """PyTorch on ``threads`` CPU threads and with TF32 matmuls/convolutions on or off inside the
    block (the settings tinyvit's side runs with), restored after."""
    saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


def torch_step(weights, images, labels, *, device="cpu", dtype="float32", seed=0, attention="explicit", lr=1e-3,
               weight_decay=0.05):
    """Build PyTorch's side from the tinyvit ViT ``weights`` and return (step, sync, losses, info):
    step() is forward, F.cross_entropy, backward, torch.optim.AdamW (its default implementation)."""
    if type(weights).__name__ != "ViT":
        raise ValueError(f"--compare torch supports the plain ViT variants, not {type(weights).__name__}")
    on_gpu = device != "cpu"
    tdevice = torch.device("cuda", int(device.split(":")[1])) if on_gpu else torch.device("cpu")
    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    torch.manual_seed(seed)
    model = TorchViT(weights.config, attention=attention)
    load_tinyvit_weights(model, weights)
    model = model.to(device=tdevice, dtype=tdtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    x, y = torch.from_numpy(images).to(tdevice), torch.from_numpy(labels).to(tdevice)
    losses = []

    def step():
        loss = F.cross_entropy(model(x), y)               # forward and loss
        opt.zero_grad()
        loss.backward()                                     # backward
        opt.step()                                          # AdamW update
        losses.append(loss.detach())

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    info = {"torch_version": torch.__version__, "attention": attention, "torch_threads": torch.get_num_threads()}
    return step, sync, losses, info


class PeakTorchCuda:
    """torch.cuda.max_memory_reserved() over a ``with`` block (the caching allocator's high-water mark),
    over what it held at the start. (Written for CUDA; not exercised on a CPU-only machine.)"""
    method = "torch-max-reserved"

    def __init__(self, device: str):
        self.device = torch.device("cuda", int(device.split(":")[1]))

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_reserved(self.device)
        return self

    def __exit__(self, *exc):
        self.bytes = max(0, torch.cuda.max_memory_reserved(self.device) - self.start)
        return False
