"""Turn a training run's best checkpoint into the small trained model the lessons load.

    python data_scripts/make_lesson_model.py RUN_FOLDER [--name NAME] [--use "what the lessons do with it"]
                                             [--command "tinyvit train ..."] [--machine "..."]

RUN_FOLDER is what `tinyvit train --out RUN_FOLDER` wrote (best.safetensors, config.json, metrics.jsonl).
The script

1. loads RUN_FOLDER/best.safetensors, casts the weights to float16 and saves them with tinyvit.save as
   lessons/models/NAME.safetensors (NAME: default <dataset>-<model>), keeping the run's dataset info
   (classes, mean, std: what `tinyvit predict` and `tinyvit eval` need) and adding a "provenance" entry
   (JSON: the training command, the run's settings, best and final test accuracy, its wall time, date and
   machine, the commit, the float16 file's own test accuracy, what the lessons use it for);
2. checks the file: it loads with tinyvit.load as float16, and its test accuracy (computed in float32 after
   loading, as `tinyvit eval` does) is within --tolerance points of the run's best;
3. writes lessons/models/README.md anew from the provenance of every model file in the folder, this one
   included (tests/test_lesson_model.py checks that the page and the files agree).

The dataset must be on this machine (as for `tinyvit eval`; Debian: apt-get install dataset-fashion-mnist).
"""
import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np

import tinyvit
from tinyvit.data import Augment, DataLoader
from tinyvit.evaluation import check_fits, load_for_inference
from tinyvit.io import load_checkpoint
from tinyvit.evaluation import evaluate
from tinyvit.training import load_data
from lesson_runs import commit, machine

ROOT = Path(__file__).resolve().parent.parent

MAX_BYTES = 2 * 1024 * 1024          # the file is committed: keep it small


