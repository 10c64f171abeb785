"""Masked patch prediction, the paper's self-supervision (section 4.6, appendix B.1.2).

BERT's masked language modelling (Devlin et al. 2019) carried over to image patches, in EMBEDDING
space: per image, choose a fraction ``rate`` of the N patch positions (the paper: 50%; it also tried
BERT's 15%) and corrupt the chosen patch embeddings x_p^i E before the position embeddings are added:

    80% of the chosen  ->  a learnable [mask] embedding           (kind 1)
    10%                ->  the embedding of a random other patch  (kind 2)
    10%                ->  kept as they are                       (kind 3)
    z_0 = [x_class; corrupted x_p E] + E_pos,  then the encoder (Eq. 1-4) as usual.

From each chosen patch's own output token z_L^i a head predicts one of three targets, the loss
counting only the chosen patches (B.1.2 tried all three and reports option 1):
    "mean3bit"       the patch's mean colour, each channel quantised to 3 bits: 1 of 512 classes
    "downsized3bit"  the patch downsized to 4x4, each pixel in 3-bit colour: 16 predictions of 512
    "pixels-l2"      the whole patch (the normalised pixels the model sees) by L2 regression

Colour targets are computed on pixels in [0, 1]; the training data arrive normalised with the
dataset's mean and std, so the pre-training objective (tinyvit.training.MaskedPrediction) undoes
that first. After pre-training, ``to_vit()`` gives the encoder as a plain ViT (for fine-tuning or
few-shot evaluation). The paper's recipe (B.1.2) is tinyvit.training.recipes.PRETRAIN_RECIPE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from .. import backend
from .. import functional as F
from .. import nn
from ..autograd import Tensor, no_grad
from ..backend import get_array_module, get_default_dtype
from .vit import ViT, ViTConfig, is_number

TARGETS = ("mean3bit", "downsized3bit", "pixels-l2")
COLOURS = 512          # 3 bits for each of r, g, b
DOWNSIZED = 4          # "a 4 x 4 downsized version of the 16 x 16 patch"

# ====================================================================== the configuration


@dataclass
class MaskedConfig(ViTConfig):
    """A ViTConfig (the encoder's fields, same names) plus the pre-training task.

    num_classes must stay 0: the encoder has no classifier here (``to_vit(num_classes)`` adds one)."""
    num_classes: int = 0
    target: str = "mean3bit"        # one of TARGETS
    mask_rate: float = 0.5          # fraction of patch positions chosen per image (the paper: 0.5; BERT: 0.15)
    mask_fraction: float = 0.8      # of the chosen: replaced by the [mask] embedding
    random_fraction: float = 0.1    # of the chosen: replaced by another patch's embedding (the rest: kept)

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.target not in TARGETS:
            problems.append(f"target must be one of {TARGETS}, got {self.target!r}")
        if not (is_number(self.mask_rate) and 0.0 < self.mask_rate <= 1.0):
            problems.append(f"mask_rate must be in (0, 1], got {self.mask_rate!r}")
        for name in ("mask_fraction", "random_fraction"):
            if not (is_number(getattr(self, name)) and 0.0 <= getattr(self, name) <= 1.0):
                problems.append(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not problems and self.mask_fraction + self.random_fraction > 1.0 + 1e-9:
            problems.append(f"mask_fraction + random_fraction must be <= 1 (the rest is kept), got "
                            f"{self.mask_fraction} + {self.random_fraction}")
        if self.num_classes != 0:
            problems.append(f"num_classes must be 0 for a masked-prediction model (got {self.num_classes}); "
                            "to_vit(num_classes) gives a classifier")
        if self.representation_size:
            problems.append("representation_size (a pre-logits layer) has no use in masked patch prediction")
        if self.target != "pixels-l2" and self.in_channels not in (1, 3):
            problems.append(f"target {self.target!r} quantises RGB (or grey) colour; in_channels "
                            f"{self.in_channels} is neither 3 nor 1 (use pixels-l2)")
        if self.target == "downsized3bit" and self.patch_size % DOWNSIZED:
            problems.append(f"target 'downsized3bit' downsizes each patch to {DOWNSIZED}x{DOWNSIZED}: "
                            f"patch_size {self.patch_size} is not divisible by {DOWNSIZED}")
        if problems:
            raise ValueError("invalid MaskedConfig: " + "; ".join(problems))

    def encoder_config(self) -> ViTConfig:
        """The encoder's ViTConfig: every ViTConfig field of this config (no head)."""
        return ViTConfig(**{f.name: getattr(self, f.name) for f in fields(ViTConfig)})

    @property
    def target_shape(self) -> tuple:
        """What the head predicts per patch: (512,), (16, 512) or (C*P*P,)."""
        if self.target == "mean3bit":
            return (COLOURS,)
        if self.target == "downsized3bit":
            return (DOWNSIZED * DOWNSIZED, COLOURS)
        return (self.in_channels * self.patch_size ** 2,)


# ====================================================================== corruption (raw arrays)


def choose_corruption(batch: int, num_patches: int, rate: float, rng: np.random.Generator,
                      mask_fraction: float = 0.8, random_fraction: float = 0.1):
    """Draw which patches to corrupt and how, on the host.

    Returns kind: (B, N) int64 (0 untouched, 1 [mask], 2 another patch, 3 chosen but kept) and
    source: (B, N) int64, for each position the index into the flattened (B*N) patches whose
    embedding it takes (its own index except for kind 2).

    As BERT: exactly round(rate * N) positions (at least 1) per image, uniformly at random; each
    chosen one independently becomes kind 1, 2 or 3 with probabilities mask_fraction,
    random_fraction and the rest. The "other patch" of kind 2 is any patch of the whole batch but
    itself (usually from another image): BERT replaces a word by a random word of the vocabulary,
    i.e. one drawn from the data, not from the same sentence; and a patch of the same image often
    looks like its neighbours (smooth colour), which would make kind 2 almost as easy as kind 3.
    """
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"corruption rate must be in (0, 1], got {rate}")
    if min(mask_fraction, random_fraction) < 0 or mask_fraction + random_fraction > 1.0 + 1e-9:
        raise ValueError(f"mask_fraction {mask_fraction} and random_fraction {random_fraction} must be >= 0 "
                         "and sum to at most 1")
    b, n = batch, num_patches
    count = max(1, int(math.floor(rate * n + 0.5)))                       # patches chosen per image
    rank = rng.random((b, n)).argsort(axis=1).argsort(axis=1)              # a random permutation per row
    chosen = rank < count                                                  # (B, N), `count` True per row
    u = rng.random((b, n))
    kind = np.where(u < mask_fraction, 1, np.where(u < mask_fraction + random_fraction, 2, 3))
    kind = np.where(chosen, kind, 0).astype(np.int64)
    own = np.arange(b * n).reshape(b, n)
    if b * n == 1:                                                         # no other patch exists
        kind[kind == 2] = 1
        return kind, own
    other = rng.integers(0, b * n - 1, size=(b, n))                        # any index but one's own:
    other = other + (other >= own)                                         # skip over it
    return kind, np.where(kind == 2, other, own)


