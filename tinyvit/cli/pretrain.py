"""`tinyvit pretrain` (masked patch prediction, appendix B.1.2) and `tinyvit fewshot` (few-shot linear
accuracy of a frozen representation, section 4.1)."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from . import UsageError, add_kernels_flag
from .flags import add_dataset_flags, add_train_flags
from .predict import checkpoint_dataset
from .train import _run_training, _train_config, positive, print_config

# Flags of `tinyvit train` that mean nothing without labels.
LABEL_FLAGS = ("label_smoothing", "mixup", "cutmix")


def _number_list(text: str, cast, what: str) -> list:
    try:
        values = [cast(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise UsageError(f"{what} is empty")
    if not all(math.isfinite(v) for v in values):        # float() reads "nan" and "inf"
        raise UsageError(f"{what} must be finite numbers, got {text!r}")
    return values


def cmd_pretrain(args) -> int:
    """Self-supervised pre-training of a ViT encoder by masked patch prediction."""
    from ..training import PRETRAIN_RECIPE, MaskedPrediction
    cfg = _train_config(args, recipe=PRETRAIN_RECIPE)
    task = {"target": args.target, "mask_rate": args.mask_rate, "mask_fraction": args.mask_fraction,
            "random_fraction": args.random_fraction}
    _check_task({k: v for k, v in task.items() if v is not None})
    # The task's settings are MaskedConfig fields: they travel in model_args (and so in the run's
    # config.json and checkpoints) like any other model setting.
    cfg = replace(cfg, model_args={**cfg.model_args, **{k: v for k, v in task.items() if v is not None}})
    if cfg.out is None:                 # runs/pretrain-DATASET-MODEL-TARGET, numbered as train's folders
        from ..training.components import dataset_label, next_run_folder, planned_model_name
        target = cfg.model_args.get("target", "mean3bit")
        name = f"pretrain-{dataset_label(cfg.dataset)}-{planned_model_name(cfg).replace('/', '-')}-{target}"
        cfg = replace(cfg, out=str(next_run_folder(Path("runs") / name, cfg.resume)))
    if args.print_config:
        return print_config(cfg, "pretrain")
    return _run_training(cfg, objective=MaskedPrediction())


def _check_task(task: dict) -> None:
    """The masking flags, checked by MaskedConfig (its other fields at their defaults) and named as
    the flags that set them."""
    from ..models.masked import MaskedConfig
    try:
        MaskedConfig(**task)
    except ValueError as exc:
        message = str(exc).removeprefix("invalid MaskedConfig: ")
        for name in task:
            message = message.replace(name, "--" + name.replace("_", "-"))
        raise UsageError(message) from None


# --seeds above this is a typo (each seed fits and scores every shot count once more).
MAX_SEEDS = 1000


def cmd_fewshot(args) -> int:
    """Few-shot linear accuracy of a checkpoint's frozen representation, mean and spread over seeds."""
    import numpy as np

    from ..evaluation import extract_features, fewshot_evaluate, fewshot_subsets, load_for_inference
    from ..training import load_data
    from ..training.components import input_shape
    shots = _number_list(args.shots, int, "--shots")
    l2s = _number_list(args.l2, float, "--l2")
    if min(shots) < 1 or args.seeds < 1 or min(l2s) <= 0:
        raise UsageError("--shots and --seeds must be >= 1 and --l2 > 0")
    if args.seeds > MAX_SEEDS:
        raise UsageError(f"--seeds must be at most {MAX_SEEDS}, got {args.seeds}")
    if args.seed < 0:                                   # NumPy's generators take none below 0
        raise UsageError(f"--seed must be a whole number >= 0, got {args.seed}")
    positive(args, "test_limit", "batch_size")
    if (args.checkpoint is None) == (args.random_init is None):
        raise UsageError("give either a CHECKPOINT or --random-init MODEL")
    if args.model_arg and not args.random_init:
        raise UsageError("--model-arg goes with --random-init (a checkpoint's model is what it was trained as)")
    if args.random_init:
        if not args.dataset:
            raise UsageError("--random-init needs --dataset (a checkpoint says its own)")
        ds = load_data(args.dataset, args.data_dir, checkpoint_dataset(None, {}, args.dataset, args.dataset_arg)[1])
        model, info = _random_model(args, ds), {}
    else:                                  # the checkpoint's dataset unless --dataset names another
        model, info = load_for_inference(args.checkpoint, device=args.device)
        name, options = checkpoint_dataset(args.checkpoint, info, args.dataset, args.dataset_arg)
        ds = load_data(name, args.data_dir, options, input_shape(None, getattr(model, "vit", model)))
    if args.test_limit is not None:
        ds = ds.subset(None, args.test_limit)
    cfg = model.config
    if (ds.channels, ds.image_size) != (cfg.in_channels, cfg.image_size):
        raise ValueError(f"the model takes {cfg.in_channels}x{cfg.image_size}x{cfg.image_size} images but "
                         f"{ds.name} has {ds.channels}x{ds.image_size}x{ds.image_size}")
    # The normalisation the model was trained with, when its checkpoint says; else the dataset's.
    mean, std = (info["mean"], info["std"]) if info.get("name") else (ds.mean, ds.std)
    pool = None if args.pool == "default" else args.pool

    def features(images):
        return extract_features(model, images, mean, std, args.batch_size, args.device, pool=pool)

    # Only the training images some subset uses need features.
    subsets = fewshot_subsets(ds.train_labels, shots, args.seeds, args.seed)
    needed = np.unique(np.concatenate(list(subsets.values())))
    test_features = features(ds.test_images)
    train_features = np.zeros((len(ds.train_labels), test_features.shape[1]), np.float32)
    train_features[needed] = features(ds.train_images[needed])
    results = fewshot_evaluate(train_features, ds.train_labels, test_features, ds.test_labels, shots, args.seeds,
                               l2s, num_classes=ds.num_classes, standardize=not args.no_standardize, seed=args.seed)
    rep = {None: "the classifier's input", "token": "class token", "gap": "mean of the patch tokens"}[pool]
    source = args.checkpoint or f"{args.random_init} at random initialisation (seed {args.seed})"
    print(f"{source} ({model.arch}): few-shot linear accuracy on {ds.name} test "
          f"({len(ds.test_images)} images, {ds.num_classes} classes), {rep}, {args.seeds} seeds")
    print(f"{'shots':>6}{'l2':>10}{'mean':>10}{'std':>8}{'min':>8}{'max':>8}")
    for (n, l2), r in results.items():
        print(f"{n:>6}{l2:>10g}{100 * r['mean']:>9.2f}%{100 * r['std']:>8.2f}"
              f"{100 * min(r['accs']):>8.2f}{100 * max(r['accs']):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"shots": n, "l2": l2, **r} for (n, l2), r in results.items()],
                                              indent=2))
    return 0


