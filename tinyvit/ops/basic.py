"""Element-wise arithmetic, reductions, shape ops, matmul and linear: the primitives everything else uses.

Each Function keeps forward and backward side by side. Broadcasting is undone by the engine
(autograd._sum_to_shape), so binary ops return gradients in the broadcast shape.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Function, Tensor
from ..backend import get_array_module
from .common import require_float, require_same_dtype, shape_of

# ---------------------------------------------------------------- element-wise arithmetic


class Add(Function):
    """y = a + b (broadcasting).  dL/da = dL/db = gy."""

    def forward(self, a, b):
        return a + b

    def backward(self, gy):
        return gy, gy


class Sub(Function):
    """y = a - b.  dL/da = gy, dL/db = -gy."""

    def forward(self, a, b):
        return a - b

    def backward(self, gy):
        return gy, (-gy if self.needs_input_grad[1] else None)


class Mul(Function):
    """y = a * b.  dL/da = gy * b, dL/db = gy * a."""

    def forward(self, a, b):
        self.save(a, b)
        return a * b

    def backward(self, gy):
        a, b = self.saved
        return (gy * b if self.needs_input_grad[0] else None,
                gy * a if self.needs_input_grad[1] else None)


class Div(Function):
    """y = a / b.  dL/da = gy / b, dL/db = -gy * a / b^2."""

    def forward(self, a, b):
        self.save(a, b)
        return a / b

    def backward(self, gy):
        a, b = self.saved
        ga = gy / b if self.needs_input_grad[0] else None
        gb = -gy * a / (b * b) if self.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    """y = -x."""

    def forward(self, x):
        return -x

    def backward(self, gy):
        return -gy


class Pow(Function):
    """y = x ** p for a constant exponent p.  dL/dx = gy * p * x^(p-1)."""

    def forward(self, x, p):
        self.save(x, p)
        return x ** p

    def backward(self, gy):
        x, p = self.saved
        return gy * (p * x ** (p - 1))


class Exp(Function):
    """y = exp(x).  dL/dx = gy * y."""

    def forward(self, x):
        y = get_array_module(x).exp(x)
        self.save(y)
        return y

    def backward(self, gy):
        (y,) = self.saved
        return gy * y


class Log(Function):
    """y = log(x).  dL/dx = gy / x."""

    def forward(self, x):
        self.save(x)
        return get_array_module(x).log(x)

    def backward(self, gy):
        (x,) = self.saved
        return gy / x


class Sqrt(Function):
    """y = sqrt(x).  dL/dx = gy / (2 y)."""

    def forward(self, x):
        y = get_array_module(x).sqrt(x)
        self.save(y)
        return y

    def backward(self, gy):
        (y,) = self.saved
        return gy / (2 * y)


class Tanh(Function):
    """y = tanh(x).  dL/dx = gy * (1 - y^2)."""

    def forward(self, x):
        y = get_array_module(x).tanh(x)
        self.save(y)
        return y

    def backward(self, gy):
        (y,) = self.saved
        return gy * (1 - y * y)


class ReLU(Function):
    """y = max(x, 0).  dL/dx = gy * [x > 0]."""

    def forward(self, x):
        mask = x > 0
        self.save(mask)
        return x * mask

    def backward(self, gy):
        (mask,) = self.saved
        return gy * mask


class Cast(Function):
    """y = x converted to another floating dtype; the gradient is converted back."""

    def forward(self, x, dtype):
        self.save(x.dtype)
        return x.astype(dtype)

    def backward(self, gy):
        (dtype,) = self.saved
        return gy.astype(dtype)


# ---------------------------------------------------------------- reductions


def _normalize_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axes))


def _expand_reduced(gy, axes, keepdims):
    """Give a reduced gradient back its reduced axes (size 1) so it broadcasts against the input."""
    if keepdims:
        return gy
    xp = get_array_module(gy)
    return xp.expand_dims(gy, axes) if axes else gy


class Sum(Function):
    """y = sum of x over ``axis`` (None: all).  dL/dx = gy broadcast back to x's shape."""

    def forward(self, x, axis=None, keepdims=False):
        axes = _normalize_axes(axis, x.ndim)
        self.save(x.shape, axes, keepdims)
        return x.sum(axis=axes, keepdims=keepdims)

    def backward(self, gy):
        shape, axes, keepdims = self.saved
        xp = get_array_module(gy)
        return xp.broadcast_to(_expand_reduced(gy, axes, keepdims), shape)


