"""fast = tinyvit.kernels.fuse(model): speed that spans layers, as one explicit step.

The way nanoGPT's train.py writes ``model = torch.compile(model)``, the training loop and the bench
write ``forward = kernels.fuse(model)`` and call ``forward`` instead of ``model``. ``model(x)`` itself
is untouched and still runs every ``Block.forward`` as written; ``fuse(model)(x)`` gives the same
logits and the same gradients (tests/test_kernels_fusion.py) from the same Parameters, with the
encoder (Eq. 2-4: ``for block in blocks: x = block(x)``, then the final LayerNorm) run with three
fusions across layers that no single op can make:

    residual add + next LayerNorm   each block's last residual add (Eq. 3) and the LayerNorm that
                                    reads its result (the next block's LN1, or the final LN of Eq. 4)
                                    run as one AddLayerNorm, as does Eq. 2's add with LN2
    LayerNorm affine folded         LN1's and LN2's scale and shift are folded into the qkv and fc1
                                    weights (FoldNormAffine), so the LayerNorms only standardise
    class token only, last block    the head reads only the class token (pool="token"), so the last
                                    block computes only that token's output (attention with
                                    num_outputs = 1: every token is still a key and a value)

Everything around the encoder is the model's own code (embed_patches, add_position, pool, head;
the masked model's corruption and loss). It fuses only what it knows: a ViT (or hybrid, or the
masked-prediction model's ViT) whose blocks and layers are exactly the standard classes with their
own forward methods, on NumPy arrays with the CPU kernels on. Anything else (a Block subclass, a
patched forward, CuPy arrays, ``use_kernels(False)``) runs the model's own code. Random numbers
(dropout, stochastic depth) are drawn in the reference's order and shapes, so a seeded run gives the
same masks either way.
"""
from __future__ import annotations

import numpy as np

from .. import nn
from ..autograd import Tensor
from ..models.masked import MaskedPatchViT
from ..models.vit import Block, ViT
from ..ops.basic import getitem
from . import kernels_enabled
from .cpu.attention import MultiHeadAttention
from .cpu.gelu import GELU, GELUTanh
from .cpu.layernorm import AddLayerNorm, LayerNorm, fold_norm_affine
from .cpu.linear import Linear


def fuse(model):
    """The model with its encoder fused across layers (see above), or ``model`` itself when there is
    nothing this module knows how to fuse (why_not(model) says why). Shares the model's Parameters:
    the optimizer, checkpoints and train()/eval() stay the model's."""
    return model if why_not(model) else Fused(model)


def why_not(model) -> str | None:
    """Why ``fuse(model)`` would return the model unchanged, or None when it fuses."""
    if not kernels_enabled():
        return "the kernels are off"
    vit = model.vit if isinstance(model, MaskedPatchViT) else model
    if not isinstance(vit, ViT):
        return f"{type(model).__name__} is not a ViT"
    if getattr(vit.config, "posemb", None) == "relative":
        return "its attention carries relative position embeddings (appendix D.4), a bias no fused kernel adds"
    if not (len(vit.blocks) and _plain(vit.norm, nn.LayerNorm) and all(_standard_block(b) for b in vit.blocks)):
        return "its encoder is not made of the standard blocks and layers (a subclass or a replaced forward)"
    return None


class Fused:
    """What fuse(model) returns: call it as the model (ViT, hybrid), or call ``loss`` as the masked
    model's. ``model`` is the model itself."""

    def __init__(self, model):
        self.model = model

    @property
    def config(self):
        return self.model.config

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, images):
        """ViT.forward with the encoder fused: images (B, C, H, W) -> logits (B, num_classes)."""
        m = self.model
        tokens = m.add_position(m.embed_patches(images))                      # z_0, Eq. 1
        num_outputs = 1 if m.config.pool == "token" else None               # the head reads the class token
        return m.head(m.pre_logits(m.pool(encode(m, tokens, num_outputs))))   # Eq. 2-4, the head

    def loss(self, images, targets, rng=None):
        """MaskedPatchViT.loss with the encoder fused."""
        m = self.model
        tokens, kind = m.corrupted_tokens(images, rng)
        return m.loss_of(encode(m.vit, m.vit.add_position(tokens)), kind, targets)


def encode(vit, tokens, num_outputs=None):
    """vit.encode(tokens) fused, (B, T, D) -> (B, T, D); with num_outputs only the first tokens'
    outputs, (B, num_outputs, D). The model's own encode where the kernels cannot run."""
    blocks, norm = vit.blocks, vit.norm
    data = tokens.data if isinstance(tokens, Tensor) else tokens
    usable = (kernels_enabled() and isinstance(data, np.ndarray)
              and all(p.dtype == data.dtype for module in (*blocks, norm) for p in module.parameters()))
    if not usable:                     # CuPy arrays, kernels switched off since, or a dtype mismatch
        x = vit.encode(tokens)
        return x if num_outputs is None else x[:, :num_outputs]
    last = len(blocks) - 1
    x, x_hat = tokens, LayerNorm.apply(tokens, None, None, blocks[0].norm1.eps)    # LN1 standardises only
    for i, block in enumerate(blocks):
        attn, mlp = block.attn, block.mlp
        m = num_outputs if i == last and _skips_rows(block) else None
        w_qkv, b_qkv = fold_norm_affine(block.norm1.weight, block.norm1.bias, attn.qkv.weight, attn.qkv.bias)
        h = MultiHeadAttention.apply(x_hat, w_qkv, b_qkv, attn.proj.weight, attn.proj.bias, attn.num_heads,
                                     attn.attn_dropout, attn.training, num_outputs=m)
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
    return x


def _plain(module, cls) -> bool:
    """module is exactly a cls (not a subclass) and its forward was not replaced on the instance."""
    return type(module) is cls and "forward" not in vars(module)


def _standard_block(block) -> bool:
    attn, mlp = block.attn, block.mlp
    return (_plain(block, Block) and _plain(block.norm1, nn.LayerNorm) and _plain(block.norm2, nn.LayerNorm)
            and _plain(attn, nn.MultiHeadAttention) and _plain(attn.qkv, nn.Linear) and _plain(attn.proj, nn.Linear)
            and _plain(attn.proj_drop, nn.Dropout) and _plain(block.drop_path, nn.DropPath)
            and _plain(mlp, nn.MLP) and _plain(mlp.fc1, nn.Linear) and _plain(mlp.fc2, nn.Linear)
            and _plain(mlp.act, nn.GELU) and _plain(mlp.drop1, nn.Dropout) and _plain(mlp.drop2, nn.Dropout))


def _skips_rows(block) -> bool:
    """May the last block compute only some tokens' outputs? Not when it draws dropout masks whose
    shape has a row per token (the masks would differ from the reference's)."""
    if not block.training:
        return True
    rates = (block.attn.attn_dropout, block.attn.proj_drop.p, block.mlp.drop1.p, block.mlp.drop2.p)
    return all(p == 0.0 for p in rates)
