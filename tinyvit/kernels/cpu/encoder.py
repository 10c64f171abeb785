"""The ViT encoder on the CPU, fast: models/vit.py's ``for block in blocks: x = block(x)`` then the
final LayerNorm, with three fusions across layers that no single op can make:

    residual add + next LayerNorm   each block's last residual add (Eq. 3) and the LayerNorm that
                                    reads its result (the next block's LN1, or the final LN of Eq. 4)
                                    run as one AddLayerNorm, as does Eq. 2's add with LN2
    LayerNorm affine folded         LN1's and LN2's scale and shift are folded into the qkv and fc1
                                    weights (FoldNormAffine), so the LayerNorms only standardise
    last block's queries            when the caller reads only the first tokens' outputs (the class
                                    token), the last block computes only those (attention with
                                    num_outputs = M < N: every token is still a key and a value)

It reads the model's own Parameters, so checkpoints and parameter names do not change, and it runs
only for the standard blocks: any block or layer of another class, or a module whose forward was
replaced, gets the reference (fused_encoder answers None). Random numbers (dropout, stochastic depth)
are drawn in the reference's order and shapes, so a seeded run gives the same masks on both paths.
Tests: tests/test_kernels_models.py (ViT, hybrid and masked models: logits and every gradient equal).
"""
from __future__ import annotations

import functools

from ... import nn
from ...ops.basic import getitem
from .attention import MultiHeadAttention
from .gelu import GELU, GELUTanh
from .layernorm import AddLayerNorm, LayerNorm, fold_norm_affine
from .linear import Linear


def _plain(module, cls) -> bool:
    """module is exactly a cls (not a subclass) and its forward was not replaced on the instance."""
    return type(module) is cls and "forward" not in vars(module)


def _standard_block(block, Block) -> bool:
    attn, mlp = block.attn, block.mlp
    return (_plain(block, Block) and _plain(block.norm1, nn.LayerNorm) and _plain(block.norm2, nn.LayerNorm)
            and _plain(attn, nn.MultiHeadAttention) and _plain(attn.qkv, nn.Linear) and _plain(attn.proj, nn.Linear)
            and _plain(attn.proj_drop, nn.Dropout) and _plain(block.drop_path, nn.DropPath)
            and _plain(mlp, nn.MLP) and _plain(mlp.fc1, nn.Linear) and _plain(mlp.fc2, nn.Linear)
            and _plain(mlp.act, nn.GELU) and _plain(mlp.drop1, nn.Dropout) and _plain(mlp.drop2, nn.Dropout))


def fused_encoder(tokens, blocks, norm):
    """encode(tokens, return_attention=False, num_outputs=None) for these blocks and final norm, or
    None when they are not the standard ones, or their parameters' dtype is not the tokens' (the
    reference then explains the mismatch)."""
    from ...models.vit import Block          # here: models import the switchboard, which imports this
    if not (len(blocks) and _plain(norm, nn.LayerNorm) and all(_standard_block(b, Block) for b in blocks)):
        return None
    if any(p.dtype != tokens.dtype for module in (*blocks, norm) for p in module.parameters()):
        return None
    return functools.partial(encode, blocks, norm)


def _skips_rows(block, return_attention) -> bool:
    """May the last block compute only some tokens' outputs? Not when the attention maps are asked for
    (they are returned whole), nor when it draws dropout masks whose shape has a row per token (the
    masks would differ from the reference's)."""
    if return_attention:
        return False
    if not block.training:
        return True
    rates = (block.attn.attn_dropout, block.attn.proj_drop.p, block.mlp.drop1.p, block.mlp.drop2.p)
    return all(p == 0.0 for p in rates)


def encode(blocks, norm, tokens, return_attention=False, num_outputs=None):
    """tokens (B, T, D) -> LN(z_L) (B, T, D), or its first num_outputs rows [, attentions]."""
    attentions = []
    last = len(blocks) - 1
    x, x_hat = tokens, LayerNorm.apply(tokens, None, None, blocks[0].norm1.eps)    # LN1 standardises only
    for i, block in enumerate(blocks):
        attn, mlp = block.attn, block.mlp
        m = num_outputs if i == last and _skips_rows(block, return_attention) else None
        w_qkv, b_qkv = fold_norm_affine(block.norm1.weight, block.norm1.bias, attn.qkv.weight, attn.qkv.bias)
        h = MultiHeadAttention.apply(x_hat, w_qkv, b_qkv, attn.proj.weight, attn.proj.bias, attn.num_heads,
                                     attn.attn_dropout, attn.training, return_attention=return_attention,
                                     num_outputs=m)
        if return_attention:
            h, a = h
            attentions.append(a)
        h = attn.proj_drop(h)
        if m is not None:
            x = getitem(x, (slice(None), slice(0, m)))                     # the asking tokens' stream
        x, x_hat = AddLayerNorm.apply(x, block.drop_path(h), None, None, block.norm2.eps)   # Eq. 2 + LN2
        w1, b1 = fold_norm_affine(block.norm2.weight, block.norm2.bias, mlp.fc1.weight, mlp.fc1.bias)
        gelu = GELU if mlp.act.approximate == "none" else GELUTanh
        hidden = mlp.drop1(gelu.apply(Linear.apply(x_hat, w1), b1))       # fc1's bias added by GELU
        branch = block.drop_path(mlp.drop2(Linear.apply(hidden, mlp.fc2.weight, mlp.fc2.bias)))
        if i < last:                                                       # Eq. 3 + the next LN1
            x, x_hat = AddLayerNorm.apply(x, branch, None, None, blocks[i + 1].norm1.eps)
        else:                                                              # Eq. 3 + the final LN
            _, x = AddLayerNorm.apply(x, branch, norm.weight, norm.bias, norm.eps)
    if num_outputs is not None and x.shape[1] > num_outputs:
        x = getitem(x, (slice(None), slice(0, num_outputs)))
    return (x, attentions) if return_attention else x
