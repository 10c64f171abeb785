"""Train the small runs behind lesson 14's ablations (the paper's appendix D.3, D.4 and section 4.3 in
miniature) and store their results for the lesson to load:

    python data_scripts/lesson_ablations.py [--only posemb,pool,size,scale] [--out lessons/results]

Every run trains a small ViT on Fashion-MNIST the same way (the function `run` below): AdamW with weight
decay 0.05 (none on biases, norms, position embeddings and the class token), 10% linear warmup then
cosine decay to zero, clipping at global norm 1, batches of 64, no augmentation, no label smoothing. The
last 2,000 training images are never trained on; 1,000 of them are the validation set, measured
`evals` times during the run, and the weights of the best measurement are kept (early stopping, as the
paper's section 4.3 does); the test accuracy of those weights is measured on all 10,000 test images.

The experiments (each run with seeds 0 and 1; a seed fixes the initial weights and the order of the images):

* posemb (appendix D.4, Table 8): `vit-mnist/4` with D = 64, 4 blocks of 4 heads, D_mlp = 128 (a 7x7
  grid of 49 patches), with no position embedding, learned 1-D, learned 2-D, fixed sin-cos 2-D and
  relative (a learned bias of every layer's attention logits, nn.RelativeMultiHeadAttention), 800 steps
  on the 58,000 training images; the final absolute position embeddings are stored too;
* pool (appendix D.3, Figure 9): the same model with the class token or global average pooling, each at
  learning rates 1e-3 and 4e-3, 800 steps, the validation accuracy at every evaluation stored (the curve);
* size (section 4.3, Figure 3): a small (D = 32, 2 blocks of 2 heads, D_mlp = 64) and a large (D = 96,
  6 blocks of 4 heads, D_mlp = 192) `vit-mnist/7` trained for the same 1,200 steps on nested random
  subsets of 1,000, 4,000, 16,000 and all 58,000 training images;
* scale (appendix D.2, Figure 8): `vit-mnist/7` with D = 64, 4 blocks of 4 heads, D_mlp = 128 (a 4x4 grid
  of 16 patches), and the same model with one dimension halved or doubled: depth 2 or 8, width D = 32 or
  128 (heads of 16 dimensions, D_mlp = 2D), or patches of 4 instead of 7 pixels (a 7x7 grid of 49 tokens,
  3.2 times the FLOPs, the same number of parameters: E shrinks as much as the position table grows); 800
  steps on the 58,000 training images.

Results go to OUT/ablations.json (one entry per run, written after every run, so an interrupted script
continues where it stopped) and the position embeddings to OUT/ablations-posemb.npz (float16). The
machine, the commit and the time of every run are recorded. On a 2-core CPU the whole script takes
about 45 minutes (one BLAS thread).
"""
import argparse
import copy
import datetime as dt
import json
import sys
import time
from pathlib import Path

import numpy as np

import tinyvit as tv
from tinyvit import functional as F
from tinyvit import optim
from tinyvit.data import Augment, DataLoader, load_dataset
from tinyvit.models import create
from lesson_runs import accuracy, commit, machine

ROOT = Path(__file__).resolve().parent.parent
VAL = 2000                 # the last VAL training images: never trained on; the first 1,000 of them validate
N_VAL = 1000
BATCH = 64
WEIGHT_DECAY = 0.05
SEEDS = (0, 1)

BASE = dict(name="vit-mnist/4", dim=64, depth=4, num_heads=4, mlp_dim=128)
SIZES = {"small": dict(name="vit-mnist/7", dim=32, depth=2, num_heads=2, mlp_dim=64),
         "large": dict(name="vit-mnist/7", dim=96, depth=6, num_heads=4, mlp_dim=192)}
SCALE_BASE = dict(name="vit-mnist/7", dim=64, depth=4, num_heads=4, mlp_dim=128)
SCALES = {"base": {}, "depth=2": dict(depth=2), "depth=8": dict(depth=8),
          "width=32": dict(dim=32, num_heads=2, mlp_dim=64), "width=128": dict(dim=128, num_heads=8, mlp_dim=256),
          "patch=4": dict(name="vit-mnist/4")}


def experiments(full_pool):
    """Every run: (experiment, key, settings). A key names a run in ablations.json."""
    runs = []
    for seed in SEEDS:
        for posemb in ("none", "learned-1d", "learned-2d", "sincos-2d", "relative"):
            runs.append(("posemb", f"posemb={posemb} seed={seed}",
                         dict(model={**BASE, "posemb": posemb}, n=full_pool, steps=800, lr=2e-3, seed=seed, evals=4)))
    for seed in SEEDS:
        for pool in ("token", "gap"):
            for lr in (1e-3, 4e-3):
                runs.append(("pool", f"pool={pool} lr={lr:g} seed={seed}",
                             dict(model={**BASE, "pool": pool}, n=full_pool, steps=800, lr=lr, seed=seed, evals=8)))
    for seed in SEEDS:
        for n in (1000, 4000, 16000, full_pool):
            for size, model in SIZES.items():
                runs.append(("size", f"size={size} n={n} seed={seed}",
                             dict(model=model, n=n, steps=1200, lr=2e-3, seed=seed, evals=6)))
    for seed in SEEDS:
        for label, change in SCALES.items():
            runs.append(("scale", f"scale={label} seed={seed}",
                         dict(model={**SCALE_BASE, **change}, n=full_pool, steps=800, lr=2e-3, seed=seed, evals=4)))
    return runs