def read_run(run: Path) -> dict:
    """The run's settings and results: config.json, metrics.jsonl (best/final accuracy, epochs) and the
    wall time from config.json (written when training starts) to the last line of metrics.jsonl."""
    config = json.loads((run / "config.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{run}/metrics.jsonl holds no epoch: the run has not finished one")
    best = max(rows, key=lambda r: r["test_acc"])
    start, end = (run / "config.json").stat().st_mtime, (run / "metrics.jsonl").stat().st_mtime
    return {"config": config, "best_test_accuracy": best["test_acc"], "best_epoch": best["epoch"],
            "final_test_accuracy": rows[-1]["test_acc"], "epochs": rows[-1].get("epochs_trained", rows[-1]["epoch"]),
            "wall_seconds": round(end - start, 1), "training_seconds": round(sum(r["seconds"] for r in rows), 1),
            "trained": dt.datetime.fromtimestamp(end, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def default_command(config: dict) -> str:
    """The `tinyvit train` command line the run's config.json implies (the settings that name the run)."""
    parts = ["tinyvit train", f"--dataset {config['dataset']}", f"--model {config['model']}"]
    if config.get("time_budget"):
        parts.append(f"--time-budget {config['time_budget']:g}m")
    else:
        parts.append(f"--epochs {config['epochs']}")
    return " ".join(parts)


def settings(config: dict) -> str:
    """The run's recipe in one line, from its config.json (what the command meant when it ran)."""
    c = config
    parts = (f"random crops from {c['crop_padding']} px padding" if c.get("crop_padding") else "",
             "horizontal flips" if c.get("flip") else "",
             f"RandAugment {c['randaug']}" if c.get("randaug") else "",
             f"Mixup {c['mixup']}" if c.get("mixup") else "",
             f"CutMix {c['cutmix']}" if c.get("cutmix") else "",
             f"random erasing {c['erasing']}" if c.get("erasing") else "")
    augment = ", ".join(x for x in parts if x)
    return (f"`{c['model']}`, batch {c['batch_size']}, {c['optimizer']} lr {c['lr']:g} ({c['warmup_epochs']:g} warmup "
            f"epoch(s), cosine decay to {c['min_lr']:g}), weight decay {c['weight_decay']:g}, label smoothing "
            f"{c['label_smoothing']:g}, {augment or 'no augmentation'}, drop path {c['drop_path']:g}, "
            f"{c['precision']}, seed {c['seed']}")


def test_accuracy(path, dataset) -> float:
    """Accuracy on the dataset's test split, as `tinyvit eval` computes it (float32 after loading)."""
    model, _ = load_for_inference(path)
    check_fits(model, dataset)
    loader = DataLoader(dataset.test_images, dataset.test_labels, 500, transform=Augment(dataset.mean, dataset.std))
    return evaluate(model, loader)["acc"]


def model_line(p: dict) -> str:
    """The model row of a README section: the ViT, or the hybrid's ResNet and the ViT on its feature map."""
    vit = (f"D = {p['dim']}, {p['depth']} blocks of {p['heads']} heads, {p['parameters']:,} parameters")
    if p.get("arch") == "hybrid":
        return (f"`{p['model']}` with {p.get('model_args_text', '')}: 28x28 grey images, a ResNet stem "
                f"({p['resnet']}) of stride {p['stride']}, patch size 1 on its feature map ({p['grid']}x{p['grid']} "
                f"tokens + class token, each {p['stride']}x{p['stride']} pixels), {vit}")
    args = f" with {p['model_args_text']}" if p.get("model_args_text") else ""
    return (f"`{p['model']}`{args}: {p['image_size']}x{p['image_size']} grey images, {p['patch_size']}x"
            f"{p['patch_size']} patches ({p['grid']}x{p['grid']} grid + class token), {vit}")


def section(name: str, p: dict, size: int) -> str:
    """One model file's part of lessons/models/README.md, from its provenance."""
    rows = [
        ("used by", p.get("use", "")),
        ("model", model_line(p)),
        ("data", ("Fashion-MNIST (60,000 training / 10,000 test images), from the Debian package "
                 "`dataset-fashion-mnist` (`/usr/share/datasets/fashion-mnist`; "
                 "`data_scripts/prepare_fashion_mnist.py` puts the files elsewhere)")),
        ("training command", f"`{p['command']}`"),
        ("settings (the run's config.json)", p["settings"]),
        ("training", (f"{p['epochs']:.1f} epochs in {p['wall_minutes']:.1f} minutes of wall time (from the run's "
                     f"`config.json`, written as training starts, to the last line of its `metrics.jsonl`) on a "
                     f"{p['machine']}, finished {p['trained']}")),
        ("test accuracy of the run", (f"best {100 * p['best_test_accuracy']:.2f}% (epoch {p['best_epoch']}, the "
                                     f"checkpoint kept), final {100 * p['final_test_accuracy']:.2f}%")),
        ("test accuracy of this file", (f"{100 * p['float16_test_accuracy']:.2f}% (float16 weights, computed in "
                                        f"float32 as `tinyvit eval lessons/models/{name} --dataset fashion-mnist` "
                                        "does)")),
        ("commit", f"`{p['commit']}` (when the file was made, {p['made']}){COMMIT_NOTES.get(name, '')}"),
    ]
    table = "\n".join(["| | |", "| --- | --- |"] + [f"| {key} | {value} |" for key, value in rows if value])
    return f"""## `{name}`

{size:,} bytes, float16.

{table}
"""


# What the lessons use each file for, for files made before --use existed.
USES = {"fashion-mnist-vit-mnist-7.safetensors": (
    "lesson 10 (its features against an untrained model's in few-shot linear evaluation)")}
COMMIT_NOTES = {"fashion-mnist-vit-mnist-7.safetensors": (
    "; the run trained with the code of `da2eb1d` (the commit that made `vit-mnist/7` the recipe's model, from the "
    "working tree it was committed from)")}


def readme(folder: Path) -> str:
    """lessons/models/README.md: every model file of the folder, with the numbers of its metadata."""
    sections = []
    for path in sorted(folder.glob("*.safetensors")):
        meta = load_checkpoint(path)[2]
        if "provenance" not in meta:
            continue
        p = json.loads(meta["provenance"])
        p.setdefault("use", USES.get(path.name, ""))
        sections.append(section(path.name, p, path.stat().st_size))
    return """# Trained models for the lessons

Small models trained on Fashion-MNIST by `tinyvit train`, stored in float16. Each was made from its run's
`best.safetensors` with

    python data_scripts/make_lesson_model.py RUN_FOLDER --name NAME --use "..." --command "TRAINING COMMAND"

which casts the weights to float16, keeps the run's dataset info (class names, mean, std), so that
`tinyvit predict lessons/models/NAME.safetensors IMAGE.png` and `tinyvit eval` work on it, records the numbers
below in the file's metadata (`provenance`), checks that the file's test accuracy is within 0.2 points of the
run's best, and writes this page from the metadata of every file here. `tests/test_lesson_model.py` checks that
this page and the files agree.

""" + "\n".join(sections)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run folder (tinyvit train --out)")
    parser.add_argument("--out", type=Path, default=ROOT / "lessons" / "models",
                        help="folder for the file and its README.md (default: lessons/models)")
    parser.add_argument("--name", default=None, help="the file's name without .safetensors (default: <dataset>-<model>)")
    parser.add_argument("--use", default="", help="what the lessons use the model for (shown in the README)")
    parser.add_argument("--command", default=None, help="the training command to record (default: from config.json)")
    parser.add_argument("--machine", default=None, help="the machine it trained on (default: this one's CPUs)")
    parser.add_argument("--data-dir", default=None, help="where the dataset is (default: as tinyvit train finds it)")
    parser.add_argument("--tolerance", type=float, default=0.2, help="allowed accuracy loss in points (default 0.2)")
    args = parser.parse_args(argv)

    run = read_run(args.run)
    model, _, meta = load_checkpoint(args.run / "best.safetensors")
    if "dataset" not in meta:
        raise SystemExit(f"{args.run}/best.safetensors has no dataset info; use a checkpoint tinyvit train wrote")
    cfg = model.config
    config = run["config"]
    name = (args.name or f"{config['dataset']}-{config['model'].replace('/', '-')}") + ".safetensors"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / name

    info = {"model": config["model"], "image_size": cfg.image_size, "patch_size": cfg.patch_size,
            "grid": cfg.grid_size, "dim": cfg.dim, "depth": cfg.depth, "heads": cfg.num_heads,
            "parameters": model.num_parameters(), "command": args.command or default_command(config),
            "arch": "hybrid" if hasattr(cfg, "resnet_layers") else "vit", "use": args.use, "seed": config["seed"],
            "model_args_text": ", ".join(f"{k}={v}" for k, v in (config.get("model_args") or {}).items()),
            "settings": settings(config),
            "machine": args.machine or machine(), "commit": commit(),
            "made": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
            "wall_minutes": run["wall_seconds"] / 60, **{k: run[k] for k in (
                "best_test_accuracy", "best_epoch", "final_test_accuracy", "epochs", "wall_seconds",
                "training_seconds", "trained")}}

    if info["arch"] == "hybrid":
        info.update(resnet=(f"units {tuple(cfg.resnet_layers)}, root {cfg.resnet_root!r}, width factor "
                            f"{cfg.resnet_width_factor:g}, {cfg.resnet_groups} GroupNorm groups"),
                    stride=cfg.resnet_stride)
    model.to(dtype=np.float16)
    # first without the file's own accuracy (not known yet), then again with it
    tinyvit.save(model, path, metadata={"dataset": meta["dataset"], "epoch": meta.get("epoch", ""),
                                        "provenance": json.dumps(info)})
    again = tinyvit.load(path)
    dtypes = {str(v.dtype) for v in again.state_dict().values()}
    assert dtypes == {"float16"}, f"{path} holds {dtypes}, not float16"
    dataset = load_data(config["dataset"], args.data_dir, config.get("dataset_args") or {})
    acc16 = test_accuracy(path, dataset)
    best = run["best_test_accuracy"]
    print(f"test accuracy: the run's best {100 * best:.2f}%, the float16 file {100 * acc16:.2f}% "
          f"({100 * (acc16 - best):+.2f} points)")
    if abs(acc16 - best) * 100 > args.tolerance:
        path.unlink()
        raise SystemExit(f"the float16 file's accuracy differs from the run's best by more than {args.tolerance} "
                         "points; nothing written")
    info["float16_test_accuracy"] = acc16
    tinyvit.save(model, path, metadata={"dataset": meta["dataset"], "epoch": meta.get("epoch", ""),
                                        "provenance": json.dumps(info)})
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{path} is {size:,} bytes, over the {MAX_BYTES:,} allowed for a committed file")
    (args.out / "README.md").write_text(readme(args.out))
    print(f"wrote {path} ({size:,} bytes) and {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
