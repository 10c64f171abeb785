"""Write a small folder of PNG images in the layout `tinyvit train/finetune --dataset DIR` reads,
from Fashion-MNIST's test images (which the lesson model never trained on), grouped into coarser
classes than Fashion-MNIST's ten: a new task for fine-tuning, runnable offline.

    python data_scripts/fashion_mnist_folder.py --out clothes --per-class 40
    -> clothes/bags/0.png ... clothes/dresses/ clothes/shoes/ clothes/tops/ clothes/trousers/

Fashion-MNIST comes from --root (a data folder) or Debian's package (apt-get install dataset-fashion-mnist).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

from tinyvit.data import DataError, load_dataset

# coarse class -> Fashion-MNIST labels (0 T-shirt/top, 1 Trouser, 2 Pullover, 3 Dress, 4 Coat, 5 Sandal,
# 6 Shirt, 7 Sneaker, 8 Bag, 9 Ankle boot)
GROUPS = {"tops": (0, 2, 4, 6), "trousers": (1,), "dresses": (3,), "shoes": (5, 7, 9), "bags": (8,)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder to write (one sub-folder per class)")
    parser.add_argument("--per-class", type=int, default=40, help="images per class (default 40)")
    parser.add_argument("--root", default=None, help="where Fashion-MNIST is, as --data-dir (default: the usual places)")
    parser.add_argument("--seed", type=int, default=0, help="which test images are drawn (default 0)")
    args = parser.parse_args(argv)
    from PIL import Image
    try:
        ds = load_dataset("fashion-mnist", root=args.root)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(args.seed)
    for name, labels in GROUPS.items():
        folder = Path(args.out) / name
        folder.mkdir(parents=True, exist_ok=True)
        pool = np.flatnonzero(np.isin(ds.test_labels, labels))
        for i, index in enumerate(rng.choice(pool, size=min(args.per_class, len(pool)), replace=False)):
            Image.fromarray(ds.test_images[index, 0]).save(folder / f"{i}.png")
    print(f"wrote {args.per_class} images for each of {', '.join(GROUPS)} into {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