def run(ds, order, settings):
    """Train one model as the module docstring says -> (results dict, the trained model)."""
    to_input = Augment(ds.mean, ds.std)
    pool = len(ds.train_images) - VAL
    val_x, val_y = ds.train_images[pool:pool + N_VAL], ds.train_labels[pool:pool + N_VAL]
    spec = dict(settings["model"])
    name = spec.pop("name")
    steps, lr, seed, n, evals = (settings[k] for k in ("steps", "lr", "seed", "n", "evals"))
    tv.manual_seed(seed)
    model = create(name, **spec)
    images, labels = ds.train_images[order[:n]], ds.train_labels[order[:n]]
    opt = optim.AdamW(optim.param_groups_weight_decay(model, weight_decay=WEIGHT_DECAY), lr=lr)
    sched = optim.LRScheduler(opt, lambda s: optim.warmup_cosine(s, steps, max(1, steps // 10), lr))
    loader = DataLoader(images, labels, BATCH, shuffle=True, seed=seed, drop_last=len(images) >= BATCH,
                        transform=to_input)
    curve, losses, best = [], [], {"val": -1.0}
    step, t0 = 0, time.perf_counter()
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            optim.clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            step += 1
            if step % (steps // evals) == 0 or step == steps:
                val = accuracy(model, val_x, val_y, to_input)
                curve.append([step, val])
                if val > best["val"]:
                    best = {"val": val, "best_step": step, "state": copy.deepcopy(model.state_dict())}
            if step == steps:
                break
    seconds = time.perf_counter() - t0
    final_test = accuracy(model, ds.test_images, ds.test_labels, to_input)
    model.load_state_dict(best.pop("state"))
    k = max(1, steps // 50)                                           # the loss, averaged over 50 stretches
    result = {**best, "test": accuracy(model, ds.test_images, ds.test_labels, to_input), "final_test": final_test,
              "train": accuracy(model, images[:2000], labels[:2000], to_input), "curve": curve,
              "loss": [round(float(np.mean(losses[i:i + k])), 4) for i in range(0, len(losses), k)],
              "seconds": round(seconds, 1), "parameters": model.num_parameters(),
              "forward_flops": model.config.forward_flops(), "settings": settings,
              "finished": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    return result, model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="posemb,pool,size,scale", help="experiments to run (comma-separated)")
    parser.add_argument("--out", type=Path, default=ROOT / "lessons" / "results")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    only = set(args.only.split(","))

    ds = load_dataset("fashion-mnist", root=args.data_dir, download=False)     # root None: the default folder
    pool = len(ds.train_images) - VAL
    order = np.random.default_rng(1).permutation(pool)                # subset of size n: its first n images
    args.out.mkdir(parents=True, exist_ok=True)
    path, npz = args.out / "ablations.json", args.out / "ablations-posemb.npz"
    store = json.loads(path.read_text()) if path.is_file() else {}
    store.setdefault("about", {
        "script": "data_scripts/lesson_ablations.py", "data": "Fashion-MNIST; the last 2,000 training images held "
        "out (1,000 validate), the test accuracy on all 10,000 test images",
        "training": f"AdamW, weight decay {WEIGHT_DECAY}, 10% warmup then cosine, clip 1, batch {BATCH}, no "
        "augmentation, early stopping on the validation accuracy",
        "machine": machine(), "commit": commit()})
    runs = store.setdefault("runs", {})
    arrays = dict(np.load(npz)) if npz.is_file() else {}
    for experiment, key, settings in experiments(pool):
        if experiment not in only or key in runs:
            continue
        result, model = run(ds, order, settings)
        result["experiment"] = experiment
        result["commit"] = commit()                                   # runs added later may come from a later commit
        runs[key] = result
        print(f"{key:36s} test {100 * result['test']:5.2f}%  (final {100 * result['final_test']:5.2f}%, best step "
              f"{result['best_step']}, train {100 * result['train']:5.1f}%)  {result['seconds']:6.0f} s", flush=True)
        if experiment == "posemb" and settings["model"]["posemb"] not in ("none", "relative"):   # an E_pos table
            table = model.position_embedding(np, np.float32)
            table = table.numpy() if hasattr(table, "numpy") else np.asarray(table)
            arrays[key] = table[0].astype(np.float16)                 # (1 + N, D): the class token's row first
            np.savez(npz, **arrays)
        path.write_text(json.dumps(store, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
