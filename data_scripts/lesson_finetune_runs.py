"""Train the runs behind lesson 13's fine-tuning comparison (the paper's section 3.2, appendix B.1.1 and
section 4.6 in miniature) and store their results for the lesson to load:

    OPENBLAS_NUM_THREADS=1 python data_scripts/lesson_finetune_runs.py [--out lessons/results]

Two tasks from Fashion-MNIST (`tasks` below): pre-training on the first five classes (all 30,000 of their
training images, with labels), fine-tuning on the other five with 500 labelled training images drawn once
(NumPy generator 0) and tested on all 5,000 test images of those classes. Every model has the same encoder
(`ENCODER`: 7x7 patches, D = 64, 3 blocks of 4 heads, D_mlp = 128).

Pre-training, seeds 0 and 1 (a seed fixes the initial weights, the order of the images and the masks):

* supervised: a ViT at 28 px with the paper's pre-training head (`pre_logits`, representation size 64),
  1000 steps of 64 images, AdamW learning rate 2e-3 (`pretrain_supervised`); its test accuracy on 2,000
  test images of its classes, and without any fine-tuning its accuracy at 42 px with the position
  embeddings interpolated, zero-padded, or none (`at_resolution`);
* masked patch prediction (mean 3-bit colour targets, lesson 10) on all 60,000 training images without
  labels, and on the 30,000 of the pre-training classes: 1000 steps of 64, AdamW learning rate 1e-3
  (`pretrain_masked`); its held-out loss and accuracy on the masked patches of 2,000 test images.

Fine-tuning (`fine_tune`): 300 steps of 64 of the 500 labelled images, AdamW learning rate 1e-3 (weight
decay 0.05, 10% warmup, cosine decay, clipping at norm 1: lesson 08's loop, `train_steps`), no augmentation,
the head replaced by a zero-initialised one (`prepare_finetune`), at 42 px with the position embeddings
interpolated, from each start: from scratch (seeds 0-3, a seed fixing the initial weights and the order),
supervised, masked on all images, masked on the pre-training classes (each pre-training seed 0 and 1 x
fine-tuning seeds 0 and 1, the fine-tuning seed fixing the order of the images); and from the supervised
models two variants: at 42 px with the zero-padded table, and at 28 px. Each run records its test accuracy
on all 5,000 test images and a curve on the first 1,000 every 75 steps.

Results go to OUT/finetune.json (written after every run; an interrupted script continues where it
stopped), the supervised pre-trained models to OUT/finetune-supervised-seed{0,1}.safetensors (`tv.save`,
float32, 0.4 MB each: the lesson's demonstrations and its repeated run start from them). The machine, the
commit, OPENBLAS_NUM_THREADS and the time of every run are recorded. With one BLAS thread, alone on a
2-core CPU, the script took 9.3 minutes (2026-11-27).
"""
import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import tinyvit as tv
from tinyvit import functional as F
from tinyvit import optim
from tinyvit.data import Augment, DataLoader, load_dataset
from tinyvit.models import ViT, ViTConfig
from tinyvit.models.masked import MaskedConfig, MaskedPatchViT
from tinyvit.models.posemb import resize_pos_embed
from tinyvit.training import MaskedPrediction, prepare_finetune
from tinyvit.training.components import resize_images
from lesson_runs import accuracy, commit, machine

ROOT = Path(__file__).resolve().parent.parent
ENCODER = dict(patch_size=7, dim=64, depth=3, num_heads=4, mlp_dim=128)
REPRESENTATION = 64                  # the pre-training head's hidden layer (pre_logits)
BATCH = 64
PRE_STEPS, PRE_LR = 1000, 2e-3       # supervised pre-training
MASK_STEPS, MASK_LR = 1000, 1e-3     # masked patch prediction
FT_STEPS, FT_LR = 300, 1e-3          # fine-tuning
PRE_SEEDS = (0, 1)
FT_SEEDS = (0, 1)
SCRATCH_SEEDS = (0, 1, 2, 3)         # as many runs as each pre-trained start has
N_LABELLED = 500
N_PRE_TEST = 2000                    # test images of the pre-training classes
N_CURVE = 1000                       # test images for the curve during fine-tuning
CURVE_EVERY = FT_STEPS // 4
STARTS = ("from scratch", "supervised", "masked, all images", "masked, pre-training classes")