def apply_corruption(embeddings, mask_token, kind, source):
    """The corrupted tokens, with tensor ops so that gradients reach the embeddings and the mask token.

    embeddings: (B, N, D) Tensor or array   mask_token: (D,)   kind, source: (B, N) int arrays on the
    embeddings' device  ->  (B, N, D) Tensor: row (b, i) is mask_token where kind is 1, else the
    embedding at flat index source[b, i] (its own for kinds 0 and 3, another patch's for kind 2).
    """
    b, n, d = embeddings.shape
    flat = F.reshape(embeddings, (b * n, d))
    gathered = F.reshape(F.getitem(flat, source.reshape(-1)), (b, n, d))   # kind 2 takes another's row
    return F.where((kind == 1)[:, :, None], mask_token, gathered)          # kind 1 takes [mask]


def corrupt(embeddings, mask_token, rate, rng, mask_fraction: float = 0.8, random_fraction: float = 0.1):
    """Corrupt patch embeddings as BERT corrupts words (B.1.2), on raw arrays.

    embeddings: (B, N, D) array   mask_token: (D,) array   rate: fraction chosen per image, in (0, 1]
    rng: numpy Generator  ->  (corrupted (B, N, D) array, kind (B, N) int64 array on the same device):
    kind 0 untouched, 1 replaced by mask_token, 2 replaced by another patch's embedding (drawn from
    the whole batch, see choose_corruption), 3 chosen but kept. Same rng state, same result.
    """
    xp = get_array_module(embeddings)
    if embeddings.ndim != 3 or mask_token.shape != embeddings.shape[-1:]:
        raise ValueError(f"corrupt: expected embeddings (B, N, D) and mask_token (D,), got "
                         f"{embeddings.shape} and {mask_token.shape}")
    kind, source = choose_corruption(embeddings.shape[0], embeddings.shape[1], rate, rng,
                                     mask_fraction, random_fraction)
    kind, source = xp.asarray(kind), xp.asarray(source)
    with no_grad():
        return apply_corruption(embeddings, mask_token, kind, source).data, kind


# ====================================================================== targets (raw arrays)


