"""An independent Vision Transformer in plain PyTorch: the reference of tinyvit's parity tests
(tests/test_vit.py, test_posemb.py, and through tests/torch_hybrid.py test_hybrid.py) and the PyTorch
side of `tinyvit bench --compare torch`. PyTorch is an optional extra (``pip install
'tinyvit[reference]'``): only those import this module, and `import tinyvit` never does.

Written from the paper (Dosovitskiy et al. 2020, Eq. 1-4 and appendix D.4) and timm's
VisionTransformer layout (torch.nn.Conv2d patch embedding, a fused qkv Linear split as
(3, heads, head_dim), pre-norm blocks), NOT by translating tinyvit: it uses torch's own Conv2d,
LayerNorm, Linear (weight (out, in)), GELU, softmax and dropout. Where the paper is silent it follows
the official JAX code (vit_jax/models_vit.py): "gap" averages the patch tokens *after* the encoder's
final LayerNorm, and the pre-logits layer is Dense + tanh.

Position embedding variants (``posemb``):
    "learned-1d"  one table pos_embed (1, prefix + N, D)
    "learned-2d"  appendix D.4: an X table pos_embed_x (grid_w, D/2) and a Y table pos_embed_y
                  (grid_h, D/2); the patch in row i, column j gets concat(X[j], Y[i]); the class token none
    "sincos-2d"   fixed: [sin(x w), cos(x w), sin(y w), cos(y w)], w_k = 1 / 10000^(k / (D/4))
                  (MoCo v3 / big_vision's posemb_sincos_2d); the class token gets zeros
    "none"        no position embedding

Attention (``attention``): "explicit" writes q k^T -> softmax -> A v out with the (B, H, T, T) weights
materialised, as timm's non-fused path and tinyvit do (and can return them); "sdpa" calls
torch.nn.functional.scaled_dot_product_attention (timm's default on PyTorch 2, a fused kernel).

Takes keyword arguments with tinyvit's ViTConfig names: ``TorchViT(**dataclasses.asdict(cfg))`` or
``TorchViT.from_config(cfg)``; load_tinyvit_weights copies a tinyvit model's parameters in.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

try:
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError as exc:                    # pragma: no cover - depends on the installation
    raise ImportError("tinyvit.bench.torch_vit needs PyTorch: pip install 'tinyvit[reference]'") from exc

ATTENTIONS = ("explicit", "sdpa")


def sincos_2d_torch(grid_h, grid_w, dim, temperature=10000.0, dtype=torch.float64, device=None):
    """(grid_h * grid_w, dim) fixed embeddings, patches in row-major order."""
    y, x = torch.meshgrid(torch.arange(grid_h, dtype=torch.float64, device=device),
                          torch.arange(grid_w, dtype=torch.float64, device=device), indexing="ij")
    quarter = dim // 4
    omega = temperature ** (-torch.arange(quarter, dtype=torch.float64, device=device) / quarter)
    x = x.flatten()[:, None] * omega[None, :]
    y = y.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).to(dtype)


class DropPath(nn.Module):
    """Stochastic depth: drop each sample's residual branch with probability p while training."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)


class Attention(nn.Module):
    """timm's fused attention: qkv = Linear(D, 3D), reshaped (B, N, 3, heads, head_dim).
    Returns (out, weights): weights (B, heads, N, N) after softmax and before dropout, None for sdpa."""

    def __init__(self, dim, num_heads, qkv_bias, attn_dropout=0.0, proj_dropout=0.0, attention="explicit"):
        super().__init__()
        self.num_heads, self.head_dim, self.attention = num_heads, dim // num_heads, attention
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_dropout)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                                          # (B, heads, N, head_dim)
        if self.attention == "sdpa":
            attn = None
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            attn = attn.softmax(dim=-1)                                  # (B, heads, N, N)
            out = self.attn_drop(attn) @ v
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, d))), attn


class Mlp(nn.Module):
    def __init__(self, dim, hidden, approximate, dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        self.approximate = approximate

    def forward(self, x):
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x), approximate=self.approximate))))