def weights_name(seed):
    return f"finetune-supervised-seed{seed}.safetensors"


def tasks(ds, n_pre_test=N_PRE_TEST, n_down_test=None):
    """The two tasks: a dict of uint8 images and labels (downstream labels 0..4), the sizes and `to_input`."""
    half = ds.num_classes // 2
    up_train = ds.train_labels < half
    up_test = np.flatnonzero(ds.test_labels < half)[:n_pre_test]
    chosen = np.random.default_rng(0).choice(np.flatnonzero(~up_train), N_LABELLED, replace=False)
    down_test = np.flatnonzero(ds.test_labels >= half)[:n_down_test]
    return dict(half=half, K=ds.num_classes - half, lo=ds.image_size, hi=ds.image_size * 3 // 2,
                to_input=Augment(ds.mean, ds.std), all_x=ds.train_images, mean=ds.mean, std=ds.std,
                encoder=dict(in_channels=ds.channels, **ENCODER),
                pre_x=ds.train_images[up_train], pre_y=ds.train_labels[up_train],
                pre_test_x=ds.test_images[up_test], pre_test_y=ds.test_labels[up_test],
                down_x=ds.train_images[chosen], down_y=ds.train_labels[chosen] - half,
                down_test_x=ds.test_images[down_test], down_test_y=ds.test_labels[down_test] - half)


