"""The one place that knows about NumPy versus CuPy.

Every op starts with ``xp = get_array_module(x)`` and then writes ``xp.exp``, ``xp.matmul``, ...:
the same line runs on the CPU (NumPy) and on an NVIDIA GPU (CuPy). CuPy is imported lazily, only
when a GPU is asked for, so the CPU install needs nothing but NumPy.
"""
from __future__ import annotations

import contextlib

import numpy as np

_cupy = None                      # the cupy module once imported, False if it is not installed
_default_dtype = np.float32       # float32 by default; gradient checks switch to float64


class DeviceUnavailable(RuntimeError):
    """A device that cannot be used here: CuPy missing, no CUDA driver or GPU, no GPU of that number.
    The message names the device asked for and the way out (tinyvit's CLI prints it as one line)."""


def cupy_module():
    """Import CuPy on first use; raise a clear error naming the `gpu` extra when it is missing."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
            if _seed is not None:
                cupy.random.seed(_seed)
            _cupy = cupy
        except Exception as exc:  # ImportError, or a CUDA driver error raised at import or seeding
            _cupy = False
            _import_error[0] = exc
    if _cupy is False:
        if _import_error[0] is not None and not isinstance(_import_error[0], ImportError):   # CuPy there, CUDA not
            raise DeviceUnavailable(f"device 'cuda': CuPy is installed but finds no usable CUDA GPU "
                                    f"({_import_error[0]}); use --device cpu, or run where a GPU and its driver are")
        raise DeviceUnavailable(
            "device 'cuda' needs CuPy, which is not available "
            f"({_import_error[0]!r}). Install it with: pip install 'tinyvit[gpu]' "
            "(or pip install cupy-cuda12x / cupy-cuda13x matching your CUDA driver), or use --device cpu")
    return _cupy


_import_error = [None]


def is_cupy_array(x) -> bool:
    """True for a cupy.ndarray, checked without importing CuPy."""
    return type(x).__module__.startswith("cupy")


def get_array_module(*arrays):
    """numpy or cupy: the module that owns the given arrays (numpy for scalars and lists)."""
    for a in arrays:
        a = getattr(a, "data", a) if hasattr(a, "requires_grad") else a   # a Tensor: look at its array
        if is_cupy_array(a):
            return cupy_module()
        refuse_torch(a)
    return np


def refuse_torch(x) -> None:
    """A torch.Tensor where an array belongs (a PyTorch habit): one TypeError saying what to pass."""
    if type(x).__module__ == "torch":
        raise TypeError("got a torch.Tensor: tinyvit computes on NumPy arrays (CuPy on a GPU), so pass x.numpy() "
                        "(x.detach().cpu().numpy() for a tensor that needs a gradient or lives on a GPU)")


def device_of(array) -> str:
    """'cpu' for NumPy arrays (and scalars), 'cuda:N' for CuPy arrays."""
    if is_cupy_array(array):
        return f"cuda:{array.device.id}"
    return "cpu"


def normalize_device(device) -> str:
    """'cpu', 'cuda' or 'cuda:N' -> 'cpu' or 'cuda:N'. Anything else is a ValueError; a GPU that
    cannot be used here (no CuPy, no driver or GPU, no GPU N) a DeviceUnavailable saying why."""
    device = str(device).lower()
    if device == "cpu":
        return "cpu"
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    cp = cupy_module()
    try:
        count = cp.cuda.runtime.getDeviceCount()
        index = cp.cuda.Device().id if device == "cuda" else int(device[5:])
    except Exception as exc:           # CUDARuntimeError: no driver, a driver too old for this CuPy, ...
        _no_gpu(exc)
        raise DeviceUnavailable(f"device {device!r}: CuPy is installed but finds no usable CUDA GPU ({exc}); "
                                "use --device cpu, or run where a GPU and its driver are") from None
    if not count:
        _no_gpu(RuntimeError("no CUDA GPU"))
    if index >= count:
        which = "none" if not count else f"cuda:0 to cuda:{count - 1}"
        raise DeviceUnavailable(f"device {device!r}: this machine has {count} CUDA GPU(s), {which}; use one of them "
                                "or --device cpu")
    return f"cuda:{index}"


def _no_gpu(exc) -> None:
    """CuPy imported but cannot reach a GPU: treat it as absent from now on, so that seeding (and
    anything else that asks cupy_module) leaves CUDA alone in this process."""
    global _cupy
    _cupy, _import_error[0] = False, exc


def to_device(array, device):
    """Copy ``array`` to ``device`` ('cpu', 'cuda', 'cuda:N'); returns it unchanged if already there."""
    device = normalize_device(device)
    if device == device_of(array):
        return array
    if device == "cpu":
        return array.get()
    cp = cupy_module()
    with cp.cuda.Device(int(device.split(":")[1])):
        return cp.asarray(array)


def to_numpy(array) -> np.ndarray:
    """A host (NumPy) copy or view of any array."""
    return array.get() if is_cupy_array(array) else np.asarray(array)


def get_default_dtype():
    """The floating dtype new tensors and parameters get (float32 unless changed)."""
    return _default_dtype


def set_default_dtype(dtype) -> None:
    """Switch the default floating dtype (float32 or float64)."""
    global _default_dtype
    dtype = np.dtype(dtype).type
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"default dtype must be float32 or float64, got {np.dtype(dtype).name}")
    _default_dtype = dtype


class default_dtype:
    """Context manager: ``with default_dtype(np.float64): ...`` (used by gradient checks)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.previous = get_default_dtype()
        set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        set_default_dtype(self.previous)