class Block(nn.Module):
    """Pre-norm encoder block: x + MSA(LN(x)), then x + MLP(LN(x)) (Eq. 2, 3)."""

    def __init__(self, dim, num_heads, mlp_dim, qkv_bias, approximate, eps, dropout=0.0, attn_dropout=0.0,
                 drop_path=0.0, attention="explicit"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_dropout, dropout, attention)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, mlp_dim, approximate, dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        h, attn = self.attn(self.norm1(x))
        x = x + self.drop_path(h)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x, attn


class TorchViT(nn.Module):
    """images (B, C, H, W) -> logits (B, num_classes) (features (B, D) when num_classes is 0)."""

    def __init__(self, image_size=224, patch_size=16, in_channels=3, num_classes=1000, dim=768, depth=12,
                 num_heads=12, mlp_dim=3072, pool="token", posemb="learned-1d", representation_size=None,
                 qkv_bias=True, gelu_approximate="none", ln_eps=1e-6, dropout=0.0, attn_dropout=0.0,
                 drop_path=0.0, attention="explicit"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
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
        self.pos_drop = nn.Dropout(dropout)
        # stochastic depth grows linearly with depth (DeiT/timm)
        rates = np.linspace(0.0, drop_path, depth) if depth > 1 else [drop_path]
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_dim, qkv_bias, gelu_approximate, ln_eps, dropout,
                                           attn_dropout, float(r), attention) for r in rates])
        self.norm = nn.LayerNorm(dim, eps=ln_eps)
        width = dim
        if representation_size:
            self.pre_logits = nn.Module()
            self.pre_logits.fc = nn.Linear(dim, representation_size)
            width = representation_size
        else:
            self.pre_logits = None
        self.head = nn.Linear(width, num_classes) if num_classes else None

    @classmethod
    def from_config(cls, cfg, **kwargs) -> "TorchViT":
        """The model of a tinyvit ViTConfig (kwargs: attention=...)."""
        return cls(**dataclasses.asdict(cfg), **kwargs)

    def position_table(self, dtype, device=None):
        """(1, prefix + N, D) or None."""
        g, d = self.grid, self.dim
        if self.posemb == "learned-1d":
            return self.pos_embed
        if self.posemb == "learned-2d":
            table = torch.cat([self.pos_embed_x[None, :, :].expand(g, g, d // 2),     # X[j]: column j
                               self.pos_embed_y[:, None, :].expand(g, g, d // 2)],    # Y[i]: row i
                              dim=-1).reshape(1, g * g, d)
        elif self.posemb == "sincos-2d":
            table = sincos_2d_torch(g, g, d, dtype=dtype, device=device)[None]
        else:
            return None
        if self.prefix:
            table = torch.cat([table.new_zeros(1, 1, d), table], dim=1)
        return table

    def forward(self, x, return_attention=False):
        """x (B, C, H, W) -> logits; with return_attention also each block's (B, heads, T, T) weights."""
        if return_attention and self.blocks and self.blocks[0].attn.attention == "sdpa":
            raise ValueError("return_attention needs attention='explicit': sdpa keeps no weights")
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)        # (B, N, D), row-major patches
        if self.pool == "token":
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = self.position_table(x.dtype, x.device)
        if pos is not None:
            x = x + pos
        x = self.pos_drop(x)
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


# tinyvit's names for the two tables of learned-2d -> this model's (X indexes columns, Y rows)
TORCH_NAMES = {"pos_embed_col": "pos_embed_x", "pos_embed_row": "pos_embed_y"}


def load_tinyvit_weights(torch_model: TorchViT, model) -> None:
    """Copy a tinyvit ViT's parameters into ``torch_model`` (strictly: every parameter, no other):
    our (in, out) 2-D weights transposed, the patch embedding E: (C*P*P, D) reshaped to the conv
    kernel (D, C, P, P), the learned-2d tables renamed (TORCH_NAMES)."""
    from ..backend import to_numpy
    cfg = model.config
    state = {}
    for name, p in model.named_parameters():
        a = to_numpy(p.data)
        if name == "patch_embed.proj.weight":
            a = a.T.reshape(cfg.dim, cfg.in_channels, cfg.patch_size, cfg.patch_size)
        elif a.ndim == 2 and name not in TORCH_NAMES:
            a = a.T
        state[TORCH_NAMES.get(name, name)] = torch.from_numpy(np.ascontiguousarray(a))
    torch_model.load_state_dict(state, strict=True)
