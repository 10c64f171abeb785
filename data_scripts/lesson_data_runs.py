"""Train the runs behind lesson 12 (Figure 4 of the paper in miniature: a ViT and a CNN of the same
FLOPs per image trained on growing random subsets of Fashion-MNIST) and store their results for the
lesson to load:

    python data_scripts/lesson_data_runs.py [--out lessons/results]

Every run trains one model the same way (the function `run` below): the same number of steps (1,200
batches of 64) whatever the subset's size, AdamW with learning rate 2e-3 and weight decay 0.05 (none on
biases, norms, position embeddings and the class token), 10% linear warmup then cosine decay to zero,
clipping at global norm 1, no augmentation, no extra regularisation. The last 2,000 training images are
never trained on; 1,000 of them are the validation set, measured 6 times during the run, and the weights
of the best measurement are kept (early stopping, as the paper's section 4.3 does); the test accuracy of
those weights is measured on all 10,000 test images, the training accuracy on (up to) 2,000 of the
subset's own images. The subsets are nested: the first n images of one random permutation.

The runs: the ViT and the CNN (`MODELS`) on 500, 2,000, 8,000 and 32,000 images, each with seeds 0 and 1
(a seed fixes the initial weights and the order of the batches; the subsets are the same for both).

Results go to OUT/data_and_inductive_bias.json (one entry per run, written after every run, so an
interrupted script continues where it stopped), with the settings, the machine, the BLAS threads and the
commit. On a 2-core CPU the 16 runs take about nine minutes.
"""
import argparse
import copy
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import tinyvit as tv
from tinyvit import functional as F
from tinyvit import nn, optim
from tinyvit.data import Augment, DataLoader, load_dataset
from tinyvit.models import create
from lesson_runs import accuracy, commit, machine

ROOT = Path(__file__).resolve().parent.parent
VAL = 2000                 # the last VAL training images: never trained on; the first N_VAL of them validate
N_VAL = 1000
SIZES = (500, 2000, 8000, 32000)
SEEDS = (0, 1)
SETTINGS = dict(steps=1200, batch=64, lr=2e-3, weight_decay=0.05, evals=6)