def train_steps(model, images, labels, steps, lr, loss_fn, to_input, batch_size=BATCH, seed=0, every=None,
                on_eval=None):
    """AdamW (weight decay 0.05, none on biases, norms, class token and position embeddings), 10% warmup then
    cosine decay, clipping at global norm 1: lesson 08's loop for `steps` steps. loss_fn(model, x, y) -> loss;
    on_eval(step) is called every `every` steps. Returns the last loss."""
    opt = optim.AdamW(optim.param_groups_weight_decay(model, weight_decay=0.05), lr=lr)
    sched = optim.LRScheduler(opt, lambda s: optim.warmup_cosine(s, steps, max(1, steps // 10), lr))
    loader = DataLoader(images, labels, batch_size, shuffle=True, seed=seed, drop_last=True, transform=to_input)
    step = 0
    while step < steps:
        for x, y in loader:
            loss = loss_fn(model, x, y)
            model.zero_grad()
            loss.backward()
            optim.clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if every and step % every == 0:
                on_eval(step)
            if step == steps:
                return loss.item()


def classify(model, x, y):
    return F.cross_entropy(model(x), y)


def pretrain_supervised(t, seed, steps=PRE_STEPS):
    """A ViT with the pre-training head (pre_logits + classifier), trained with the labels of the pre-training
    task at 28 px -> the model."""
    tv.manual_seed(seed)
    model = ViT(ViTConfig(image_size=t["lo"], num_classes=t["half"], representation_size=REPRESENTATION, **t["encoder"]))
    train_steps(model, t["pre_x"], t["pre_y"], steps, PRE_LR, classify, t["to_input"], seed=seed)
    return model


def pretrain_masked(t, images, seed, steps=MASK_STEPS):
    """Masked patch prediction (mean 3-bit colour targets) on unlabelled images -> (model, last loss, held-out
    {"loss", "acc"} on the pre-training task's test images)."""
    tv.manual_seed(seed)
    model = MaskedPatchViT(MaskedConfig(image_size=t["lo"], target="mean3bit", **t["encoder"]))
    objective = MaskedPrediction(mean=t["mean"], std=t["std"])
    no_labels = np.zeros(len(images), np.int64)                     # the loader wants labels; the loss never reads them
    loss = train_steps(model, images, no_labels, steps, MASK_LR,
                       lambda m, x, y: m.loss(x, objective.targets(m, x))[0], t["to_input"], seed=seed)
    with tv.no_grad():                                              # the held-out loss, fixed corruption
        test = objective.evaluate(model, DataLoader(t["pre_test_x"], t["pre_test_y"], 500, transform=t["to_input"]))
    return model, loss, {k: float(test[k]) for k in ("loss", "acc")}


def zero_padded(pos_embed, num_rows):
    """The 1-D way to grow a table (1, 1 + N, D) to (1, num_rows, D): the old rows first, zeros after."""
    extra = num_rows - pos_embed.shape[1]
    return np.concatenate([pos_embed, np.zeros((1, extra, pos_embed.shape[2]), pos_embed.dtype)], axis=1)


def at_resolution(model, size, table):
    """A copy of `model` for size x size images with the position embeddings `table` (1, 1 + N', D)."""
    new = ViT(replace(model.config, image_size=size))
    state = dict(model.state_dict())
    state["pos_embed"] = table
    new.load_state_dict(state)
    return new


def without_finetuning(t, model):
    """The pre-trained model (its pre-training head kept) on its own test images at 28 px, and at 42 px with
    the position embeddings interpolated, zero-padded or none -> {name: accuracy}."""
    g_lo, g_hi = t["lo"] // ENCODER["patch_size"], t["hi"] // ENCODER["patch_size"]
    pe = model.pos_embed.numpy()
    tables = {"interpolated": resize_pos_embed(pe, g_lo, g_hi), "zero-padded": zero_padded(pe, 1 + g_hi ** 2),
              "no position embeddings": np.concatenate([pe[:, :1], np.zeros((1, g_hi ** 2, pe.shape[2]), pe.dtype)], 1)}
    test_hi = resize_images(t["pre_test_x"], t["hi"])
    acc = {"28 px": accuracy(model, t["pre_test_x"], t["pre_test_y"], t["to_input"])}
    for name, table in tables.items():
        acc[f"42 px, {name}"] = accuracy(at_resolution(model, t["hi"], table), test_hi, t["pre_test_y"], t["to_input"])
    return acc


def fine_tune(t, checkpoint, seed, size=None, posemb="interpolated", steps=FT_STEPS, n_curve=N_CURVE):
    """Fine-tune on the 500 labelled images at `size` px (default 42) from `checkpoint` (None: from scratch),
    the head replaced by a zero-initialised one and E_pos interpolated (or zero-padded) -> results dict:
    {"test": accuracy on the downstream test images, "curve": [[step, accuracy on the first n_curve]], ...}."""
    size = t["hi"] if size is None else size
    tv.manual_seed(seed)
    if checkpoint is None:
        model = ViT(ViTConfig(image_size=size, num_classes=t["K"], **t["encoder"]))
    else:
        model = prepare_finetune(checkpoint, num_classes=t["K"], image_size=size)
        if posemb == "zero-padded":
            model.pos_embed.data[...] = zero_padded(tv.load(checkpoint).pos_embed.numpy(), model.pos_embed.shape[1])
    images, test_x = t["down_x"], t["down_test_x"]
    if size != t["lo"]:
        images, test_x = resize_images(images, size), resize_images(test_x, size)
    test_y, to_input = t["down_test_y"], t["to_input"]
    curve = [[0, accuracy(model, test_x[:n_curve], test_y[:n_curve], to_input)]]
    record = lambda step: curve.append([step, accuracy(model, test_x[:n_curve], test_y[:n_curve], to_input)])
    t0 = time.perf_counter()
    train_steps(model, images, t["down_y"], steps, FT_LR, classify, to_input, seed=seed, every=max(1, steps // 4),
                on_eval=record)
    seconds = time.perf_counter() - t0
    return dict(test=accuracy(model, test_x, test_y, to_input), curve=curve, steps=steps, size=size, posemb=posemb,
                seed=seed, n_test=len(test_y), n_curve=min(n_curve, len(test_y)), seconds=round(seconds, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "lessons" / "results")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)

    ds = load_dataset("fashion-mnist", root=args.data_dir, download=False)     # root None: the default folder
    t = tasks(ds)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "finetune.json"
    store = json.loads(path.read_text()) if path.is_file() else {}
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    store.setdefault("about", {
        "script": "data_scripts/lesson_finetune_runs.py",
        "data": f"Fashion-MNIST: pre-training on classes 0-4 ({len(t['pre_x']):,} training images, tested on "
                f"{len(t['pre_test_y']):,}), fine-tuning on classes 5-9 ({N_LABELLED} labelled images, tested on all "
                f"{len(t['down_test_y']):,})",
        "settings": dict(encoder=ENCODER, representation_size=REPRESENTATION, batch_size=BATCH, pre_steps=PRE_STEPS,
                         pre_lr=PRE_LR, mask_steps=MASK_STEPS, mask_lr=MASK_LR, ft_steps=FT_STEPS, ft_lr=FT_LR,
                         pre_seeds=list(PRE_SEEDS), ft_seeds=list(FT_SEEDS), scratch_seeds=list(SCRATCH_SEEDS),
                         n_labelled=N_LABELLED, n_pre_test=N_PRE_TEST, n_curve=N_CURVE, starts=list(STARTS)),
        "training": "AdamW, weight decay 0.05 (none on biases, norms, class token, position embeddings), 10% warmup "
                    "then cosine decay, clip 1, batch 64, no augmentation",
        "machine": machine(), "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "load_average_at_start": load, "commit": commit(),
        "started": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    pre = store.setdefault("pretraining", {})
    runs = store.setdefault("runs", {})

    def save():
        path.write_text(json.dumps(store, indent=1))

    work = tempfile.TemporaryDirectory()
    checkpoints = {}
    for seed in PRE_SEEDS:
        weights = args.out / weights_name(seed)
        key = f"supervised seed={seed}"
        if key not in pre or not weights.is_file():
            t0 = time.perf_counter()
            model = pretrain_supervised(t, seed)
            seconds = time.perf_counter() - t0
            tv.save(model, weights, metadata={"run": key, "commit": commit()})
            model = tv.load(weights)                                # evaluated as stored
            pre[key] = dict(seed=seed, steps=PRE_STEPS, seconds=round(seconds, 1), without_finetuning=without_finetuning(t, model))
            print(f"{key}: {seconds:.0f} s, {pre[key]['without_finetuning']}", flush=True)
            save()
        checkpoints[("supervised", seed)] = str(weights)
        for name, images in (("masked, all images", t["all_x"]), ("masked, pre-training classes", t["pre_x"])):
            needed = [f"{name} pre={seed} ft={f}" for f in FT_SEEDS]
            if all(k in runs for k in needed):
                continue
            t0 = time.perf_counter()
            model, last, test = pretrain_masked(t, images, seed)
            seconds = time.perf_counter() - t0
            checkpoints[(name, seed)] = os.path.join(work.name, f"{name}-{seed}.safetensors".replace(" ", "_"))
            tv.save(model, checkpoints[(name, seed)])
            pre[f"{name} seed={seed}"] = dict(seed=seed, steps=MASK_STEPS, images=len(images), last_loss=last,
                                              test_loss=test["loss"], test_acc=test["acc"], seconds=round(seconds, 1))
            print(f"{name} seed={seed}: {seconds:.0f} s, test {test}", flush=True)
            save()

    plan = [(f"from scratch seed={s}", None, s, None, "interpolated") for s in SCRATCH_SEEDS]
    for p in PRE_SEEDS:
        for f in FT_SEEDS:
            for start in STARTS[1:]:
                plan.append((f"{start} pre={p} ft={f}", (start, p), f, None, "interpolated"))
            plan.append((f"supervised zero-padded pre={p} ft={f}", ("supervised", p), f, None, "zero-padded"))
            plan.append((f"supervised 28 px pre={p} ft={f}", ("supervised", p), f, t["lo"], "interpolated"))
    for key, start, seed, size, posemb in plan:
        if key in runs:
            continue
        result = fine_tune(t, None if start is None else checkpoints[start], seed, size=size, posemb=posemb)
        result.update(start="from scratch" if start is None else start[0], pre_seed=None if start is None else start[1],
                      finished=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        runs[key] = result
        print(f"{key:45s} test {100 * result['test']:5.2f}%  curve {[round(100 * a, 1) for _, a in result['curve']]}  "
              f"{result['seconds']:5.1f} s", flush=True)
        save()
    work.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
