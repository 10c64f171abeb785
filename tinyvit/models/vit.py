"""The Vision Transformer of Dosovitskiy et al. (2020), sections 3.1 and 3.2, in reading order.

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (Eq. 1)   patch embedding + position
    z'_l = MSA(LN(z_{l-1})) + z_{l-1},   l = 1..L          (Eq. 2)   pre-norm attention block
    z_l  = MLP(LN(z'_l)) + z'_l,          l = 1..L          (Eq. 3)   pre-norm MLP block
    y    = LN(z_L^0)                                        (Eq. 4)   the class token's output
and a head on y. Where the paper is silent we follow the official code (google-research/
vision_transformer, vit_jax/models_vit.py) and say so.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

import numpy as np

from .. import functional as F
from .. import nn
from ..backend import get_array_module, get_default_dtype
from .posemb import sincos_2d

POOLS = ("token", "gap")
POSEMBS = ("learned-1d", "learned-2d", "sincos-2d", "relative", "none")
SIZES = ("image_size", "patch_size", "in_channels", "dim", "depth", "num_heads", "mlp_dim")   # each >= 1


def is_whole(value, minimum: int) -> bool:
    """Whether ``value`` is a whole number >= minimum (True and 2.0 are not whole numbers here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def is_number(value) -> bool:
    """Whether ``value`` is a real number (True is not one here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class ViTConfig:
    """Every number that defines a ViT. Defaults: ViT-B/16 at 224 px with a 1000-class head."""
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000
    dim: int = 768                  # D, the Transformer width ("Hidden size D" of Table 1)
    depth: int = 12                 # L, number of encoder blocks
    num_heads: int = 12
    mlp_dim: int = 3072
    pool: str = "token"             # "token": class token (Eq. 4); "gap": mean of patch tokens
    posemb: str = "learned-1d"      # appendix D.4's variants ("relative": a bias in each layer's attention)
    representation_size: int | None = None  # pre-training head's tanh hidden layer (None: off)
    qkv_bias: bool = True
    dropout: float = 0.0
    attn_dropout: float = 0.0
    drop_path: float = 0.0
    gelu_approximate: str = "none"
    ln_eps: float = 1e-6            # official code's LayerNorm epsilon

    def __post_init__(self):
        problems = self.size_problems()
        if problems:                                    # the checks below divide by these sizes
            raise ValueError("invalid ViTConfig: " + "; ".join(problems))
        if self.image_size % self.patch_size:
            problems.append(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if self.dim % self.num_heads:
            problems.append(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.pool not in POOLS:
            problems.append(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.posemb not in POSEMBS:
            problems.append(f"posemb must be one of {POSEMBS}, got {self.posemb!r}")
        if self.posemb == "learned-2d" and self.dim % 2:
            problems.append(f"posemb 'learned-2d' needs an even dim, got {self.dim}")
        if self.posemb == "sincos-2d" and self.dim % 4:
            problems.append(f"posemb 'sincos-2d' needs dim divisible by 4, got {self.dim}")
        if self.gelu_approximate not in ("none", "tanh"):
            problems.append(f"gelu_approximate must be 'none' or 'tanh', got {self.gelu_approximate!r}")
        for name in ("dropout", "attn_dropout", "drop_path"):
            value = getattr(self, name)
            if not (is_number(value) and 0.0 <= value < 1.0):
                problems.append(f"{name} must be in [0, 1), got {value!r}")
        if not isinstance(self.qkv_bias, bool):         # "maybe" or 2 would be truthy: a bias nobody asked for
            problems.append(f"qkv_bias must be true or false, got {self.qkv_bias!r}")
        if not (is_number(self.ln_eps) and self.ln_eps > 0):
            problems.append(f"ln_eps must be a positive number, got {self.ln_eps!r}")
        if problems:
            raise ValueError("invalid ViTConfig: " + "; ".join(problems))

    def size_problems(self) -> list:
        """What is wrong with the sizes, each named: SIZES must be whole numbers >= 1, num_classes
        and representation_size >= 0 (0: no head, no pre-logits; representation_size may be None)."""
        problems = [f"{name} must be a whole number >= 1, got {getattr(self, name)!r}"
                    for name in SIZES if not is_whole(getattr(self, name), 1)]
        if not is_whole(self.num_classes, 0):
            problems.append(f"num_classes must be a whole number >= 0, got {self.num_classes!r}")
        if self.representation_size is not None and not is_whole(self.representation_size, 0):
            problems.append(f"representation_size must be None or a whole number >= 0, "
                            f"got {self.representation_size!r}")
        return problems

    @property
    def grid_size(self) -> int:
        """Patches per side, H / P."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """N = HW / P^2, the sequence length of Eq. 1 (without the class token)."""
        return self.grid_size ** 2

    @property
    def num_prefix_tokens(self) -> int:
        return 1 if self.pool == "token" else 0

    @property
    def num_tokens(self) -> int:
        """T = N + the class token (if any): the sequence length of Eq. 2-3."""
        return self.num_patches + self.num_prefix_tokens

    def count_parameters(self) -> int:
        """Number of parameters of ViT(self), computed from the config (matches the built model)."""
        d, c, p = self.dim, self.in_channels, self.patch_size
        total = (c * p * p + 1) * d                                     # patch embedding E and bias
        total += d if self.pool == "token" else 0                        # class token
        if self.posemb == "learned-1d":
            total += self.num_tokens * d
        elif self.posemb == "learned-2d":
            total += 2 * self.grid_size * (d // 2)
        per_block = 4 * d                                               # two LayerNorms
        if self.posemb == "relative":                                   # a table of 2T - 1 offsets per block
            per_block += (2 * self.num_tokens - 1) * d
        per_block += d * 3 * d + (3 * d if self.qkv_bias else 0)         # qkv
        per_block += d * d + d                                          # output projection
        per_block += 2 * d * self.mlp_dim + self.mlp_dim + d              # MLP
        total += self.depth * per_block + 2 * d                          # blocks, final norm
        width = d
        if self.representation_size:
            total += d * self.representation_size + self.representation_size
            width = self.representation_size
        if self.num_classes:
            total += width * self.num_classes + self.num_classes
        return total

    def forward_flops(self) -> int:
        """Multiply-add FLOPs (2 per MAC) of one image's forward pass: every matmul, attention included;
        element-wise ops are ignored, as is usual."""
        d, t = self.dim, self.num_tokens
        flops = 2 * self.num_patches * self.in_channels * self.patch_size ** 2 * d   # patch embedding
        per_block = 2 * t * d * 3 * d          # qkv
        per_block += 2 * 2 * t * t * d         # q k^T and A v over all heads
        if self.posemb == "relative":
            per_block += 2 * t * (2 * t - 1) * d   # each query against the 2T - 1 offset embeddings
        per_block += 2 * t * d * d             # output projection
        per_block += 2 * 2 * t * d * self.mlp_dim
        flops += self.depth * per_block
        width = d
        if self.representation_size:
            flops += 2 * d * self.representation_size
            width = self.representation_size
        return flops + 2 * width * self.num_classes

    @classmethod
    def from_dict(cls, d: dict) -> "ViTConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ViTConfig fields: {sorted(unknown)}")
        return cls(**d)


# ---------------------------------------------------------------- building blocks


class PatchEmbed(nn.Module):
    """Eq. 1's x_p E: cut (B, C, H, W) into N = HW/P^2 patches of P*P*C values, project to D.
    images: (B, C, H, W) -> tokens (B, N, D). proj.weight is E: (C*P*P, D), patches in (C, P, P) order."""

    def __init__(self, image_size, patch_size, in_channels, dim):
        super().__init__()
        self.image_size, self.patch_size, self.in_channels = image_size, patch_size, in_channels
        self.proj = nn.Linear(in_channels * patch_size * patch_size, dim)
        # The official code's embedding is a flax Conv with its default LeCun-normal kernel init.
        nn.init.lecun_normal_(self.proj.weight)

    def forward(self, images):
        shape = tuple(images.shape)
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(f"expected images of shape (B, {self.in_channels}, H, W), got {shape}")
        return F.patch_embed(images, self.proj.weight, self.proj.bias, self.patch_size)


class Block(nn.Module):
    """One encoder layer, pre-norm (Eq. 2 and 3):  x = x + MSA(LN(x));  x = x + MLP(LN(x)).
    x: (B, N, D) -> (B, N, D). drop_path (stochastic depth) is off in the paper; DeiT/timm use it.
    The layers initialise themselves as the official code does (nn/layers.py says how)."""

    def __init__(self, cfg: ViTConfig, drop_path: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        if cfg.posemb == "relative":      # appendix D.4: a position bias in every layer's logits
            self.attn = nn.RelativeMultiHeadAttention(cfg.dim, cfg.num_heads, cfg.num_tokens, qkv_bias=cfg.qkv_bias,
                                                      attn_dropout=cfg.attn_dropout, proj_dropout=cfg.dropout)
        else:
            self.attn = nn.MultiHeadAttention(cfg.dim, cfg.num_heads, qkv_bias=cfg.qkv_bias,
                                              attn_dropout=cfg.attn_dropout, proj_dropout=cfg.dropout)
        self.drop_path = nn.DropPath(drop_path)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.mlp = nn.MLP(cfg.dim, cfg.mlp_dim, dropout=cfg.dropout, approximate=cfg.gelu_approximate)

    def forward(self, x, return_attention=False):
        """x: (B, N, D) -> (B, N, D) [, the attention weights A: (B, H, N, N)]."""
        h = self.attn(self.norm1(x), return_attention=return_attention)
        h, attn = h if return_attention else (h, None)           # A only when asked (a kernel can skip it)
        x = x + self.drop_path(h)                                # Eq. 2: z'_l = MSA(LN(z_{l-1})) + z_{l-1}
        x = x + self.drop_path(self.mlp(self.norm2(x)))          # Eq. 3: z_l = MLP(LN(z'_l)) + z'_l
        return (x, attn) if return_attention else x


class PreLogits(nn.Module):
    """The pre-training head's hidden layer: tanh(y W + b) (section 3.1, "MLP with one hidden layer")."""

    def __init__(self, dim, representation_size):
        super().__init__()
        self.fc = nn.Linear(dim, representation_size)
        nn.init.lecun_normal_(self.fc.weight)         # flax Dense default (LeCun normal), zero bias

    def forward(self, x):
        return F.tanh(self.fc(x))


# ---------------------------------------------------------------- the model


class ViT(nn.Module):
    """Vision Transformer. images (B, C, H, W) -> logits (B, num_classes).

    The forward pass is split into the steps of Eq. 1-4 so that other models reuse them: the hybrid
    replaces ``embed_patches``, masked patch prediction corrupts tokens between ``embed_patches``
    and ``add_position``.
    """
    arch = "vit"
    config_class = ViTConfig

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = cfg = config
        self.patch_embed = self.make_patch_embed(cfg)
        d = cfg.dim
        dtype = get_default_dtype()
        if cfg.pool == "token":
            self.cls_token = nn.Parameter(np.zeros((1, 1, d), dtype))          # x_class, zeros
        gh = gw = cfg.grid_size
        if cfg.posemb == "learned-1d":  # E_pos in R^{(N+1) x D}, N(0, 0.02) as the official code
            self.pos_embed = nn.init.normal_(nn.Parameter(np.zeros((1, cfg.num_tokens, d), dtype)),
                                             std=0.02)
        elif cfg.posemb == "learned-2d":  # appendix D.4: an X and a Y table of D/2 each
            self.pos_embed_row = nn.init.normal_(nn.Parameter(np.zeros((gh, d // 2), dtype)), std=0.02)
            self.pos_embed_col = nn.init.normal_(nn.Parameter(np.zeros((gw, d // 2), dtype)), std=0.02)
        self.pos_drop = nn.Dropout(cfg.dropout)
        # Stochastic depth grows linearly with depth (DeiT/timm); 0 everywhere by default.
        rates = np.linspace(0.0, cfg.drop_path, cfg.depth) if cfg.depth > 1 else [cfg.drop_path]
        self.blocks = nn.ModuleList([Block(cfg, float(r)) for r in rates])
        self.norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.pre_logits = PreLogits(d, cfg.representation_size) if cfg.representation_size else nn.Identity()
        self.head = self._zero_head(cfg.representation_size or d, cfg.num_classes)

    @staticmethod
    def make_patch_embed(cfg):
        return PatchEmbed(cfg.image_size, cfg.patch_size, cfg.in_channels, cfg.dim)

    @staticmethod
    def _zero_head(width, num_classes):
        if num_classes == 0:
            return nn.Identity()  # a feature extractor
        head = nn.Linear(width, num_classes)
        head.weight.data[...] = 0.0  # the paper zero-initialises the classification head
        head.bias.data[...] = 0.0
        return head

    def reset_head(self, num_classes: int) -> None:
        """Replace the whole head (pre-logits included) by a zero-initialised linear layer, as the
        paper does for fine-tuning (section 3.2)."""
        p = self.head.weight if isinstance(self.head, nn.Linear) else self.norm.weight
        self.pre_logits = nn.Identity()
        self.head = self._zero_head(self.config.dim, num_classes)
        self.head.to(device=p.device, dtype=p.dtype)
        self.config.representation_size = None
        self.config.num_classes = num_classes

    # ----- Eq. 1 -----
    def embed_patches(self, images):
        """(B, C, H, W) -> (B, N, D): the patch embeddings x_p^i E."""
        return self.patch_embed(images)

    def position_embedding(self, xp, dtype):
        """E_pos for the patch tokens and the class token: (1, num_prefix + N, D), or None (posemb "none",
        and "relative", whose embeddings are in each block's attention: nn.RelativeMultiHeadAttention)."""
        cfg = self.config
        if cfg.posemb == "learned-1d":
            return self.pos_embed
        if cfg.posemb == "learned-2d":
            gh, gw, half = self.pos_embed_row.shape[0], self.pos_embed_col.shape[0], cfg.dim // 2
            rows = F.reshape(self.pos_embed_row, (gh, 1, half)) + xp.zeros((1, gw, half), dtype)
            cols = F.reshape(self.pos_embed_col, (1, gw, half)) + xp.zeros((gh, 1, half), dtype)
            # [X | Y] for the patch at (row, col); the class token gets no position (appendix D.4
            # is silent; its own embedding is learned anyway).
            grid = F.reshape(F.concat([cols, rows], axis=-1), (1, gh * gw, cfg.dim))
            if cfg.num_prefix_tokens:
                grid = F.concat([xp.zeros((1, 1, cfg.dim), dtype), grid], axis=1)
            return grid
        if cfg.posemb == "sincos-2d":  # fixed, as big_vision's posemb_sincos_2d; class token 0
            table = sincos_2d(cfg.grid_size, cfg.grid_size, cfg.dim).astype(dtype)
            if cfg.num_prefix_tokens:
                table = np.concatenate([np.zeros((1, cfg.dim), dtype), table])
            return xp.asarray(table[None])
        return None

    def add_position(self, tokens):
        """Prepend the class token and add E_pos (Eq. 1), then dropout. (B, N, D) -> (B, N(+1), D)."""
        b = tokens.shape[0]
        xp = get_array_module(tokens)
        if self.config.pool == "token":
            cls = self.cls_token + xp.zeros((b, 1, self.config.dim), tokens.dtype)  # broadcast to the batch
            tokens = F.concat([cls, tokens], axis=1)
        pos = self.position_embedding(xp, tokens.dtype)
        if pos is not None:
            if pos.shape[1] != tokens.shape[1]:
                raise ValueError(f"position embeddings cover {pos.shape[1]} tokens but the input has "
                                 f"{tokens.shape[1]}: resize them with resize_pos_embed for a new image size")
            tokens = tokens + pos
        return self.pos_drop(tokens)

    # ----- Eq. 2-4 -----
    def encode(self, tokens, return_attention=False):
        """The L blocks (Eq. 2-3) and the final LayerNorm (Eq. 4). (B, T, D) -> (B, T, D)
        [, list of each block's attention weights (B, H, T, T)]."""
        x, attentions = tokens, []
        for block in self.blocks:
            x = block(x, return_attention=return_attention)
            if return_attention:
                x, attn = x
                attentions.append(attn)
        x = self.norm(x)
        return (x, attentions) if return_attention else x

    def pool(self, tokens):
        """y: the class token's output (Eq. 4) or, for "gap", the mean of the patch tokens
        (the official code applies the encoder norm first, then averages)."""
        if self.config.pool == "token":
            return tokens[:, 0]
        return F.mean(tokens, axis=1)

    def forward_features(self, images, return_attention=False):
        """images (B, C, H, W) -> the representation y (B, D) [, attentions]."""
        tokens = self.add_position(self.embed_patches(images))                 # z_0, Eq. 1
        out = self.encode(tokens, return_attention=return_attention)           # Eq. 2-4
        if return_attention:
            return self.pool(out[0]), out[1]
        return self.pool(out)

    def forward(self, images, return_attention=False):
        """images (B, C, H, W) -> logits (B, num_classes); with return_attention=True also the list
        of each layer's attention probabilities (B, heads, T, T), T = N + prefix tokens."""
        feats = self.forward_features(images, return_attention=return_attention)
        if return_attention:
            feats, attentions = feats
            return self.head(self.pre_logits(feats)), attentions
        return self.head(self.pre_logits(feats))
