"""tinyvit: the Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy and CuPy.

    import tinyvit as tv
    from tinyvit import functional as F
    model = tv.models.create("vit-cifar/4")
    loss = F.cross_entropy(model(images), labels); loss.backward()
"""
__version__ = "0.1.0"

from . import functional, models, nn, optim
from .autograd import Tensor, no_grad, tensor
from .backend import get_array_module, manual_seed
from .gradcheck import gradcheck
from .io import load, save
from .kernels import use_kernels
from .nn import Parameter

__all__ = ["Tensor", "tensor", "no_grad", "Parameter", "nn", "functional", "optim", "models", "gradcheck",
           "load", "save", "use_kernels", "get_array_module", "manual_seed", "__version__"]
