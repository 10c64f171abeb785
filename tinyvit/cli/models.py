"""`tinyvit models`: the named variants with parameter counts and FLOPs."""
from __future__ import annotations


def _backbone(cfg) -> str:
    """'-' for a ViT; for a hybrid its ResNet: units per stage, width factor, P x P patches on the map."""
    if not hasattr(cfg, "resnet_layers"):
        return "-"
    layers = ",".join(str(n) for n in cfg.resnet_layers)
    return (f"ResNet({layers}) x{cfg.resnet_width_factor:g} {cfg.resnet_root} root, "
            f"{cfg.patch_size}x{cfg.patch_size} on /{cfg.resnet_stride}")


def cmd_models(args) -> int:
    """List the named variants with parameter counts and training FLOPs per image."""
    from ..models import config_for, count_parameters, known_names, training_flops
    print(f"{'name':<17}{'image':>6}{'patch':>6}{'tokens':>7}{'dim':>6}{'depth':>6}{'heads':>6}"
          f"{'mlp':>6}{'params':>10}{'train GFLOPs/img':>18}  backbone")
    for name in known_names():
        cfg = config_for(name, **({"num_classes": args.num_classes} if args.num_classes else {}))
        patch = getattr(cfg, "effective_patch_size", cfg.patch_size)      # pixels per token side
        print(f"{name:<17}{cfg.image_size:>6}{patch:>6}{cfg.num_patches:>7}{cfg.dim:>6}{cfg.depth:>6}"
              f"{cfg.num_heads:>6}{cfg.mlp_dim:>6}{count_parameters(cfg) / 1e6:>9.2f}M"
              f"{training_flops(cfg) / 1e9:>18.3f}  {_backbone(cfg)}")
    print("\nAny patch size works after the slash (vit-l/32, vit-cifar/2). Counts: 1000 classes at 224 px "
          "for the paper's models, 10 classes for the small presets; --num-classes changes that.\n"
          "Hybrids (r50+vit-b/16, section 3.1): the ResNet's feature map is the token sequence; 'patch' is "
          "the pixels per token side (ResNet stride x patch on the map); /16 with R50 removes stage 4 and "
          "puts its units into stage 3, (3,4,9), as the paper.")
    return 0




def register(sub) -> None:
    p = sub.add_parser("models", help="list the named model variants with parameters and FLOPs")
    p.add_argument("--num-classes", type=int, default=None, help="head size used for the counts")
    p.set_defaults(func=cmd_models)
