"""Execute lesson notebooks top to bottom at their full sizes and save them with the new outputs, as
they are committed (tests/test_lessons.py runs them in small mode and checks the exercises; this
refreshes what a reader sees).

    python tools/run_lesson.py lessons/07_the_vit_model.ipynb [more.ipynb ...] [--timeout 1200]

Each notebook runs in a fresh kernel of this interpreter with PYTHONHASHSEED=0 (figures inline),
from the lessons folder; the file is replaced only when every cell ran. The run's wall time, date and
machine go into the notebook's metadata ("tinyvit": {"ran_in_s": ...}), where tests/test_lessons.py
checks that every lesson, as committed, ran in under two minutes.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

KERNEL = "tinyvit-lessons-full"
ENV = {"PYTHONHASHSEED": "0"}                  # figures inline, as a reader sees them


def run(path: Path, timeout: int) -> float:
    """Execute ``path`` in place; the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / KERNEL
        spec.mkdir()
        env = {**ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "tinyvit lessons (full)", "language": "python", "env": env}))
        km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[tmp]))
        client = nbclient.NotebookClient(nb, km=km, timeout=timeout, startup_timeout=120, record_timing=False,
                                         resources={"metadata": {"path": str(path.parent)}})
        start = time.perf_counter()
        client.execute()
        seconds = time.perf_counter() - start
    nb.metadata["tinyvit"] = {
        "ran_in_s": round(seconds, 1), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, {platform.system()}",
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default")}
    nbformat.write(nb, path)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell (default 1200)")
    args = parser.parse_args()
    for path in args.notebooks:
        print(f"{path}: ran in {run(path, args.timeout):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
