"""tinyvit: the Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy and CuPy.

    import tinyvit as tv
    from tinyvit import functional as F
    model = tv.models.create("vit-cifar/4")
    loss = F.cross_entropy(model(images), labels); loss.backward()
"""
__version__ = "0.1.0"

import os

# OpenBLAS's idle threads spin for ~0.1 s after each matrix product before they sleep, holding the
# cores that the ops' own element-wise threads (tinyvit.ops.common.for_each_block) need between
# products: a vit-cifar/4 training step on 2 cores took 1.37-1.57 s with the default, 1.22-1.26 s
# with 4 (2^4 cycles: sleep at once). OpenBLAS reads it when NumPy loads, so it takes effect only
# when tinyvit is imported before NumPy (the `tinyvit` command); a value already set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from . import functional, models, nn, optim  # noqa: E402  (NumPy loads here, after the setting)
from .autograd import Tensor, no_grad, tensor
from .backend import get_array_module, manual_seed
from .gradcheck import gradcheck
from .io import load, save
from .nn import Parameter

__all__ = ["Tensor", "tensor", "no_grad", "Parameter", "nn", "functional", "optim", "models", "gradcheck",
           "load", "save", "get_array_module", "manual_seed", "__version__"]
