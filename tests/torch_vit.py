"""An independent Vision Transformer in plain PyTorch, the reference for tinyvit's parity tests.

Written from the paper (Dosovitskiy et al. 2020, Eq. 1-4 and appendix D.4) and timm's
VisionTransformer layout (torch.nn.Conv2d patch embedding, a fused qkv Linear split as
(3, heads, head_dim), pre-norm blocks), NOT by translating tinyvit: it uses torch's own Conv2d,
LayerNorm, Linear (weight (out, in)), GELU and softmax. Where the paper is silent it follows the
official JAX code (vit_jax/models_vit.py): "gap" averages the patch tokens *after* the encoder's
final LayerNorm, and the pre-logits layer is Dense + tanh.

Position embedding variants (``posemb``):
    "learned-1d"  one table (1, prefix + N, D)
    "learned-2d"  appendix D.4: an X table (grid_w, D/2) and a Y table (grid_h, D/2); the patch in
                  row i, column j gets concat(X[j], Y[i]); the class token gets none
    "sincos-2d"   fixed: [sin(x w), cos(x w), sin(y w), cos(y w)], w_k = 1 / 10000^(k / (D/4))
                  (MoCo v3 / big_vision's posemb_sincos_2d); the class token gets zeros
    "none"        no position embedding

Takes keyword arguments with tinyvit's ViTConfig names (``TorchViT(**dataclasses.asdict(cfg))``);
dropout and stochastic depth are not implemented (the parity tests run without them).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def sincos_2d_torch(grid_h, grid_w, dim, temperature=10000.0, dtype=torch.float64):
    """(grid_h * grid_w, dim) fixed embeddings, patches in row-major order."""
    y, x = torch.meshgrid(torch.arange(grid_h, dtype=torch.float64),
                          torch.arange(grid_w, dtype=torch.float64), indexing="ij")
    quarter = dim // 4
    omega = temperature ** (-torch.arange(quarter, dtype=torch.float64) / quarter)
    x = x.flatten()[:, None] * omega[None, :]
    y = y.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).to(dtype)


class Attention(nn.Module):
    """timm's fused attention: qkv = Linear(D, 3D), reshaped (B, N, 3, heads, head_dim)."""

    def __init__(self, dim, num_heads, qkv_bias):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]                                 # (B, heads, N, head_dim)
        attn = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        attn = attn.softmax(dim=-1)                                      # (B, heads, N, N)
        out = (attn @ v).transpose(1, 2).reshape(b, n, d)
        return self.proj(out), attn


class Mlp(nn.Module):
    def __init__(self, dim, hidden, approximate):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.approximate = approximate

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm encoder block: x + MSA(LN(x)), then x + MLP(LN(x)) (Eq. 2, 3)."""

    def __init__(self, dim, num_heads, mlp_dim, qkv_bias, approximate, eps):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, mlp_dim, approximate)

    def forward(self, x):
        h, attn = self.attn(self.norm1(x))
        x = x + h
        x = x + self.mlp(self.norm2(x))
        return x, attn


class TorchViT(nn.Module):
    def __init__(self, image_size=224, patch_size=16, in_channels=3, num_classes=1000, dim=768, depth=12,
                 num_heads=12, mlp_dim=3072, pool="token", posemb="learned-1d", representation_size=None,
                 qkv_bias=True, gelu_approximate="none", ln_eps=1e-6, dropout=0.0, attn_dropout=0.0,
                 drop_path=0.0):
        super().__init__()
        assert dropout == attn_dropout == drop_path == 0.0, "the reference has no dropout"
        self.pool, self.posemb, self.dim = pool, posemb, dim
        self.grid = image_size // patch_size
        self.prefix = 1 if pool == "token" else 0
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        if pool == "token":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        if posemb == "learned-1d":
            self.pos_embed = nn.Parameter(torch.randn(1, self.prefix + self.grid ** 2, dim) * 0.02)
        elif posemb == "learned-2d":
            self.pos_embed_x = nn.Parameter(torch.randn(self.grid, dim // 2) * 0.02)
            self.pos_embed_y = nn.Parameter(torch.randn(self.grid, dim // 2) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_dim, qkv_bias, gelu_approximate, ln_eps)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=ln_eps)
        width = dim
        if representation_size:
            self.pre_logits = nn.Module()
            self.pre_logits.fc = nn.Linear(dim, representation_size)
            width = representation_size
        else:
            self.pre_logits = None
        self.head = nn.Linear(width, num_classes) if num_classes else None

    def position_table(self, dtype):
        """(1, prefix + N, D) or None."""
        g, d = self.grid, self.dim
        if self.posemb == "learned-1d":
            return self.pos_embed
        if self.posemb == "learned-2d":
            table = torch.cat([self.pos_embed_x[None, :, :].expand(g, g, d // 2),     # X[j]: column j
                               self.pos_embed_y[:, None, :].expand(g, g, d // 2)],    # Y[i]: row i
                              dim=-1).reshape(1, g * g, d)
        elif self.posemb == "sincos-2d":
            table = sincos_2d_torch(g, g, d, dtype=dtype)[None]
        else:
            return None
        if self.prefix:
            table = torch.cat([torch.zeros(1, 1, d, dtype=table.dtype), table], dim=1)
        return table

    def forward(self, x, return_attention=False):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)        # (B, N, D), row-major patches
        if self.pool == "token":
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = self.position_table(x.dtype)
        if pos is not None:
            x = x + pos
        attentions = []
        for block in self.blocks:
            x, attn = block(x)
            attentions.append(attn)
        x = self.norm(x)
        x = x[:, 0] if self.pool == "token" else x.mean(dim=1)
        if self.pre_logits is not None:
            x = torch.tanh(self.pre_logits.fc(x))
        if self.head is not None:
            x = self.head(x)
        return (x, attentions) if return_attention else x
