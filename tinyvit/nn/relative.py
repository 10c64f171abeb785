"""Multi-head self-attention with relative position embeddings, the fourth variant of the paper's
appendix D.4 (Table 8, "Relative Pos. Emb."). The paper, D.4:

    "we use 1-dimensional Relative Attention, in which we define the relative distance [between] all
    possible pairs of patches. Thus, for every given pair (one as query, and the other as key/value in
    the attention mechanism), we have an offset p_q - p_k, where each offset is associated with an
    embedding. Then, we simply run extra attention, where we use the original query (the content of
    query), but use relative positional embeddings as keys. We then use the logits from the relative
    attention as a bias term and add it to the logits of the main attention (content-based attention)
    before applying softmax."

So, per head, with the T tokens at sequence positions 0..T-1 and one embedding r_o in R^{D_h} for each
of the 2T - 1 offsets o = p_q - p_k in [-(T-1), T-1]:

    A = softmax((q k^T + R) / sqrt(D_h)),   R[i, j] = q_i . r_{i - j}

The paper says no more, so three choices are ours, each the plain reading: the offsets are those of
the token sequence (1-D, raster order, the class token at position 0: the paper's "patches" leave it
out, and the official code has no relative variant to follow); each layer has its own table (as each
has its own keys), split into heads as the keys are; and the bias is scaled with the content logits,
since "extra attention" scales its logits as attention does. The table starts as N(0, 0.02), as the
learned absolute embeddings do.

This module is built from the engine's ops (linear, matmul, reshape, slicing, softmax): no kernel of
its own, and kernels.fuse leaves a model that has it unfused. Its backward is the ops' backward; the
tests check it against finite differences and, with a zero table, against the standard attention.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from .. import functional as F
from . import init
from .layers import Dropout, Linear
from .module import Module, Parameter


def relative_logits(rel, tokens: int):
    """Rearrange the logits of every query against every offset into query-key logits.

    rel: (..., T, 2T - 1) with rel[..., i, T - 1 + o] = q_i . r_o for the offset o = p_q - p_k
    -> (..., T, T) with out[..., i, j] = rel[..., i, T - 1 + i - j] = q_i . r_{i - j}.

    Row i needs columns T-1+i down to i: reversed, those are the columns T-1-i .. 2T-2-i, a window that
    slides one column left per row. Laid out flat, row i of the reversed array starts at i (2T - 1),
    so the window starts at i (2T - 1) + T - 1 - i = T - 1 + i (2T - 2): reading the flat array from
    T - 1 in rows of 2T - 2 puts every window at the start of its row (Music Transformer's "skewing",
    Huang et al. 2018). Slices and reshapes only: no gather, no scatter in the backward."""
    t = tokens
    if t == 1:
        return rel
    lead = tuple(rel.shape[:-2])
    flipped = rel[..., ::-1]                                          # column c <- offset T - 1 - c
    flat = F.reshape(flipped, lead + (t * (2 * t - 1),))
    rows = F.reshape(flat[..., t - 1:t - 1 + t * (2 * t - 2)], lead + (t, 2 * t - 2))
    return rows[..., :t]


class RelativeMultiHeadAttention(Module):
    """MSA (Eq. 5-8) whose logits get the relative-position bias of appendix D.4 (module docstring).

    x: (B, T, dim) -> (B, T, dim); with return_attention=True also A: (B, heads, T, T).
    qkv, proj and their initialisation as nn.MultiHeadAttention's (the same parameter names), plus
    rel_pos: (2T - 1, dim), row T - 1 + o the embedding of offset o = p_q - p_k, heads side by side
    (columns [h D_h, (h+1) D_h) for head h, as the keys' columns are). ``tokens`` is T: the table
    covers one sequence length, so another image size needs another model."""

    def __init__(self, dim: int, num_heads: int, tokens: int, qkv_bias: bool = True,
                 attn_dropout: float = 0.0, proj_dropout: float = 0.0):
        super().__init__()
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"RelativeMultiHeadAttention: dim={dim} is not divisible by num_heads={num_heads}")
        if tokens < 1:
            raise ValueError(f"RelativeMultiHeadAttention: tokens must be >= 1, got {tokens}")
        self.dim, self.num_heads, self.head_dim, self.tokens = dim, num_heads, dim // num_heads, tokens
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias)
        bound = math.sqrt(6.0 / (dim + dim))          # as nn.MultiHeadAttention: three (dim, dim) matrices
        init.uniform_(self.qkv.weight, -bound, bound)
        self.rel_pos = init.normal_(Parameter(np.zeros((2 * tokens - 1, dim), backend.get_default_dtype())),
                                    std=0.02)
        self.attn_drop = Dropout(attn_dropout)
        self.proj = Linear(dim, dim)
        self.proj_drop = Dropout(proj_dropout)

    def forward(self, x, return_attention: bool = False):
        b, t, d = x.shape
        if t != self.tokens:
            raise ValueError(f"relative position embeddings cover sequences of {self.tokens} tokens, got {t}: "
                             "a model with relative position embeddings takes one image size")
        h, dh = self.num_heads, self.head_dim
        qkv = F.permute(F.reshape(self.qkv(x), (b, t, 3, h, dh)), (2, 0, 3, 1, 4))   # (3, B, H, T, D_h), Eq. 5
        q, k, v = qkv[0], qkv[1], qkv[2]
        keys = F.permute(F.reshape(self.rel_pos, (2 * t - 1, h, dh)), (1, 2, 0))     # (H, D_h, 2T - 1)
        content = F.matmul(q, F.permute(k, (0, 1, 3, 2)))                            # q_i . k_j, (B, H, T, T)
        position = relative_logits(F.matmul(q, keys), t)                            # q_i . r_{i-j}, (B, H, T, T)
        attn = F.softmax((content + position) * (1.0 / math.sqrt(dh)), axis=-1)     # Eq. 6 plus the bias
        ctx = F.matmul(self.attn_drop(attn), v)                                      # Eq. 7, (B, H, T, D_h)
        out = self.proj_drop(self.proj(F.reshape(F.permute(ctx, (0, 2, 1, 3)), (b, t, d))))   # Eq. 8
        return (out, attn) if return_attention else out

    def extra_repr(self):
        return f"dim={self.dim}, num_heads={self.num_heads}, tokens={self.tokens}"