class SmallCNN(nn.Module):
    """Three 3x3 convolutions with ReLU, 2x2 max-pooling after the first two, a linear classifier.
    images (B, C, S, S) -> logits (B, classes)."""

    def __init__(self, in_channels, num_classes, image_size, widths=(16, 32, 64)):
        super().__init__()
        c1, c2, c3 = widths
        self.conv1 = nn.Conv2d(in_channels, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.conv3 = nn.Conv2d(c2, c3, 3, padding=1)
        self.head = nn.Linear(c3 * (image_size // 4) ** 2, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)            # (B, 16, S/2, S/2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)            # (B, 32, S/4, S/4)
        x = F.relu(self.conv3(x))                                # (B, 64, S/4, S/4)
        return self.head(F.reshape(x, (x.shape[0], -1)))          # (B, 64 S^2/16) -> (B, classes)


def cnn_flops(in_channels, num_classes, image_size, widths=(16, 32, 64)):
    """FLOPs of one image's forward pass (2 per multiply-add): the three convolutions and the classifier."""
    c1, c2, c3 = widths
    s = image_size
    convs = 2 * 9 * (s * s * in_channels * c1 + (s // 2) ** 2 * c1 * c2 + (s // 4) ** 2 * c2 * c3)
    return convs + 2 * c3 * (s // 4) ** 2 * num_classes


MODELS = {                 # name -> a function of (in_channels, num_classes, image_size) -> a fresh model
    "ViT": lambda **sized: create("vit-mnist/7", **sized, dim=64, depth=3, mlp_dim=128),
    "CNN": lambda **sized: SmallCNN(**sized),
}


def run(ds, order, name, n, seed, settings=SETTINGS, n_test=None):
    """Train model `name` for settings["steps"] steps on the first n images of `order`; keep the weights with
    the best validation accuracy -> {"val", "best_step", "train", "test", "curve", "seconds", "ms_per_step"}."""
    steps, batch, lr, evals = (settings[k] for k in ("steps", "batch", "lr", "evals"))
    to_input = Augment(ds.mean, ds.std)                      # uint8 -> normalised float32; no augmentation
    pool = len(ds.train_images) - VAL
    val_x, val_y = ds.train_images[pool:pool + N_VAL], ds.train_labels[pool:pool + N_VAL]
    test_x, test_y = ds.test_images[:n_test], ds.test_labels[:n_test]
    tv.manual_seed(seed)                                     # the initial weights
    model = MODELS[name](in_channels=ds.channels, num_classes=ds.num_classes, image_size=ds.image_size)
    images, labels = ds.train_images[order[:n]], ds.train_labels[order[:n]]
    opt = optim.AdamW(optim.param_groups_weight_decay(model, weight_decay=settings["weight_decay"]), lr=lr)
    sched = optim.LRScheduler(opt, lambda s: optim.warmup_cosine(s, steps, max(1, steps // 10), lr))
    loader = DataLoader(images, labels, batch, shuffle=True, seed=seed, drop_last=True, transform=to_input)
    best, curve = {"val": -1.0}, []
    step, t0 = 0, time.perf_counter()
    while step < steps:
        for x, y in loader:                                  # one epoch, freshly shuffled
            loss = F.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            optim.clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % (steps // evals) == 0:                 # early stopping: keep the best weights
                val = accuracy(model, val_x, val_y, to_input)
                curve.append([step, val])
                if val > best["val"]:
                    best = {"val": val, "best_step": step, "state": copy.deepcopy(model.state_dict())}
            if step == steps:
                break
    seconds = time.perf_counter() - t0                       # training and validation, not the final tests
    model.load_state_dict(best.pop("state"))
    return {**best, "train": accuracy(model, images[:2000], labels[:2000], to_input),
            "test": accuracy(model, test_x, test_y, to_input), "curve": curve,
            "seconds": round(seconds, 1), "ms_per_step": round(1e3 * seconds / steps, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "lessons" / "results")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)

    ds = load_dataset("fashion-mnist", root=args.data_dir, download=False)
    pool = len(ds.train_images) - VAL
    order = np.random.default_rng(1).permutation(pool)       # subset of size n: its first n images
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "data_and_inductive_bias.json"
    store = json.loads(path.read_text()) if path.is_file() else {}
    store.setdefault("about", {
        "script": "data_scripts/lesson_data_runs.py",
        "data": f"Fashion-MNIST; subsets: the first n of np.random.default_rng(1).permutation({pool}); the last "
                f"{VAL} training images held out ({N_VAL} validate); test accuracy on all {len(ds.test_images)} "
                "test images; training accuracy on up to 2000 of the subset's images",
        "training": f"{SETTINGS['steps']} steps of {SETTINGS['batch']} images, AdamW lr {SETTINGS['lr']:g}, weight "
                    f"decay {SETTINGS['weight_decay']}, 10% warmup then cosine, clip 1, no augmentation, early "
                    f"stopping on the validation accuracy measured {SETTINGS['evals']} times",
        "settings": SETTINGS, "sizes": list(SIZES), "seeds": list(SEEDS),
        "machine": machine(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", f"unset (OpenBLAS's default: {os.cpu_count()})"),
        "commit": commit(),
        "started": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    runs = store.setdefault("runs", {})
    t0 = time.perf_counter()
    for seed in SEEDS:
        for n in SIZES:
            for name in MODELS:
                key = f"{name} n={n} seed={seed}"
                if key in runs:
                    continue
                runs[key] = run(ds, order, name, n, seed)
                r = runs[key]
                print(f"{key:22s} test {100 * r['test']:5.2f}%  val {100 * r['val']:5.1f}%  best step {r['best_step']:4d}"
                      f"  train {100 * r['train']:5.1f}%  {r['ms_per_step']:5.1f} ms/step", flush=True)
                path.write_text(json.dumps(store, indent=1) + "\n")
    print(f"done in {time.perf_counter() - t0:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