def _random_model(args, ds):
    """The baseline of a pre-trained checkpoint: the same architecture, untrained (the official
    initialisation, seeded by --seed), sized for the dataset, in eval mode."""
    from .. import backend
    from ..training.components import create_for_dataset
    from . import model_args
    backend.manual_seed(args.seed)
    model = create_for_dataset(args.random_init, ds, **model_args(args.model_arg))
    model.to(args.device)
    model.eval()
    return model


def register(sub) -> None:
    p = sub.add_parser("pretrain", help="self-supervised pre-training by masked patch prediction (appendix B.1.2)",
                       description="Masked patch prediction (section 4.6, appendix B.1.2): corrupt a fraction of "
                                   "the patch embeddings and predict each corrupted patch's target. Labels are "
                                   "never read. Unset flags: the paper's recipe (Adam, lr 2e-4, warmup then "
                                   "cosine; tinyvit/training/recipes.py PRETRAIN_RECIPE), then the dataset's. "
                                   "Fine-tune the result with `tinyvit finetune`, probe it with `tinyvit fewshot`.")
    p.add_argument("--target", choices=("mean3bit", "downsized3bit", "pixels-l2"), default=None,
                   help="what to predict for a corrupted patch: its 3-bit mean colour (default, the paper's "
                        "choice), its 4x4 downsized 3-bit colours, or its pixels by L2 regression")
    p.add_argument("--mask-rate", type=float, default=None,
                   help="fraction of the patches corrupted per image (default 0.5; BERT's is 0.15)")
    p.add_argument("--mask-fraction", type=float, default=None,
                   help="of the corrupted: share replaced by the [mask] embedding (default 0.8)")
    p.add_argument("--random-fraction", type=float, default=None,
                   help="of the corrupted: share replaced by a random other patch (default 0.1; the rest is kept)")
    add_train_flags(p, skip=LABEL_FLAGS)
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("fewshot", help="few-shot linear accuracy of a checkpoint's frozen features (section 4.1)",
                       description="Fit a regularised least-squares map from the frozen representation of SHOTS "
                                   "training images per class to {-1, 1}^K targets, in closed form, and report "
                                   "test accuracy: mean and spread over --seeds random subsets (section 4.1).")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="a ViT checkpoint (tinyvit train) or a pre-trained one (tinyvit pretrain)")
    p.add_argument("--random-init", metavar="MODEL", default=None,
                   help="instead of a checkpoint: the named model (see `tinyvit models`) at random "
                        "initialisation, the baseline that pre-training has to beat")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="with --random-init: override a ViTConfig field (repeatable)")
    add_dataset_flags(p, "the checkpoint's own; --random-init needs it", "train_size=1000")
    p.add_argument("--shots", default="1,5,10,25", help="training images per class, comma-separated")
    p.add_argument("--seeds", type=int, default=5, help="random subsets per shot count")
    p.add_argument("--l2", default="1", help="ridge penalty (comma-separated for several)")
    p.add_argument("--pool", choices=("default", "token", "gap"), default="default",
                   help="representation: the model's own (the classifier's input: the class token's output, "
                        "or the mean of the patch tokens for a pool='gap' model), the class token, or the mean "
                        "of the patch tokens")
    p.add_argument("--no-standardize", action="store_true", help="do not scale features to unit variance")
    p.add_argument("--seed", type=int, default=0, help="seed of the subsets drawn (and of --random-init's weights)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    p.add_argument("--test-limit", type=int, default=None, help="evaluate on the first N test images only")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_kernels_flag(p)
    p.set_defaults(func=cmd_fewshot)
