"""`tinyvit export`: a checkpoint in another library's format (timm's, for now)."""
from __future__ import annotations

from pathlib import Path

from . import UsageError


def cmd_export(args) -> int:
    """Write CHECKPOINT's model as a timm state dict and print how to load it in timm."""
    from .. import io
    from ..evaluation import load_for_inference
    from ..io.arrays import read_header
    model, info = load_for_inference(args.checkpoint)
    model = getattr(model, "vit", model)              # a masked-patch-prediction model: its encoder
    out = Path(args.out or Path(args.checkpoint).with_name(f"{Path(args.checkpoint).stem}-timm.safetensors"))
    if out.resolve() == Path(args.checkpoint).resolve():
        raise UsageError(f"--out {out} is the checkpoint itself; name another file")
    _, metadata = read_header(args.checkpoint)
    kept = {k: metadata[k] for k in ("dataset",) if k in metadata}        # the class names travel along
    try:
        kwargs = io.save_timm(model, out, kept)
    except ValueError as exc:
        raise UsageError(f"{args.checkpoint}: {exc}") from None
    arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    print(f"wrote {out}: {model.num_parameters() / 1e6:.2f}M parameters in timm's names and PyTorch's layouts "
          "(Linear weights (out, in), the patch embedding as a conv kernel)")
    print("load it in timm:\n"
          "    import safetensors.torch\n"
          "    from timm.models.vision_transformer import VisionTransformer\n"
          f"    model = VisionTransformer({arguments})\n"
          f"    model.load_state_dict(safetensors.torch.load_file({str(out)!r}))")
    if info.get("name"):
        print(f"inputs as in training: pixels in [0, 1] minus mean {info['mean']}, divided by std {info['std']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint in timm's format (names and PyTorch layouts)",
                       description="Write CHECKPOINT's model as a timm state dict in a .safetensors file "
                                   "(safetensors.torch.load_file reads it) and print the VisionTransformer "
                                   "arguments that load it. In Python: tinyvit.io.save_timm(model, path), or "
                                   "tinyvit.io.to_timm_state_dict(model) for the arrays.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint (tinyvit train's best.safetensors, or tinyvit.save)")
    p.add_argument("--to", choices=("timm",), default="timm", help="the target format")
    p.add_argument("--out", default=None, metavar="FILE", help="default: CHECKPOINT-timm.safetensors beside it")
    p.set_defaults(func=cmd_export)
