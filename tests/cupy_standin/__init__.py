"""A CPU stand-in for CuPy, so that every ``xp is not np`` branch of tinyvit runs in CI.

The ``xp`` fixture's third backend ("standin"). It is CuPy as tinyvit's code sees it, computed by
NumPy, and as strict as CuPy where code goes wrong between host and device:

- its arrays are a type of their own (``type(a).__module__`` starts with "cupy", so
  backend.is_cupy_array and get_array_module answer as for CuPy), with ``.get()``, ``.device``,
  ``.item()``, ``.tolist()`` and only the methods cupy.ndarray has (array.py);
- they refuse implicit conversion to NumPy with CuPy's TypeError (``np.asarray(a)``), refuse host
  arrays in device operations (``a + host``, ``xp.matmul(a, host)``), and NumPy functions applied to
  them dispatch to the stand-in's, or fail, as CuPy's do (array.py);
- the namespaces hold only the names of the installed ``cupy`` package, and calls are checked
  against its signatures (namespace.py, signatures.py), so a NumPy-only function or keyword
  argument fails here as on a GPU.

``install(monkeypatch)`` makes the stand-in tinyvit's CuPy for one test: ``import cupy`` and
``import cupyx`` answer with it (backend.cupy_module imports and seeds it on first use as it would
the real one, and the CuPy branches of ops import cupyx.scipy.special and cupyx.scatter_add, so
tinyvit needs no test hook), and the switchboard has no CUDA kernel (the stand-in cannot run CUDA
C++: CuPy arrays take the reference ops, as on a GPU where no kernel has passed yet; cupy.cuda has
one device, id 0, and a null stream: device.py). Needs the ``cupy`` package installed (CI has it:
the cuda-compile extra), not a GPU.

Where CuPy's behaviour differs by function, the stand-in is strict by default and lets host arrays
through only where CuPy's source copies them itself (namespace.ACCEPTS_HOST, HOST_PARAMETERS).
Known differences, all rare in tinyvit: out-of-bounds indices raise (CuPy wraps them around);
cupy.sum(host) and a few others that CuPy quietly computes on the host through the host array's
own method are refused; random numbers are NumPy's, not a GPU's.
"""
from __future__ import annotations

import sys


def available() -> bool:
    """True where the installed cupy package (no GPU needed) can give the stand-in its names."""
    try:
        import cupy  # noqa: F401
        import cupyx.scipy.special  # noqa: F401
        return True
    except Exception:              # not installed, or a broken install
        return False


def modules():
    """(the stand-in cupy module, the stand-in cupyx module)."""
    from .namespace import CUPY, CUPYX
    return CUPY, CUPYX


def install(monkeypatch):
    """Make the stand-in tinyvit's CuPy until the test ends (monkeypatch undoes it all)."""
    from tinyvit import backend, kernels

    cupy, cupyx = modules()
    for name, module in [("cupy", cupy), ("cupy.random", cupy.random), ("cupy.cuda", cupy.cuda),
                         ("cupy.linalg", cupy.linalg), ("cupyx", cupyx), ("cupyx.scipy", cupyx.scipy),
                         ("cupyx.scipy.special", cupyx.scipy.special)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(backend, "_cupy", None)           # backend.cupy_module imports it on first use
    monkeypatch.setattr(kernels, "CUDA_KERNELS", {})
    return cupy