class Mean(Function):
    """y = mean of x over ``axis``.  dL/dx = gy / n broadcast back (n = number of averaged elements)."""

    def forward(self, x, axis=None, keepdims=False):
        axes = _normalize_axes(axis, x.ndim)
        n = int(np.prod([x.shape[a] for a in axes])) if axes else 1
        self.save(x.shape, axes, keepdims, n)
        return x.mean(axis=axes, keepdims=keepdims)

    def backward(self, gy):
        shape, axes, keepdims, n = self.saved
        xp = get_array_module(gy)
        return xp.broadcast_to(_expand_reduced(gy, axes, keepdims) / n, shape)


class Max(Function):
    """y = max of x over ``axis``.  dL/dx = gy at the arg-max (shared equally between ties)."""

    def forward(self, x, axis=None, keepdims=False):
        axes = _normalize_axes(axis, x.ndim)
        y = x.max(axis=axes, keepdims=True)
        mask = x == y
        self.save(mask, axes, keepdims)
        return y if keepdims else y.reshape([n for i, n in enumerate(y.shape) if i not in axes])

    def backward(self, gy):
        mask, axes, keepdims = self.saved
        gy = _expand_reduced(gy, axes, keepdims)
        ties = mask.sum(axis=axes, keepdims=True).astype(gy.dtype)
        return mask * (gy / ties)


# ---------------------------------------------------------------- shape ops


class Reshape(Function):
    """y = x viewed with another shape.  dL/dx = gy reshaped back."""

    def forward(self, x, shape):
        self.save(x.shape)
        return x.reshape(shape)

    def backward(self, gy):
        (shape,) = self.saved
        return gy.reshape(shape)


class Transpose(Function):
    """y = x with axes permuted (None: reversed).  dL/dx = gy with the inverse permutation."""

    def forward(self, x, axes=None):
        axes = tuple(reversed(range(x.ndim))) if axes is None else tuple(a % x.ndim for a in axes)
        self.save(axes)
        return x.transpose(axes)

    def backward(self, gy):
        (axes,) = self.saved
        return gy.transpose(tuple(np.argsort(axes)))


def _has_advanced_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in items)


class GetItem(Function):
    """y = x[index] (slices, integers, integer arrays).  dL/dx = zeros with gy scattered back,
    added (not assigned) where an integer array repeats an index."""

    def forward(self, x, index):
        self.save(x.shape, x.dtype, index)
        return x[index]

    def backward(self, gy):
        shape, dtype, index = self.saved
        xp = get_array_module(gy)
        gx = xp.zeros(shape, dtype=dtype)
        if _has_advanced_index(index):
            if xp is np:
                np.add.at(gx, index, gy)
            else:
                import cupyx
                cupyx.scatter_add(gx, index, gy)
        else:
            gx[index] = gy
        return gx


class Concat(Function):
    """y = concatenation of the inputs along ``axis``.  Each input gets its slice of gy."""

    def forward(self, *xs, axis=0):
        xp = get_array_module(*xs)
        axis = axis % xs[0].ndim
        self.save(axis, np.cumsum([x.shape[axis] for x in xs])[:-1])
        return xp.concatenate(xs, axis=axis)

    def backward(self, gy):
        axis, splits = self.saved
        return tuple(get_array_module(gy).split(gy, splits, axis=axis))


class Where(Function):
    """y = a where cond else b (cond is a boolean array, not differentiable)."""

    def forward(self, cond, a, b):
        xp = get_array_module(a, b)
        self.save(cond)
        return xp.where(cond, a, b)

    def backward(self, gy):
        (cond,) = self.saved
        return None, gy * cond, gy * ~cond


# ---------------------------------------------------------------- matmul and linear


def _swap(m):
    return m.swapaxes(-1, -2)


class MatMul(Function):
    """y = a @ b (batched, broadcasting; 1-D operands as in NumPy).

    dL/da = gy @ b^T,  dL/db = a^T @ gy  (the engine sums over broadcast batch axes).
    """

    def forward(self, a, b):
        self.save(a, b)
        return a @ b

    def backward(self, gy):
        a, b = self.saved
        # Treat 1-D operands as a row (a) or a column (b), as matmul does, then squeeze back.
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        gy2 = gy
        if b.ndim == 1:
            gy2 = gy2[..., None]
        if a.ndim == 1:
            gy2 = gy2[..., None, :]
        ga = gy2 @ _swap(b2) if self.needs_input_grad[0] else None
        gb = _swap(a2) @ gy2 if self.needs_input_grad[1] else None
        if ga is not None and a.ndim == 1:
            ga = ga.reshape(-1, a.shape[0]).sum(axis=0)
        if gb is not None and b.ndim == 1:
            gb = gb.reshape(-1, b.shape[0]).sum(axis=0)
        return ga, gb