def patchify(images, patch_size: int):
    """(B, C, H, W) -> (B, N, C, P, P): the patches of Eq. 1, numbered row-major over the grid."""
    b, c, h, w = images.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by the patch size {p}")
    return (images.reshape(b, c, h // p, p, w // p, p)
            .transpose(0, 2, 4, 1, 3, 5)                          # (B, H/P, W/P, C, P, P)
            .reshape(b, (h // p) * (w // p), c, p, p))


def quantize_3bit(colours):
    """Colours (..., C) in [0, 1], C = 3 (RGB) or 1 (grey, used as r = g = b) -> (...) int64 in
    [0, 512): r*64 + g*8 + b with each channel's 3-bit level min(floor(8 * value), 7)."""
    xp = get_array_module(colours)
    c = colours.shape[-1]
    if c not in (1, 3):
        raise ValueError(f"3-bit colour needs 3 (RGB) or 1 (grey) channels, got {c}")
    levels = xp.clip(xp.floor(colours * 8), 0, 7).astype(np.int64)        # (..., C) in 0..7
    if c == 1:
        levels = xp.concatenate([levels] * 3, axis=-1)                     # grey: r = g = b
    return levels[..., 0] * 64 + levels[..., 1] * 8 + levels[..., 2]


def mean_color_3bit(images, patch_size: int):
    """Target (a) of B.1.2: each patch's mean colour in 3 bits per channel.
    images: (B, C, H, W) in [0, 1], C = 3 or 1  ->  (B, N) int64 in [0, 512). Grey images: the mean
    grey level g gives r = g = b, i.e. index 73 * level (8 of the 512 classes)."""
    means = patchify(images, patch_size).mean(axis=(3, 4))                 # (B, N, C)
    return quantize_3bit(means)


def downsized_3bit(images, patch_size: int, size: int = DOWNSIZED):
    """Target (b) of B.1.2: each patch area-downsized to size x size, each pixel in 3-bit colour.
    images: (B, C, H, W) in [0, 1]  ->  (B, N, size*size) int64, pixels row-major within the patch.
    The patch size must be divisible by ``size`` (each small pixel averages (P/size)^2 pixels)."""
    p = patch_size
    if p % size:
        raise ValueError(f"cannot downsize {p}x{p} patches to {size}x{size}: {p} is not divisible by {size}")
    patches = patchify(images, p)                                          # (B, N, C, P, P)
    b, n, c = patches.shape[:3]
    k = p // size
    small = patches.reshape(b, n, c, size, k, size, k).mean(axis=(4, 6))   # (B, N, C, size, size)
    small = small.transpose(0, 1, 3, 4, 2).reshape(b, n, size * size, c)   # (B, N, size*size, C)
    return quantize_3bit(small)


def patch_pixels(images, patch_size: int):
    """Target (c) of B.1.2: the whole patch, flattened in (C, P, P) order like the patch embedding's
    input. images: (B, C, H, W) (the normalised images the model sees)  ->  (B, N, C*P*P)."""
    patches = patchify(images, patch_size)
    return patches.reshape(patches.shape[0], patches.shape[1], -1)


def make_targets(target: str, pixels, normalised, patch_size: int):
    """The targets of every patch: (B, N) / (B, N, 16) class indices, or (B, N, C*P*P) floats.
    pixels: the images in [0, 1] (for the colour targets); normalised: as the model sees them
    (for pixels-l2, so the regression targets have zero mean and unit variance per channel)."""
    if target == "mean3bit":
        return mean_color_3bit(pixels, patch_size)
    if target == "downsized3bit":
        return downsized_3bit(pixels, patch_size)
    if target == "pixels-l2":
        return patch_pixels(normalised, patch_size)
    raise ValueError(f"unknown target {target!r}; choose one of {TARGETS}")


# ====================================================================== the model


class MaskedPatchViT(nn.Module):
    """A ViT encoder (``self.vit``, parameters named vit.*) with a learnable [mask] embedding and a
    linear head that predicts each corrupted patch's target from its own output token.

        images (B, C, H, W) --vit.embed_patches--> (B, N, D) --corrupt--> --vit.add_position-->
        --vit.encode--> (B, 1+N, D) --chosen patches' tokens--> head --> (M, *target_shape)
    """
    arch = "masked-vit"
    config_class = MaskedConfig

    def __init__(self, config: MaskedConfig):
        super().__init__()
        self.config = cfg = config
        self.vit = ViT(cfg.encoder_config())
        self.mask_token = nn.init.normal_(nn.Parameter(np.zeros(cfg.dim, get_default_dtype())), std=0.02)  # (D,)
        self.head = nn.Linear(cfg.dim, math.prod(cfg.target_shape))
        self.head.weight.data[...] = 0.0      # zero-initialised as the paper's heads: the first loss is log 512
        self.head.bias.data[...] = 0.0

    def corrupted_tokens(self, images, rng=None):
        """Eq. 1 with corruption: (B, C, H, W) -> (corrupted patch embeddings (B, N, D), kind (B, N)).
        rng: a numpy Generator (default: tinyvit's seeded generator, saved in training checkpoints)."""
        cfg = self.config
        emb = self.vit.embed_patches(images)                                   # (B, N, D)
        b, n, _ = emb.shape
        kind, source = choose_corruption(b, n, cfg.mask_rate, backend.rng() if rng is None else rng,
                                         cfg.mask_fraction, cfg.random_fraction)
        xp = get_array_module(emb.data)
        kind, source = xp.asarray(kind), xp.asarray(source)
        return apply_corruption(emb, self.mask_token, kind, source), kind

    def predict(self, tokens):
        """The head: output tokens (..., D) -> (..., *target_shape) logits or pixels."""
        out = self.head(tokens)
        return F.reshape(out, tuple(tokens.shape[:-1]) + self.config.target_shape)

    def encode_corrupted(self, images, rng=None):
        """Corrupt, add E_pos (and the class token), run the encoder (Eq. 1-4):
        (B, C, H, W) -> (output tokens (B, prefix + N, D), kind (B, N))."""
        tokens, kind = self.corrupted_tokens(images, rng)
        return self.vit.encode(self.vit.add_position(tokens)), kind

    def forward(self, images, rng=None):
        """images (B, C, H, W) -> (predictions for every patch (B, N, *target_shape), kind (B, N)).
        For inspection; training uses ``loss``, which runs the head on the chosen patches only."""
        out, kind = self.encode_corrupted(images, rng)
        return self.predict(out[:, self.config.num_prefix_tokens:]), kind

    def loss(self, images, targets, rng=None):
        """The masked-patch-prediction loss, on the corrupted (chosen) patches only.

        images: (B, C, H, W) normalised   targets: every patch's target, (B, N) or (B, N, 16) int
        or (B, N, C*P*P) float (``make_targets``)  ->  (loss Tensor (), predictions (M, ...),
        targets (M, ...)) for the M = B * round(rate * N) chosen patches: mean cross-entropy for the
        colour targets, mean squared error for pixels-l2."""
        out, kind = self.encode_corrupted(images, rng)                        # (B, prefix + N, D), (B, N)
        return self.loss_of(out, kind, targets)

    def loss_of(self, out, kind, targets):
        """``loss`` from the encoder's output tokens out (B, prefix + N, D) and the corruption kind (B, N)."""
        xp = get_array_module(kind)
        rows, cols = xp.nonzero(kind > 0)                                      # (M,), (M,)
        chosen = out[rows, cols + self.config.num_prefix_tokens]               # (M, D)
        pred = self.predict(chosen)                                            # (M, *target_shape)
        target = xp.asarray(targets.data if isinstance(targets, Tensor) else targets)[rows, cols]
        if self.config.target == "pixels-l2":
            return F.mse(pred, target), pred, target
        return F.cross_entropy(pred, target), pred, target

    def forward_features(self, images, return_attention=False):
        """The uncorrupted encoder's representation (B, D), as ViT.forward_features."""
        return self.vit.forward_features(images, return_attention=return_attention)

    # ----- using the pre-trained encoder
    def encoder_state_dict(self) -> dict:
        """The encoder's arrays under a plain ViT's names (vit.blocks.0... -> blocks.0...)."""
        return {k[len("vit."):]: v for k, v in self.state_dict().items() if k.startswith("vit.")}

    def to_vit(self, num_classes: int = 0) -> ViT:
        """A plain ViT with this encoder's weights (copied) and, for num_classes > 0, a new
        zero-initialised head: the starting point of fine-tuning (section 3.2) and few-shot evaluation."""
        p = self.mask_token
        state = backend.rng().bit_generator.state            # building a ViT draws its init: leave the
        with backend.default_dtype(p.dtype):                 # global generator as it was
            vit = ViT(replace(self.config.encoder_config(), num_classes=num_classes))
        backend.rng().bit_generator.state = state
        vit.to(device=p.device)
        missing, unexpected = vit.load_state_dict(self.encoder_state_dict(), strict=False)
        if unexpected or any(not k.startswith("head.") for k in missing):
            raise RuntimeError(f"to_vit: the encoder does not fit a ViT (missing {missing}, unexpected {unexpected})")
        return vit.train(self.training)
