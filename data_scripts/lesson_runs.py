"""What the scripts in data_scripts/ that train for the lessons (make_lesson_model.py, lesson_*.py)
share: how they measure accuracy, and where a stored result came from (the commit and the machine)."""
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

import tinyvit as tv
from tinyvit.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent


def accuracy(model, images, labels, to_input) -> float:
    """Accuracy on uint8 images (N, C, H, W) with integer labels, in eval mode, without building a graph;
    to_input (an Augment) normalises each batch of 500."""
    model.eval()
    with tv.no_grad():
        preds = np.concatenate([model(x).data.argmax(-1) for x, _ in DataLoader(images, labels, 500, transform=to_input)])
    model.train()
    return float((preds == labels).mean())


def commit() -> str:
    """The short hash of HEAD, marked when the code that trains (tinyvit/, data_scripts/) has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "data_scripts", "tinyvit"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """'2-core CPU (AMD EPYC), Linux, Python 3.11.2, NumPy 2.4.6', the CPU's model name from /proc/cpuinfo."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({cpu}), {platform.system()}, Python {platform.python_version()}, NumPy {np.__version__}"
