"""The PyTorch side of `tinyvit bench --compare torch`: the reference ViT (torch_vit.TorchViT) in
PyTorch eager, with tinyvit's weights, batch, optimizer settings and thread count, timed the same way.

Imported only when a comparison is asked for, after step.passive_torch_threads has had its chance
to set PyTorch's OpenMP policy: PyTorch is not a dependency of tinyvit (``pip install
'tinyvit[reference]'``).
"""
from __future__ import annotations

import contextlib

from .torch_vit import TorchViT, load_tinyvit_weights  # first: it says what to install without PyTorch

import torch  # noqa: E402
from torch.nn import functional as TF  # noqa: E402


@contextlib.contextmanager
def torch_settings(threads: int, tf32: bool):
    """PyTorch on ``threads`` CPU threads and with TF32 matmuls/convolutions on or off inside the
    block (the settings tinyvit's side runs with), restored after."""
    saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


def torch_step(weights, images, labels, *, device="cpu", dtype="float32", seed=0, attention="explicit", lr=1e-3,
               weight_decay=0.05):
    """Build PyTorch's side from the tinyvit ViT ``weights`` and return (step, sync, losses, info):
    step() is forward, F.cross_entropy, backward, torch.optim.AdamW (its default implementation)."""
    if type(weights).__name__ != "ViT":
        raise ValueError(f"--compare torch supports the plain ViT variants, not {type(weights).__name__}")
    on_gpu = device != "cpu"
    tdevice = torch.device("cuda", int(device.split(":")[1])) if on_gpu else torch.device("cpu")
    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    torch.manual_seed(seed)
    model = TorchViT.from_config(weights.config, attention=attention)
    load_tinyvit_weights(model, weights)
    model = model.to(device=tdevice, dtype=tdtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    x, y = torch.from_numpy(images).to(tdevice), torch.from_numpy(labels).to(tdevice)
    losses = []

    def step():
        loss = TF.cross_entropy(model(x), y)              # forward and loss
        opt.zero_grad()
        loss.backward()                                     # backward
        opt.step()                                          # AdamW update
        losses.append(loss.detach())

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    info = {"torch_version": torch.__version__, "attention": attention, "torch_threads": torch.get_num_threads()}
    return step, sync, losses, info


class PeakTorchCuda:
    """torch.cuda.max_memory_reserved() over a ``with`` block (the caching allocator's high-water mark),
    over what it held at the start. (Written for CUDA; not exercised on a CPU-only machine.)"""
    method = "torch-max-reserved"

    def __init__(self, device: str):
        self.device = torch.device("cuda", int(device.split(":")[1]))

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_reserved(self.device)
        return self

    def __exit__(self, *exc):
        self.bytes = max(0, torch.cuda.max_memory_reserved(self.device) - self.start)
        return False
