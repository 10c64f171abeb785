"""Looking inside a trained ViT: the analyses of the paper's section 4.5.

    attention_rollout(attentions)                     Figure 6, appendix D.8: what the class token sees
    attention_distance(attentions, grid, patch)       Figure 7 right, appendix D.7: how far each head looks
    position_embedding_similarity(model)              Figure 7 center (and Figure 10): what E_pos learned
    embedding_filters(model)                          Figure 7 left: principal components of E
    inspect_checkpoint(path, images, out)             all four as PNGs (the `tinyvit inspect` command)

Every function takes arrays (NumPy or CuPy) or Tensors and returns arrays of the same array module;
the pictures are drawn by tinyvit/plots.py. Attention comes from ``model(x, return_attention=True)``:
a list with one (B, heads, T, T) array per layer, T = N patches (+ 1 class token for pool="token"),
the patches in row-major order of the (gh, gw) grid.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import backend
from ..autograd import Tensor, no_grad
from ..backend import get_array_module

_TINY = 1e-12  # guards divisions by a sum or a norm that may be 0


# ---------------------------------------------------------------- shared helpers


def _array(x):
    """The raw NumPy/CuPy array of a Tensor (its .data) or of anything array-like."""
    if isinstance(x, Tensor):
        return x.data
    return x if get_array_module(x) is not np else np.asarray(x)


def _float(a):
    """Integer or boolean arrays become float64; floating arrays keep their dtype."""
    return a if np.issubdtype(a.dtype, np.floating) else a.astype(np.float64)


def _pair(grid_size) -> tuple[int, int]:
    """7 -> (7, 7); (7, 9) -> (7, 9)."""
    gh, gw = (grid_size, grid_size) if np.ndim(grid_size) == 0 else tuple(grid_size)
    if int(gh) != gh or int(gw) != gw or gh < 1 or gw < 1:
        raise ValueError(f"grid_size must be a positive int or a pair of them, got {grid_size!r}")
    return int(gh), int(gw)


def stack_attentions(attentions):
    """One layer's attention (B, heads, T, T) per list entry -> one array (L, B, heads, T, T).

    Also accepts an already stacked (L, B, heads, T, T) array, and unbatched (heads, T, T) layers
    (taken as B = 1). Raises a ValueError naming the shapes when they do not fit together."""
    if isinstance(attentions, (list, tuple)):
        if not attentions:
            raise ValueError("no attention given: expected one (B, heads, T, T) array per layer")
        layers = [_array(a) for a in attentions]
        xp = get_array_module(*layers)
        layers = [xp.asarray(a) for a in layers]
        shapes = [tuple(a.shape) for a in layers]
        if len(set(shapes)) > 1:
            raise ValueError(f"every layer's attention must have the same shape (B, heads, T, T), got {shapes}")
        if layers[0].ndim == 3:
            layers = [a[None] for a in layers]
        att = xp.stack(layers)
    else:
        att = _array(attentions)
    if att.ndim != 5 or att.shape[-1] != att.shape[-2]:
        raise ValueError("attention must be a list of (B, heads, T, T) arrays, one per layer, or an "
                         f"(L, B, heads, T, T) array; got shape {tuple(att.shape)}")
    return _float(att)


def patch_layout(num_tokens: int, grid_size=None, num_prefix_tokens=None) -> tuple[int, int, int]:
    """(gh, gw, prefix): how T tokens split into ``prefix`` leading tokens (the class token) and a
    gh x gw patch grid. With no grid_size a square grid is inferred (T = g^2 or g^2 + 1, never both).
    Unless num_prefix_tokens says otherwise, the prefix must be 0 (GAP) or 1 (class token)."""
    if grid_size is None:
        prefixes = (0, 1) if num_prefix_tokens is None else (num_prefix_tokens,)
        fits = [(p, math.isqrt(num_tokens - p)) for p in prefixes
                if num_tokens - p >= 1 and math.isqrt(num_tokens - p) ** 2 == num_tokens - p]
        if not fits:
            raise ValueError(f"{num_tokens} tokens do not form a square patch grid (plus 0 or 1 class "
                             "token); pass grid_size")
        prefix, g = fits[0]
        return g, g, prefix
    gh, gw = _pair(grid_size)
    prefix = num_tokens - gh * gw if num_prefix_tokens is None else num_prefix_tokens
    allowed = (0, 1) if num_prefix_tokens is None else (num_prefix_tokens,)
    if prefix not in allowed or prefix < 0 or prefix + gh * gw != num_tokens:
        extra = "0 or 1 class token" if num_prefix_tokens is None else f"{num_prefix_tokens} prefix tokens"
        raise ValueError(f"attention over {num_tokens} tokens does not match a {gh}x{gw} patch grid "
                         f"({gh * gw} patches plus {extra})")
    return gh, gw, prefix


# ---------------------------------------------------------------- 1. attention rollout (appendix D.8)


class Rollout(NamedTuple):
    matrix: object   # (B, T, T): how much each output token draws on each input token
    map: object      # (B, gh, gw): the class token's row (GAP: the mean row) over the patches


def attention_rollout(attentions, grid_size=None, num_prefix_tokens=None) -> Rollout:
    """Attention rollout (Abnar & Zuidema 2020), the paper's Figure 6 and appendix D.8.

    For each layer l, average the attention weights over the heads, add the identity for the
    residual connection and renormalise the rows; then multiply across the layers:

        A_l = rownorm(mean_heads(W_l) + I)          (B, T, T)
        R   = A_L A_{L-1} ... A_1                   (B, T, T)

    R[b, i, j] is how much output token i is made of input token j. The map is the class token's row
    over the patches, R[:, 0, prefix:], or for GAP models (no class token) the mean of R's rows.

    attentions: list of (B, heads, T, T) per layer (arrays or Tensors; see stack_attentions).
    grid_size: the patch grid, int or (gh, gw) (None: a square grid inferred from T).
    Returns Rollout(matrix (B, T, T), map (B, gh, gw)), arrays of the input's array module.
    The map is not rescaled; plots.rollout_overlay divides it by its maximum, as the paper's figures.
    """
    att = stack_attentions(attentions)                       # (L, B, H, T, T)
    xp = get_array_module(att)
    _, b, _, t, _ = att.shape
    gh, gw, prefix = patch_layout(t, grid_size, num_prefix_tokens)
    a = att.mean(axis=2) + xp.eye(t, dtype=att.dtype)         # (L, B, T, T): heads fused, + residual
    a = a / a.sum(axis=-1, keepdims=True)                     # each row a distribution again
    rollout = a[0]
    for layer in a[1:]:                                       # R_l = A_l R_{l-1}
        rollout = layer @ rollout
    rows = rollout[:, 0, prefix:] if prefix else rollout.mean(axis=1)   # (B, N)
    return Rollout(rollout, rows.reshape(b, gh, gw))


# ---------------------------------------------------------------- 2. attention distance (appendix D.7)


def patch_distances(grid_size, patch_size, xp=np):
    """(N, N) distances in pixels between the centres of the patches of a gh x gw grid (row-major):
    the patch-grid distance times patch_size."""
    gh, gw = _pair(grid_size)
    rows, cols = xp.meshgrid(xp.arange(gh), xp.arange(gw), indexing="ij")
    centres = xp.stack([rows.ravel(), cols.ravel()], axis=1) * float(patch_size)   # (N, 2)
    offsets = centres[:, None, :] - centres[None, :, :]                            # (N, N, 2)
    return xp.sqrt((offsets ** 2).sum(axis=-1))


def attention_distance(attentions, grid_size, patch_size, num_prefix_tokens=None):
    """Mean attention distance per layer and head, in pixels: the paper's Figure 7 (right) and
    appendix D.7, the ViT analogue of a CNN's receptive field size.

    For each query patch i, the attention-weighted mean distance to the patches j it attends to,
        d_i = sum_j a_ij * ||c_i - c_j|| * patch_size      (c: patch centres on the grid),
    then averaged over the query patches and the images. The class token takes no part: its row
    (as query) and column (as key) are dropped and each query's remaining weights renormalised to
    sum to 1 (a query that puts all its weight on the class token contributes distance 0).

    attentions: list of (B, heads, T, T) per layer; grid_size: int or (gh, gw); patch_size: P.
    Returns (layers, heads), in the array module of the input.
    """
    att = stack_attentions(attentions)                       # (L, B, H, T, T)
    xp = get_array_module(att)
    gh, gw, prefix = patch_layout(att.shape[-1], grid_size, num_prefix_tokens)
    a = att[..., prefix:, prefix:]                            # (L, B, H, N, N): patches only
    a = a / xp.maximum(a.sum(axis=-1, keepdims=True), _TINY)  # renormalise each query's weights
    dist = patch_distances((gh, gw), patch_size, xp).astype(a.dtype)   # (N, N)
    per_query = (a * dist).sum(axis=-1)                       # (L, B, H, N)
    return per_query.mean(axis=(1, 3))                        # (L, H)


# ---------------------------------------------------------------- 3. position-embedding similarity


def position_embedding_similarity(source, grid_size=None, num_prefix_tokens=None):
    """Cosine similarity between the position embedding of each patch and those of all the others:
    the paper's Figure 7 (center) and Figure 10. The class token's entry is left out.

    source: a ViT (its ``position_embedding``, whatever the posemb kind) or a table (1, T, D) / (T, D).
    Returns (gh, gw, gh, gw): [r, c] is the (gh, gw) map of patch (r, c)'s similarity to every patch
    (ones at [r, c, r, c]; symmetric under swapping (r, c) with the last two indices).
    """
    if hasattr(source, "position_embedding"):
        cfg = source.config
        param = _array(next(iter(source.parameters())))
        with no_grad():
            source = source.position_embedding(get_array_module(param), param.dtype)
        if source is None and cfg.posemb == "relative":
            raise ValueError("the model's position embeddings are relative (posemb='relative': one per offset, "
                             "inside each layer's attention), not a table of one per patch to compare")
        if source is None:
            raise ValueError(f"the model has no position embeddings (posemb={cfg.posemb!r})")
        grid_size = cfg.grid_size if grid_size is None else grid_size
        num_prefix_tokens = cfg.num_prefix_tokens
    table = _float(_array(source))
    if table.ndim == 3 and table.shape[0] == 1:
        table = table[0]
    if table.ndim != 2:
        raise ValueError(f"position embeddings must be (1, T, D) or (T, D), got {tuple(table.shape)}")
    xp = get_array_module(table)
    gh, gw, prefix = patch_layout(table.shape[0], grid_size, num_prefix_tokens)
    e = table[prefix:]                                                        # (N, D)
    e = e / xp.maximum(xp.linalg.norm(e, axis=-1, keepdims=True), _TINY)      # unit rows
    return (e @ e.T).reshape(gh, gw, gh, gw)


# ---------------------------------------------------------------- 4. embedding filters


class FilterPCA(NamedTuple):
    components: object                # (k, C, P, P): unit-norm principal directions, leading first
    explained_variance: object        # (k,): the filters' variance along each component
    explained_variance_ratio: object  # (k,): its share of the filters' total variance


def embedding_filters(source, num_components: int = 28, patch_size=None, in_channels=None) -> FilterPCA:
    """The leading principal components of the patch-embedding filters: the paper's Figure 7 (left),
    which shows the top 28 of ViT-L/32.

    E (C*P*P, D) maps a flattened patch to D features, so its D columns are D filters over a
    (C, P, P) patch. PCA of those D filters (centred on the mean filter, via the SVD
    X - mean = U S V^T): the rows of V^T are the components, S^2 / (D - 1) their variances.
    Each component's sign is fixed so that its largest-magnitude entry is positive.

    source: a ViT, or E itself with patch_size (and in_channels, default C*P*P / P^2) given.
    At most min(C*P*P, D - 1) components exist (D filters span at most D - 1 centred directions).
    """
    if hasattr(source, "patch_embed"):
        patch_size, in_channels = source.config.patch_size, source.config.in_channels
        source = source.patch_embed.proj.weight
        if _array(source).shape[0] != in_channels * patch_size ** 2:
            raise ValueError("the patch embedding does not act on image pixels (a hybrid's acts on ResNet "
                             "features): there are no RGB filters to show")
    w = _float(_array(source))
    if w.ndim != 2 or patch_size is None:
        raise ValueError(f"expected E of shape (C*P*P, D) and its patch_size, got {tuple(w.shape)} "
                         f"and patch_size={patch_size}")
    in_channels = w.shape[0] // patch_size ** 2 if in_channels is None else in_channels
    if in_channels * patch_size ** 2 != w.shape[0] or w.shape[1] < 2:
        raise ValueError(f"E of shape {tuple(w.shape)} is not (C*P*P, D >= 2) for C={in_channels}, "
                         f"P={patch_size}")
    if num_components < 1:
        raise ValueError(f"num_components must be >= 1, got {num_components}")
    xp = get_array_module(w)
    filters = w.T.astype(xp.float64)                            # (D, C*P*P): one filter per row
    centred = filters - filters.mean(axis=0)
    _, s, vt = xp.linalg.svd(centred, full_matrices=False)      # vt: (min(D, CPP), CPP)
    k = min(num_components, vt.shape[0], w.shape[1] - 1)
    comps = vt[:k]
    biggest = xp.abs(comps).argmax(axis=1)
    comps = comps * xp.sign(comps[xp.arange(k), biggest])[:, None]
    var = s ** 2 / (w.shape[1] - 1)
    return FilterPCA(comps.reshape(k, in_channels, patch_size, patch_size), var[:k], var[:k] / var.sum())


# ---------------------------------------------------------------- all of it, from a checkpoint


def collect_attentions(model, images):
    """The attention probabilities of every layer as arrays (model.forward_features with
    return_attention=True, in eval mode, recording no graph).
    images: (B, C, H, W) normalised as in training -> list of (B, heads, T, T), one per layer."""
    model.eval()
    with no_grad():
        _, attentions = model.forward_features(images, return_attention=True)
    return [_array(a) for a in attentions]


def inspect_checkpoint(checkpoint, images=(), out="inspect", device="cpu", num_components: int = 28,
                       batch_size: int = 32, log=print) -> dict:
    """Run the four analyses on a checkpoint and write them as PNGs into ``out``:

        attention_rollout_<i>_<name>.png   per image: input | input x rollout map | jet overlay (Fig. 6)
        attention_distance.png             mean attention distance per head and layer (Fig. 7 right)
        position_embedding_similarity.png  (Fig. 7 center)
        embedding_filters.png              top principal components of E as RGB tiles (Fig. 7 left)

    Images (any files Pillow reads) are preprocessed as for `tinyvit predict`: resized to the model's
    input and normalised with the checkpoint's mean/std; the attention distance is averaged over all
    of them. Analyses that do not apply (no images, no position embeddings, no linear patch
    embedding) are skipped with a note through ``log``. Returns {analysis name: [paths written]}.
    """
    from . import plots
    from .inference import load_for_inference, read_image
    log = log or (lambda message: None)
    model, info = load_for_inference(checkpoint, device=device)
    model = getattr(model, "vit", model)            # a masked-patch-prediction model: its ViT encoder
    cfg = model.config
    pixels = getattr(cfg, "effective_patch_size", cfg.patch_size)   # a hybrid's token covers s*P pixels
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = {"attention_rollout": [], "attention_distance": [], "position_embedding_similarity": [],
               "embedding_filters": []}

    if images:
        raw = np.stack([read_image(p, cfg.in_channels, cfg.image_size) for p in images])   # (B, C, S, S)
        mean = np.asarray(info["mean"], np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(info["std"], np.float32).reshape(1, -1, 1, 1)
        dtype = _array(next(iter(model.parameters()))).dtype
        maps, distance_sum = [], 0.0
        for start in range(0, len(raw), batch_size):
            x = backend.to_device(((raw[start:start + batch_size] - mean) / std).astype(dtype), device)
            attentions = collect_attentions(model, x)
            maps.append(backend.to_numpy(attention_rollout(attentions, cfg.grid_size).map))
            distance_sum = distance_sum + len(x) * backend.to_numpy(
                attention_distance(attentions, cfg.grid_size, pixels))
        for i, (path, image, amap) in enumerate(zip(images, raw, np.concatenate(maps))):
            target = out / f"attention_rollout_{i}_{Path(path).stem}.png"
            plots.rollout_overlay(image, amap).save(target)
            written["attention_rollout"].append(target)
        target = out / "attention_distance.png"
        uniform = float(patch_distances(cfg.grid_size, pixels).mean())   # uniform attention's
        plots.plot_attention_distance(distance_sum / len(raw), target, reference=uniform)
        written["attention_distance"].append(target)
    else:
        log("skipped attention rollout and attention distance: no images given")

    try:
        similarity = backend.to_numpy(position_embedding_similarity(model))
    except ValueError as exc:
        log(f"skipped position-embedding similarity: {exc}")
    else:
        target = out / "position_embedding_similarity.png"
        plots.plot_position_similarity(similarity, target)
        written["position_embedding_similarity"].append(target)

    try:
        pca = embedding_filters(model, num_components)
    except ValueError as exc:
        log(f"skipped embedding filters: {exc}")
    else:
        target = out / "embedding_filters.png"
        plots.filters_image(backend.to_numpy(pca.components)).save(target)
        written["embedding_filters"].append(target)
    return written
