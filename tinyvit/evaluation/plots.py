"""Pictures of tinyvit/analysis.py's results, drawn like the paper's Figures 6 and 7.

Pillow draws the image tiles (attention overlays, embedding filters); matplotlib draws the plots
with axes through its object-oriented API and the Agg renderer (no display needed, and the global
pyplot backend of a notebook is left alone). Every function takes NumPy arrays: pass CuPy results
through tinyvit.backend.to_numpy first.
"""
from __future__ import annotations

import io
import math

import numpy as np

from ..io.arrays import write_bytes_atomically

DPI = 100
DISTANCE_FIGSIZE = (7.2, 4.8)      # inches; the PNG is figsize * DPI pixels
SIMILARITY_FIGSIZE = (6.4, 5.6)
MIN_DISPLAY = 224                  # overlays are upscaled by an integer factor to at least this size
MIN_TILE = 48                      # embedding-filter tiles likewise
OVERLAY_GAP, TILE_GAP = 4, 2       # white pixels between panels / tiles


def colormap(name: str) -> np.ndarray:
    """A matplotlib colour map as a (256, 3) lookup table of RGB values in [0, 1]."""
    try:
        from matplotlib import colormaps
    except ImportError:
        raise ImportError("drawing the analyses needs matplotlib: pip install matplotlib "
                          "(or pip install 'tinyvit[train]')") from None
    return colormaps[name](np.linspace(0.0, 1.0, 256))[:, :3]


def upscale_factor(size: int, minimum: int) -> int:
    """The smallest integer factor that makes ``size`` pixels at least ``minimum``."""
    return max(1, math.ceil(minimum / size))


def _to_rgb(image) -> np.ndarray:
    """(C, H, W) with C in {1, 3}, or (H, W), values in [0, 1] -> (H, W, 3) in [0, 1]."""
    image = np.asarray(image, dtype=np.float64)
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"expected an image (C, H, W) with 1 or 3 channels, or (H, W); got {image.shape}")
    rgb = np.clip(image.transpose(1, 2, 0), 0.0, 1.0)
    return np.repeat(rgb, 3, axis=2) if rgb.shape[2] == 1 else rgb


def _to_pil(rgb):
    from PIL import Image
    return Image.fromarray(np.rint(np.clip(rgb, 0.0, 1.0) * 255).astype(np.uint8))


# ---------------------------------------------------------------- Figure 6: attention rollout


def rollout_overlay(image, attention_map, cmap: str = "jet", alpha: float = 0.5,
                    min_size: int = MIN_DISPLAY, gap: int = OVERLAY_GAP):
    """Three panels side by side (a PIL image): the input | the input times the rollout map, as the
    paper's Figure 6 | the map in ``cmap`` blended over the input with opacity ``alpha``.

    image: (C, H, W) or (H, W) in [0, 1] (the model's input before normalisation); attention_map:
    (gh, gw), e.g. attention_rollout(...).map[i]. The map is divided by its maximum and upsampled
    bilinearly to the image; everything is enlarged by an integer factor to >= min_size pixels.
    Output size: (3 W' + 2 gap) x H' with W' = W * factor, H' = H * factor.
    """
    from PIL import Image
    rgb = _to_rgb(image)
    amap = np.asarray(attention_map, dtype=np.float32)
    if amap.ndim != 2:
        raise ValueError(f"expected an attention map (gh, gw), got shape {amap.shape}")
    h, w = rgb.shape[:2]
    s = upscale_factor(max(h, w), min_size)
    size = (w * s, h * s)                                                   # PIL sizes are (W, H)
    base = np.asarray(_to_pil(rgb).resize(size, Image.BICUBIC), dtype=np.float64) / 255.0
    top = float(amap.max())
    mask = amap / top if top > 0 else np.zeros_like(amap)
    mask = np.clip(np.asarray(Image.fromarray(mask).resize(size, Image.BILINEAR)), 0.0, 1.0)  # (H', W')
    heat = colormap(cmap)[np.rint(mask * 255).astype(np.intp)]             # (H', W', 3)
    panels = [base, base * mask[..., None], (1 - alpha) * base + alpha * heat]
    strip = np.ones((size[1], 3 * size[0] + 2 * gap, 3))
    for i, panel in enumerate(panels):
        strip[:, i * (size[0] + gap):i * (size[0] + gap) + size[0]] = panel
    return _to_pil(strip)


