"""Image files -> a model's input, the same way for training (the folder dataset, folder.py) and for
prediction (`tinyvit predict`, `inspect`): decode safely, take the colours the model takes, fit the
square input.

    img = open_image(path)                         # a Pillow image, 8 bits per channel
    pixels, prep = prepare(img, channels=1, size=28, resize="crop")
    pixels: (C, size, size) uint8        prep.describe() -> "600x400 RGB -> grey, short side to 28, centre crop"

RESIZE_MODES, how a W x H image becomes size x size:
    crop    the short side resized to ``size``, the long side cut evenly at both ends (the default:
            the aspect is kept, as torchvision's Resize + CenterCrop do)
    pad     the long side resized to ``size``, the short side filled with the colour of the image's
            border (nothing cut, the object smaller)
    squash  both sides resized to ``size`` (the aspect changed: a 3:2 photo is squeezed by a third)
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataFormatError

RESIZE_MODES = ("crop", "pad", "squash")
# The file types the folder dataset reads (torchvision's ImageFolder list, less the rare ones).
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
# Pillow modes that hold no colour: such images are greyscale ("I;16" is 16-bit grey, "1" black/white).
GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N")


class ImageError(DataFormatError):
    """A file that cannot be read as an image (not an image, truncated, too large, floating point)."""


def open_image(path):
    """The image at ``path`` as a loaded Pillow image in 8 bits per channel (16-bit greyscale
    scaled, not clipped: see _eight_bit). Raises ImageError naming the file for one that is not an
    image, is truncated, holds floating-point pixels, or has more pixels than Pillow decodes safely
    (Image.MAX_IMAGE_PIXELS: a tiny file can unpack to gigabytes)."""
    from PIL import Image, UnidentifiedImageError
    path = Path(path)
    try:
        with warnings.catch_warnings():
            # Pillow only warns of an image over MAX_IMAGE_PIXELS (it refuses one over twice that): refuse both.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()
                return _eight_bit(img, path)
    except UnidentifiedImageError:
        raise ImageError(f"{path} is not an image Pillow can read") from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageError(f"{path} is too large to decode safely ({exc}); shrink it first") from None
    except OSError as exc:                          # Pillow's "image file is truncated", "broken data stream"
        raise ImageError(f"{path} is truncated or damaged ({exc}); save or copy it again") from None


def image_mode(path) -> str:
    """The Pillow mode of the file at ``path`` ("L", "RGB", ...), read from its header without
    decoding the pixels; ImageError for a file that is not an image."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as img:
            return img.mode
    except UnidentifiedImageError:
        raise ImageError(f"{path} is not an image Pillow can read") from None
    except OSError as exc:
        raise ImageError(f"{path} is truncated or damaged ({exc}); save or copy it again") from None


def _eight_bit(img, path):
    """A Pillow image whose conversion to RGB or L keeps its brightness. Pillow opens 16-bit greyscale
    (PNG, TIFF) as mode "I;16" ("I", 32-bit integers, in older versions) and its convert("L") clips
    every value above 255 to white: scale 0..65535 to 0..255 instead (v / 257, so 257 k -> k)."""
    from PIL import Image
    if img.mode == "F":
        raise ImageError(f"{path} holds floating-point pixels, which have no fixed range; save it as an 8- or "
                         "16-bit image")
    if not img.mode.startswith("I"):
        return img.copy()
    values = np.asarray(img, dtype=np.int64)
    if values.min() < 0 or values.max() > 65535:
        raise ImageError(f"{path} holds {img.mode} pixels outside 0..65535; save it as an 8- or 16-bit image")
    return Image.fromarray(((values + 128) // 257).astype(np.uint8))


@dataclass
class Preparation:
    """How one image became a model input: its original size and mode, what was done."""
    width: int
    height: int
    mode: str                 # Pillow's: "L", "RGB", "RGBA", "P", ...
    channels: int             # the model's: 1 or 3
    size: int                 # the model's input side
    resize: str               # one of RESIZE_MODES
    transparent: bool = False          # had an alpha channel, laid on white

    @property
    def aspect(self) -> float:
        """Long side over short side (1.0 for a square image)."""
        return max(self.width, self.height) / max(min(self.width, self.height), 1)

    @property
    def cut(self) -> float:
        """The share of the long side a centre crop cuts off (0 for crop of a square, pad, squash)."""
        return 1 - 1 / self.aspect if self.resize == "crop" else 0.0

    def describe(self) -> str:
        """E.g. "600x400 RGB -> grey, short side to 28 px, centre crop (cut 33% of the width)"."""
        colour = {1: "grey", 3: "RGB"}.get(self.channels, f"{self.channels} channels")
        grey_in = self.mode in GREY_MODES
        conversion = ("" if (self.channels == 1) == grey_in and not self.transparent else f" -> {colour}")
        if self.transparent:
            conversion += " on white"
        long_side = "width" if self.width >= self.height else "height"
        if self.width == self.height:
            how = f"resized to {self.size}x{self.size}" if self.width != self.size else "as it is"
        elif self.resize == "crop":
            how = f"short side to {self.size} px, centre crop (cut {100 * self.cut:.0f}% of the {long_side})"
        elif self.resize == "pad":
            how = f"long side to {self.size} px, padded with its border colour to {self.size}x{self.size}"
        else:
            how = f"squashed to {self.size}x{self.size} (aspect {self.aspect:.2f}:1 changed)"
        return f"{self.width}x{self.height} {self.mode}{conversion}, {how}"


def prepare(img, channels: int, size: int, resize: str = "crop") -> tuple:
    """A Pillow image -> ((channels, size, size) uint8 array, Preparation): converted to grey (L) or
    RGB as the model takes (an alpha channel laid on white first: transparent backgrounds of product
    photos are white where they are shown), then resized to the square input as ``resize`` says
    (RESIZE_MODES; bicubic with Pillow's antialiasing)."""
    from PIL import Image
    if resize not in RESIZE_MODES:
        raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}")
    prep = Preparation(img.width, img.height, img.mode, channels, size, resize)
    if img.mode in ("RGBA", "LA", "La", "RGBa", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img, prep.transparent = Image.alpha_composite(white, rgba), True
    img = img.convert("L" if channels == 1 else "RGB")
    w, h = img.size
    if resize == "squash" or w == h:
        img = img.resize((size, size), Image.BICUBIC)
    elif resize == "crop":                                  # the centred square of side min(w, h), resized
        side = min(w, h)
        left, top = (w - side) // 2, (h - side) // 2
        img = img.resize((size, size), Image.BICUBIC, box=(left, top, left + side, top + side))
    else:                                                   # pad: fit the long side, fill with the border
        scale = size / max(w, h)
        inner = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
        canvas = Image.new(img.mode, (size, size), border_colour(img))
        canvas.paste(inner, ((size - inner.width) // 2, (size - inner.height) // 2))
        img = canvas
    array = np.asarray(img, dtype=np.uint8)
    return (array.transpose(2, 0, 1) if array.ndim == 3 else array[None]).copy(), prep


def border_colour(img):
    """The median colour of an image's outermost pixels (its background, for a product photo)."""
    a = np.asarray(img)
    edge = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    value = np.median(edge, axis=0)
    return tuple(int(v) for v in np.atleast_1d(value)) if a.ndim == 3 else int(value)
