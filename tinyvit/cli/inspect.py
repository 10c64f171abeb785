"""`tinyvit inspect`: look inside a trained ViT as the paper's section 4.5 does, written as PNGs."""
from __future__ import annotations

import sys
from pathlib import Path

from . import UsageError, add_kernels_flag


def cmd_inspect(args) -> int:
    """Attention rollout per image, attention distance, position-embedding similarity and the
    principal components of the embedding filters (tinyvit.evaluation.inspect_checkpoint)."""
    from ..evaluation import inspect_checkpoint
    if args.components < 1:
        raise UsageError(f"--components must be >= 1, got {args.components}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    out = args.out or str(Path("runs") / f"inspect-{Path(args.checkpoint).stem}")
    try:
        written = inspect_checkpoint(args.checkpoint, args.images, out, device=args.device,
                                     num_components=args.components, batch_size=args.batch_size,
                                     log=lambda message: print(message, file=sys.stderr))
    except ImportError as exc:   # matplotlib missing
        print(f"tinyvit inspect: {exc}", file=sys.stderr)
        return 1
    for paths in written.values():
        for path in paths:
            print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("inspect", help="attention rollout and distance, position-embedding similarity and "
                                       "embedding filters of a checkpoint as PNGs (paper section 4.5)",
                       description="Write the paper's Figure 6 (attention rollout, one PNG per image) and "
                                   "Figure 7 (embedding filters, position-embedding similarity, mean attention "
                                   "distance per head and layer) for a checkpoint; prints the paths.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint (tinyvit train's best/latest, or tinyvit.save)")
    p.add_argument("--images", nargs="+", default=[], metavar="FILE",
                   help="image files (any format Pillow reads), preprocessed as `tinyvit predict` does; "
                        "without them only the weight-based figures are drawn")
    p.add_argument("--out", default=None, help="folder for the PNGs (default runs/inspect-CHECKPOINT)")
    p.add_argument("--components", type=int, default=28,
                   help="principal components of the embedding filters to show (the paper: 28)")
    p.add_argument("--batch-size", type=int, default=32, help="images per forward pass")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_kernels_flag(p)
    p.set_defaults(func=cmd_inspect)