def check_same_device(arrays, op_name: str) -> None:
    """Raise if the arrays of one op live on different devices, naming both devices."""
    first = None
    for a in arrays:
        if a is None or np.isscalar(a):
            continue
        d = device_of(a)
        if first is None:
            first = d
        elif d != first:
            raise RuntimeError(f"{op_name}: inputs are on different devices ({first} and {d}); "
                               "move them with .to(device) first")


_rng = np.random.default_rng(0)


_seed = None                      # the last manual_seed, for CuPy's generator when CuPy comes into use


def manual_seed(seed: int) -> None:
    """Seed tinyvit's random generator (parameter init, dropout masks) and, once tinyvit uses CuPy,
    CuPy's: now if it is in use, else when it first is (cupy_module). A CPU run never touches CUDA,
    even where CuPy is installed or imported by someone else without a usable GPU."""
    global _rng, _seed
    _rng = np.random.default_rng(seed)
    _seed = seed
    if _cupy:
        _cupy.random.seed(seed)


def rng() -> np.random.Generator:
    """The global NumPy generator used for initialisation and dropout masks."""
    return _rng


def random_uniform(xp, shape, dtype):
    """Uniform [0, 1) samples on xp's device, from the seeded generator (CuPy draws on the GPU)."""
    if xp is np:
        return _rng.random(shape, dtype=np.float32 if dtype == np.float32 else np.float64)
    return xp.random.random(shape, dtype=dtype)


PRECISIONS = ("fp32", "tf32")


@contextlib.contextmanager
def matmul_precision(precision: str):
    """Inside the block, CuPy's float32 matrix products run in ``precision``: "fp32" (full float32,
    CuPy's default) or "tf32" (TensorFloat-32 tensor cores of NVIDIA GPUs from Ampere on: products of
    10-bit-mantissa inputs summed in float32, several times the float32 rate). The setting before the
    block comes back after it. NumPy has no TF32: on the CPU only "fp32" is allowed (and changes
    nothing), and nothing here touches CUDA then. bf16 is not offered yet: CuPy (14) has no bfloat16
    dtype, and its COMPUTE_TYPE_BF16 leaves float32 products in full float32 (its cuBLAS call maps it
    to CUBLAS_COMPUTE_32F), so bf16 needs cuBLAS called directly, which only a GPU can check."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32" and _cupy is None:        # CuPy not in use: nothing to set, nothing to undo
        yield
        return
    from cupy._core import _routines_linalg as linalg
    previous = linalg.get_compute_type(np.float32)
    wanted = getattr(linalg, "COMPUTE_TYPE_TF32" if precision == "tf32" else "COMPUTE_TYPE_DEFAULT")
    linalg.set_compute_type(np.float32, wanted)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, previous)
