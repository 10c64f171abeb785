"""Train the runs behind lesson 09b's comparison of a tiny hybrid and a tiny ViT at equal training compute
(the paper's section 4.4 and Figure 5 in miniature) and store their results for the lesson to load:

    python data_scripts/lesson_hybrid_runs.py [--out lessons/results]

Two models with the same Transformer (D = 64, 2 blocks of 4 heads, D_mlp = 128) and the same 7x7 grid of
tokens on Fashion-MNIST's 28 px images (`configs` below): a ViT with 4x4 pixel patches, and a hybrid whose
tokens are the feature map of a one-unit ResNet stem (the BiT root, 7x7/2 conv with 16 channels and a 3x3/2
max-pool, then one bottleneck unit 16 -> 16 -> 64), patch size 1 on that map. Budgets of 100, 300 and 900
hybrid steps of 32 images; the ViT gets the steps that spend the same training FLOPs (its forward pass is
cheaper, so 13% more steps). Every (seed, budget, model) is a run of its own (the function `run` below):
AdamW (learning rate 2e-3, weight decay 0.05, none on biases, norms, position embeddings and the class
token), 10% linear warmup then cosine decay to zero at its last step, clipping at global norm 1, no
augmentation; seeds 0 and 1, a seed fixing both the initial weights and the order of the images (the same
order for both models). Each run's test accuracy is measured on all 10,000 test images; its time is its
number of steps times its median step time.

Results go to OUT/hybrid_vs_vit.json (one entry per run, written after every run, so an interrupted script
continues where it stopped; the loss averaged over stretches of 10 steps), and the weights of the hybrid
of seed 0 at the largest budget to OUT/hybrid_vs_vit-hybrid-seed0.safetensors (float32, 0.3 MB: the lesson
times it and compares its stem with its initial self). The machine, the commit and the time of every run
are recorded. On a quiet 2-core CPU the whole script takes about three minutes.
"""
import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import tinyvit as tv
from tinyvit import functional as F
from tinyvit import optim
from tinyvit.data import Augment, DataLoader, load_dataset
from tinyvit.io.arrays import save_arrays
from tinyvit.models import ViT, ViTConfig, training_flops
from tinyvit.models.hybrid import HybridConfig, HybridViT
from lesson_runs import accuracy, commit, machine

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (100, 300, 900)          # hybrid steps
SEEDS = (0, 1)
BATCH = 32
LR = 2e-3
WEIGHT_DECAY = 0.05
LOSS_EVERY = 10                    # the stored loss: the mean of every 10 steps
WEIGHTS = "hybrid_vs_vit-hybrid-seed0.safetensors"


def configs(ds):
    """The two models, for the images of ``ds``: {"ViT": ViTConfig, "hybrid": HybridConfig}."""
    transformer = dict(image_size=ds.image_size, in_channels=ds.channels, num_classes=ds.num_classes,
                       dim=64, depth=2, num_heads=4, mlp_dim=128)
    return {"ViT": ViTConfig(patch_size=4, **transformer),
            "hybrid": HybridConfig(patch_size=1, resnet_layers=(1,), resnet_width_factor=0.25, resnet_groups=8,
                                   resnet_root="bit", **transformer)}


def epochs(loader):
    while True:                                          # a new order every epoch
        yield from loader


def train(model, ds, steps, seed, batch_size=BATCH):
    """`steps` steps of AdamW, warmup then cosine decay to zero at the last step -> (loss of every step,
    time of every step in seconds)."""
    to_input = Augment(ds.mean, ds.std)                                     # uint8 -> normalised floats
    opt = optim.AdamW(optim.param_groups_weight_decay(model, weight_decay=WEIGHT_DECAY), lr=LR)
    sched = optim.LRScheduler(opt, lambda s: optim.warmup_cosine(s, steps, max(1, steps // 10), LR))
    loader = DataLoader(ds.train_images, ds.train_labels, batch_size, shuffle=True, seed=seed, drop_last=True,
                        transform=to_input)                                 # the same order for both models
    losses, times = [], []
    for step, (x, y) in zip(range(steps), epochs(loader)):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        optim.clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times


def run(ds, name, budget, seed, batch_size=BATCH, n_test=None):
    """One run: model `name` ("ViT" or "hybrid") at the training compute of `budget` hybrid steps ->
    (results dict, the trained model). Its time: steps x the median step time, which bursts of other
    work on a shared machine move far less than the total."""
    c = configs(ds)[name]
    ratio = training_flops(configs(ds)["hybrid"]) / training_flops(configs(ds)["ViT"])
    steps = budget if name == "hybrid" else round(budget * ratio)          # equal training compute
    tv.manual_seed(seed)
    model = HybridViT(c) if name == "hybrid" else ViT(c)
    t0 = time.perf_counter()
    losses, times = train(model, ds, steps, seed, batch_size)
    wall = time.perf_counter() - t0
    n_test = len(ds.test_labels) if n_test is None else n_test
    acc = accuracy(model, ds.test_images[:n_test], ds.test_labels[:n_test], Augment(ds.mean, ds.std))
    loss = [round(float(np.mean(losses[i:i + LOSS_EVERY])), 4) for i in range(0, steps, LOSS_EVERY)]
    result = dict(model=name, budget=budget, seed=seed, steps=steps, batch_size=batch_size,
                  flops=steps * batch_size * training_flops(c), acc=acc, n_test=n_test, loss=loss,
                  step_ms=round(1e3 * float(np.median(times)), 2), seconds=round(steps * float(np.median(times)), 2),
                  wall_seconds=round(wall, 1), parameters=model.num_parameters(),
                  finished=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return result, model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "lessons" / "results")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)

    ds = load_dataset("fashion-mnist", root=args.data_dir, download=False)     # root None: the default folder
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "hybrid_vs_vit.json"
    store = json.loads(path.read_text()) if path.is_file() else {}
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    store.setdefault("about", {
        "script": "data_scripts/lesson_hybrid_runs.py",
        "data": "Fashion-MNIST (60,000 training images); test accuracy on all 10,000 test images",
        "settings": dict(budgets=list(BUDGETS), seeds=list(SEEDS), batch_size=BATCH, lr=LR,
                         weight_decay=WEIGHT_DECAY, loss_every=LOSS_EVERY),
        "training": f"AdamW lr {LR:g}, weight decay {WEIGHT_DECAY}, 10% warmup then cosine to zero, clip 1, "
                    f"batch {BATCH}, no augmentation",
        "machine": machine(),
        "load_average_at_start": None if load is None else [round(v, 2) for v in load],
        "commit": commit()})
    runs = store.setdefault("runs", {})
    for seed in SEEDS:
        for budget in BUDGETS:
            for name in ("ViT", "hybrid"):
                key = f"{name} budget={budget} seed={seed}"
                if key in runs:
                    continue
                result, model = run(ds, name, budget, seed)
                runs[key] = result
                print(f"{key:26s} {result['steps']:5d} steps  test {100 * result['acc']:5.2f}%  "
                      f"{result['step_ms']:6.1f} ms/step  {result['wall_seconds']:6.1f} s", flush=True)
                if name == "hybrid" and seed == SEEDS[0] and budget == BUDGETS[-1]:
                    save_arrays(args.out / WEIGHTS, {k: np.asarray(v, np.float32) for k, v in model.state_dict().items()},
                                {"run": key, "test_accuracy": f"{result['acc']:.4f}", "commit": commit()})
                path.write_text(json.dumps(store, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