# ---------------------------------------------------------------- Figure 7 left: embedding filters


def filters_image(components, cols: int = 7, min_tile: int = MIN_TILE, gap: int = TILE_GAP):
    """Principal components (k, C, P, P) of the embedding filters as a grid of RGB tiles (a PIL
    image), ``cols`` per row (7: the paper's 4 x 7 grid of 28). Each component is scaled to [0, 1]
    on its own (min-max over all its channels, so colours keep their balance) and enlarged by an
    integer factor without smoothing. Size: (cols t + (cols + 1) gap) x (rows t + (rows + 1) gap)."""
    comps = np.asarray(components, dtype=np.float64)
    if comps.ndim != 4 or comps.shape[1] not in (1, 3) or comps.shape[2] != comps.shape[3]:
        raise ValueError(f"expected components (k, C, P, P) with 1 or 3 channels, got shape {comps.shape}")
    k, _, p, _ = comps.shape
    lo = comps.min(axis=(1, 2, 3), keepdims=True)
    hi = comps.max(axis=(1, 2, 3), keepdims=True)
    tiles = ((comps - lo) / np.maximum(hi - lo, 1e-12)).transpose(0, 2, 3, 1)      # (k, P, P, C)
    if tiles.shape[-1] == 1:
        tiles = np.repeat(tiles, 3, axis=-1)
    s = upscale_factor(p, min_tile)
    tiles = tiles.repeat(s, axis=1).repeat(s, axis=2)                               # (k, t, t, 3)
    t, cols = p * s, min(cols, k)
    rows = math.ceil(k / cols)
    cells = np.ones((rows * cols, t + gap, t + gap, 3))                             # white padding
    cells[:k, :t, :t] = tiles
    grid = cells.reshape(rows, cols, t + gap, t + gap, 3).transpose(0, 2, 1, 3, 4)
    grid = grid.reshape(rows * (t + gap), cols * (t + gap), 3)
    return _to_pil(np.pad(grid, ((gap, 0), (gap, 0), (0, 0)), constant_values=1.0))


# ---------------------------------------------------------------- Figure 7 center: position embeddings


def _figure(figsize):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or 'tinyvit[train]')") from None
    return Figure(figsize=figsize, dpi=DPI)


def plot_position_similarity(similarity, path, cmap: str = "viridis") -> None:
    """The (gh, gw, gh, gw) cosine similarities as the paper's Figure 7 (center): a gh x gw grid of
    small gh x gw heat maps, the one at (row r, column c) showing patch (r, c)'s similarity to every
    patch, on a -1..1 colour scale. PNG of SIMILARITY_FIGSIZE * DPI pixels."""
    from matplotlib import colormaps
    sim = np.asarray(similarity, dtype=np.float64)
    if sim.ndim != 4 or sim.shape[:2] != sim.shape[2:]:
        raise ValueError(f"expected similarities (gh, gw, gh, gw), got shape {sim.shape}")
    gh, gw = sim.shape[:2]
    tiles = np.full((gh, gw, gh + 1, gw + 1), np.nan)             # one blank row/column between maps
    tiles[:, :, :gh, :gw] = sim
    mosaic = tiles.transpose(0, 2, 1, 3).reshape(gh * (gh + 1), gw * (gw + 1))[:-1, :-1]
    fig = _figure(SIMILARITY_FIGSIZE)
    ax = fig.add_subplot()
    shown = ax.imshow(mosaic, cmap=colormaps[cmap].with_extremes(bad="white"), vmin=-1, vmax=1,
                      interpolation="nearest")
    for axis, g, n in ((ax.set_xticks, gw, gw + 1), (ax.set_yticks, gh, gh + 1)):
        step = math.ceil(g / 16)                                  # at most 16 labels per axis
        idx = np.arange(0, g, step)
        axis(n * idx + (g - 1) / 2, labels=[str(i + 1) for i in idx])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set(xlabel="Input patch column", ylabel="Input patch row", title="Position embedding similarity")
    fig.colorbar(shown, ax=ax, shrink=0.8, label="Cosine similarity")
    fig.savefig(path, dpi=DPI)