class Linear(Function):
    """y = x W + b, the paper's x_p E (Eq. 1) and every dense layer of Eq. 2-4.

    x: (..., D_in)  W: (D_in, D_out)  b: (D_out,) or None  ->  y: (..., D_out)
    Runs as one 2-D GEMM over all rows (B*N, D_in). Backward:
      dL/dx = gy W^T,  dL/dW = x^T gy,  dL/db = sum of gy over rows.
    """

    def forward(self, x, w, b=None):
        rows = x.reshape(-1, x.shape[-1])                 # (R, D_in), R = B*N
        y = rows @ w
        if b is not None:
            y = y + b
        self.save(rows, w, x.shape)
        return y.reshape(*x.shape[:-1], w.shape[1])

    def backward(self, gy):
        rows, w, x_shape = self.saved
        g = gy.reshape(-1, gy.shape[-1])                  # (R, D_out)
        gx = (g @ w.T).reshape(x_shape) if self.needs_input_grad[0] else None
        gw = rows.T @ g if self.needs_input_grad[1] else None
        gb = g.sum(axis=0) if len(self.needs_input_grad) > 2 and self.needs_input_grad[2] else None
        return gx, gw, gb


# ---------------------------------------------------------------- the functions users call


def add(a, b):
    return Add.apply(a, b)


def sub(a, b):
    return Sub.apply(a, b)


def mul(a, b):
    return Mul.apply(a, b)


def div(a, b):
    return Div.apply(a, b)


def neg(x):
    return Neg.apply(x)


def pow(x, exponent):
    """x ** exponent for a constant (Python number) exponent."""
    if isinstance(exponent, Tensor):
        raise TypeError("pow: the exponent must be a constant number, not a Tensor")
    return Pow.apply(x, exponent)


def exp(x):
    return Exp.apply(x)


def log(x):
    return Log.apply(x)


def sqrt(x):
    return Sqrt.apply(x)


def tanh(x):
    return Tanh.apply(x)


def relu(x):
    return ReLU.apply(x)


def cast(x, dtype):
    """x converted to ``dtype`` (differentiable)."""
    return Cast.apply(x, np.dtype(dtype))


def sum(x, axis=None, keepdims=False):  # noqa: A001 - mirrors numpy's name
    return Sum.apply(x, axis, keepdims)


def mean(x, axis=None, keepdims=False):
    return Mean.apply(x, axis, keepdims)


def max(x, axis=None, keepdims=False):  # noqa: A001
    return Max.apply(x, axis, keepdims)


def reshape(x, shape):
    return Reshape.apply(x, tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(x, axes=None):
    return Transpose.apply(x, None if axes is None else tuple(axes))


def permute(x, axes):
    return Transpose.apply(x, tuple(axes))


def getitem(x, index):
    """x[index]; Tensors inside the index are used as integer arrays."""
    if isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    elif isinstance(index, Tensor):
        index = index.data
    if isinstance(index, list):
        index = np.asarray(index)
    return GetItem.apply(x, index)


def concat(tensors, axis=0):
    """Concatenate a sequence of Tensors/arrays along ``axis``."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("concat: needs at least one tensor")
    return Concat.apply(*tensors, axis=axis)


def where(cond, a, b):
    """Element-wise a where cond else b; cond is a boolean array (or Tensor)."""
    cond = cond.data if isinstance(cond, Tensor) else cond
    return Where.apply(cond, a, b)


def matmul(a, b):
    """Batched, broadcasting a @ b. Raises a ValueError naming both shapes if they do not fit."""
    require_float("matmul", a=a, b=b)
    sa, sb = shape_of(a), shape_of(b)
    if not sa or not sb:
        raise ValueError(f"matmul: operands must have at least one axis, got shapes {sa} and {sb}")
    k_b = sb[0] if len(sb) == 1 else sb[-2]
    if sa[-1] != k_b:
        raise ValueError(f"matmul: shapes {sa} and {sb} do not fit ({sa[-1]} != {k_b})")
    return MatMul.apply(a, b)


def linear(x, w, b=None, function=None):
    """y = x @ w + b with w of shape (in_features, out_features), as the paper's x E.
    function: the Function that computes it, this reference unless tinyvit.functional passes a kernel."""
    require_float("linear", x=x, weight=w, bias=b)
    require_same_dtype("linear", x=x, weight=w, bias=b)
    sx, sw = shape_of(x), shape_of(w)
    if len(sw) != 2 or not sx or sx[-1] != sw[0]:
        raise ValueError(f"linear: input of shape {sx} does not fit weight of shape {sw} "
                         f"(weight is (in_features, out_features); need input[..., {sw[0] if sw else '?'}])")
    if b is not None and shape_of(b) != (sw[1],):
        raise ValueError(f"linear: bias has shape {shape_of(b)}, expected ({sw[1]},) for weight {sw}")
    return (function or Linear).apply(x, w, b)
