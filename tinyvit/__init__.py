"""tinyvit: the Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy and CuPy."""
__version__ = "0.1.0"

from . import functional
from .autograd import Tensor, no_grad, tensor
from .backend import get_array_module, manual_seed
from .gradcheck import gradcheck

__all__ = ["Tensor", "tensor", "no_grad", "functional", "gradcheck", "get_array_module", "manual_seed",
           "__version__"]