# ---------------------------------------------------------------- Figure 7 right: attention distance


def plot_attention_distance(distances, path, reference: float | None = None) -> None:
    """Mean attention distance (layers, heads) as the paper's Figure 7 (right): one dot per head,
    network depth on the x axis, distance in pixels on the y axis. ``reference``, if given, is drawn
    as a dashed line (e.g. the distance of uniform attention). PNG of DISTANCE_FIGSIZE * DPI pixels."""
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"expected distances (layers, heads), got shape {d.shape}")
    layers, heads = d.shape
    from matplotlib import colormaps
    if heads <= 20:                                               # distinct colours, as the paper's
        colours = colormaps["tab10" if heads <= 10 else "tab20"].colors[:heads]
    else:
        colours = colormaps["viridis"](np.linspace(0.0, 1.0, heads))
    fig = _figure(DISTANCE_FIGSIZE)
    ax = fig.add_axes((0.1, 0.12, 0.64, 0.78))                    # room on the right for the legend
    depth = np.arange(1, layers + 1)
    for h in range(heads):                                        # one series per head, for the legend
        ax.scatter(depth, d[:, h], s=22, color=colours[h], label=f"Head {h + 1}", zorder=3)
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", linewidth=1, label="uniform attention")
    top = max(float(d.max()), reference or 0.0, 1e-6)
    ax.set_ylim(0, 1.1 * top)
    ax.set_xlim(0.5, layers + 0.5)
    if layers <= 24:
        ax.set_xticks(depth)
    ax.grid(alpha=0.3)
    ax.set(xlabel="Network depth (layer)", ylabel="Mean attention distance (pixels)",
           title="Size of attended area by head and network depth")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False,
              ncol=1 if heads <= 16 else 2)
    fig.savefig(path, dpi=DPI)


# ---------------------------------------------------------------- training curves


def training_curves(history: list, steps: list, path, train_loss_note: str = ""):
    """The curves of a run -> PNG at ``path`` (written atomically; skipped without matplotlib).

    history: the per-epoch rows of metrics.jsonl (epoch, epochs_trained, test_loss, test_acc, ...);
    steps: the rows of steps.jsonl, one per logging interval (epoch as a fraction, train_loss and
    train_acc of that interval, lr). Three panels over epochs: loss and accuracy (training per
    interval as a line, test per epoch as markers, so one epoch already shows a curve and a point),
    and the learning rate on its own axis. ``train_loss_note`` says how the training loss differs
    from the test loss's plain cross-entropy (e.g. "label smoothing 0.1": it cannot reach 0), in the
    legend. Drawn on a bare Figure with the Agg canvas, so a notebook's pyplot backend is left alone.
    Returns the Figure (None without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(13, 4))
    FigureCanvasAgg(fig)
    ax_loss, ax_acc, ax_lr = fig.subplots(1, 3)
    at = [row["epoch"] for row in steps]
    epochs = [row.get("epochs_trained", row["epoch"]) for row in history]      # a last epoch may be short
    marker = dict(marker="o", markersize=4 if len(epochs) < 50 else 2)
    for ax, key, scale, title in ((ax_loss, "loss", 1, "loss"), (ax_acc, "acc", 100, "accuracy (%)")):
        if steps:
            note = f"; {train_loss_note}" if train_loss_note and key == "loss" else ""
            ax.plot(at, [scale * row[f"train_{key}"] for row in steps], lw=1, alpha=0.8,
                    label=f"train (per interval{note})")
        if history:
            plain = "; plain cross-entropy" if train_loss_note and key == "loss" else ""
            ax.plot(epochs, [scale * row[f"test_{key}"] for row in history], **marker, label=f"test (per epoch{plain})")
        ax.set(xlabel="epoch", title=title)
    if steps:
        ax_lr.plot(at, [row["lr"] for row in steps], color="tab:green")
    ax_lr.set(xlabel="epoch", title="learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (ax_loss, ax_acc, ax_lr):
        ax.grid(alpha=0.3)
    for ax in (ax_loss, ax_acc):
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    write_bytes_atomically(path, png.getvalue())          # a new file renamed into place: never through a link
    return fig
