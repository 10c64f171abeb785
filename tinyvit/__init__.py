"""tinyvit: the Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy and CuPy.

    import tinyvit as tv
    from tinyvit import functional as F
    model = tv.models.create("vit-cifar/4")
    loss = F.cross_entropy(model(images), labels); loss.backward()
"""
__version__ = "0.1.0"

import os

# OpenBLAS's idle threads spin for ~0.1 s after each matrix product before they sleep, holding the
# cores that the CPU kernels' element-wise threads (tinyvit/kernels/cpu/threads.py) need between
# products: a vit-cifar/4 training step on 2 cores took 0.57 s with the default, 0.50 s with 4 (2^4
# cycles: sleep at once). OpenBLAS reads the variable when it loads; set here, it takes effect when
# tinyvit is imported before NumPy, and configure_blas_threads (below) applies it at run time when
# NumPy came first, so the import order does not matter. A value already set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from . import functional, models, nn, optim  # noqa: E402  (NumPy loads here, after the setting)
from .autograd import Tensor, no_grad, tensor  # noqa: E402
from .backend import get_array_module, manual_seed  # noqa: E402
from .gradcheck import gradcheck  # noqa: E402
from .io import load, save  # noqa: E402
from .kernels import use_kernels  # noqa: E402
from .kernels.cpu.blas import configure_blas_threads  # noqa: E402
from .nn import Parameter  # noqa: E402

configure_blas_threads()   # "already" when tinyvit came first; restarts OpenBLAS's threads otherwise

__all__ = ["Tensor", "tensor", "no_grad", "Parameter", "nn", "functional", "optim", "models", "gradcheck",
           "load", "save", "use_kernels", "get_array_module", "manual_seed", "__version__"]
