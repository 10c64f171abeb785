"""`tinyvit models`: the named variants with parameter counts and FLOPs."""
from __future__ import annotations


def cmd_models(args) -> int:
    """List the named variants with parameter counts and training FLOPs per image."""
    from ..models import config_for, count_parameters, known_names, training_flops
    print(f"{'name':<14}{'image':>6}{'patch':>6}{'tokens':>7}{'dim':>6}{'depth':>6}{'heads':>6}"
          f"{'mlp':>6}{'params':>10}{'train GFLOPs/img':>18}")
    for name in known_names():
        cfg = config_for(name, **({"num_classes": args.num_classes} if args.num_classes else {}))
        print(f"{name:<14}{cfg.image_size:>6}{cfg.patch_size:>6}{cfg.num_patches:>7}{cfg.dim:>6}{cfg.depth:>6}"
              f"{cfg.num_heads:>6}{cfg.mlp_dim:>6}{count_parameters(cfg) / 1e6:>9.2f}M"
              f"{training_flops(cfg) / 1e9:>18.3f}")
    print("\nAny patch size works after the slash (vit-l/32, vit-cifar/2). Counts: 1000 classes at 224 px "
          "for the paper's models, 10 classes for the small presets; --num-classes changes that.")
    return 0




def register(sub) -> None:
    p = sub.add_parser("models", help="list the named model variants with parameters and FLOPs")
    p.add_argument("--num-classes", type=int, default=None, help="head size used for the counts")
    p.set_defaults(func=cmd_models)
