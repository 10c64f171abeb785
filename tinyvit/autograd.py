"""Reverse-mode automatic differentiation: Tensor, Function, backward, no_grad.

A ``Tensor`` wraps a NumPy/CuPy array (``.data``) and, after ``backward()``, holds the gradient of a
scalar loss with respect to it (``.grad``, an array of the same shape). Every differentiable operation
is a ``Function`` subclass with a ``forward`` and a ``backward`` written by hand on raw arrays; calling
``SomeFunction.apply(...)`` runs the forward and, when gradients are wanted, records the Function as
the creator (``_ctx``) of its outputs. ``Tensor.backward`` walks that graph once in reverse
topological order (iteratively: a 100,000-op chain is fine) applying the chain rule

    dL/d(input) = backward(dL/d(output))

and accumulating with ``+`` where a tensor feeds several ops (the multivariate chain rule).
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import numpy as np

from . import backend
from .backend import get_array_module

_grad_enabled = True


class no_grad(contextlib.ContextDecorator):
    """Context manager (and decorator) that turns graph recording off, as for evaluation."""

    def __enter__(self):
        global _grad_enabled
        self.previous = _grad_enabled
        _grad_enabled = False

    def __exit__(self, *exc):
        global _grad_enabled
        _grad_enabled = self.previous
        return False


def is_array(x) -> bool:
    return isinstance(x, np.ndarray) or backend.is_cupy_array(x)


class Function:
    """One differentiable operation, forward and backward on raw arrays.

    Subclasses implement:
      forward(*args, **kwargs) -> array, or a tuple of arrays (several outputs)
      backward(*grad_outputs)  -> one gradient per positional argument of forward, in order
                                  (a single array when forward has one argument). Arguments that
                                  are not tensors (axis, eps, ...) get None, and trailing ones may
                                  be left out. A multi-output op gets None for outputs that
                                  received no gradient.
    ``self.save(a, b, ...)`` keeps exactly what backward needs (``self.saved``); the engine frees
    it after backward. Saved arrays are references, not copies: changing a parameter in place
    between forward and backward gives a wrong gradient (there is no version counter).
    ``self.needs_input_grad[i]`` says whether argument i wants a gradient; it is set *before*
    forward runs (all False when nothing is recorded), so forward can skip saving what backward
    will not use and backward can skip work (e.g. no gradient for input images).
    Only positional arguments are tracked: pass Tensors positionally, options as keywords.

    float16: float16 holds no number above 65504, and a square (a variance's, erf's), a sum of
    exponentials or an attention score of ordinary activations can exceed it, giving inf or NaN
    where float32 gives a number. A Function that computes one declares ``float16_in_float32 =
    True``; when its floating arguments are all float16, ``apply`` hands forward float32 copies and
    rounds the outputs back to float16, and the engine hands backward float32 gradients and rounds
    the ones it returns back to float16 (``self.widened`` says it happened). So the op is written
    once, as plain math in whatever dtype it gets, and float16 is handled here alone.
    """

    float16_in_float32 = False

    def __init__(self):
        self.saved = ()
        self.needs_input_grad = ()
        self.widened = False

    def save(self, *values) -> None:
        self.saved = values

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def backward(self, *grad_outputs):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        """Run forward on the arrays inside ``args`` and record the graph when a gradient is wanted."""
        fn = cls()
        raw = [a.data if isinstance(a, Tensor) else a for a in args]
        backend.check_same_device([r for r in raw if is_array(r)], cls.__name__)
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        record = _grad_enabled and any(needs)
        fn.needs_input_grad = needs if record else (False,) * len(args)
        fn.widened = cls.float16_in_float32 and _all_float16(raw)
        if fn.widened:
            raw = _recast(raw, _FLOAT16, _FLOAT32)
        out = fn.forward(*raw, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(o if is_array(o) else np.asarray(o) for o in outs)  # a full reduction gives a scalar
        if fn.widened:
            outs = _recast(outs, _FLOAT32, _FLOAT16)
        results = tuple(Tensor._wrap(o, record) for o in outs)
        if record:
            fn.inputs = tuple(a if isinstance(a, Tensor) else None for a in args)
            fn.outputs = tuple(weakref.ref(r) for r in results)
            for i, r in enumerate(results):
                r._ctx, r._out_index = fn, i
        else:
            fn.saved = ()  # nothing will call backward: let the saved arrays go now
        return results if isinstance(out, tuple) else results[0]


_FLOAT16, _FLOAT32 = np.dtype(np.float16), np.dtype(np.float32)


def _all_float16(arrays) -> bool:
    """Whether the floating arrays among ``arrays`` are all float16 (and there is one)."""
    return {a.dtype for a in arrays if is_array(a) and a.dtype.kind == "f"} == {_FLOAT16}


def _recast(values, old, new):
    """values (a sequence) with each array of dtype ``old`` converted to ``new``, the rest as they are."""
    return tuple(v.astype(new) if is_array(v) and v.dtype == old else v for v in values)


def _sum_to_shape(g, shape):
    """Undo broadcasting: sum ``g`` over the axes that broadcasting added or stretched from 1."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    g = g.sum(axis=axes, keepdims=True)
    if lead:
        g = g.reshape(g.shape[lead:])
    if g.shape != tuple(shape):
        raise RuntimeError(f"gradient of shape {g.shape} cannot be reduced to input shape {tuple(shape)}")
    return g


def _accumulate(existing, g):
    # Out of place on purpose: a gradient array may be shared (add passes gy to both inputs).
    return g if existing is None else existing + g


class Tensor:
    """An array with an optional gradient. ``data``: the NumPy/CuPy array; ``grad``: same shape.

    Float data made from Python numbers or lists gets the default dtype (float32); NumPy/CuPy
    arrays keep theirs. Only floating tensors can require a gradient.
    """

    __array_priority__ = 1000  # ndarray + Tensor -> Tensor.__radd__, not an element-wise loop

    def __init__(self, data, requires_grad: bool = False, dtype=None, device=None):
        if isinstance(data, Tensor):
            data = data.data
        if not is_array(data):
            backend.refuse_torch(data)
            data = np.asarray(data)
            if data.dtype.kind == "f" and dtype is None:
                data = data.astype(backend.get_default_dtype())
        if dtype is not None and data.dtype != np.dtype(dtype):
            data = data.astype(dtype)
        if device is not None:
            data = backend.to_device(data, device)
        if requires_grad and data.dtype.kind != "f":
            raise TypeError(f"only floating-point tensors can require a gradient; got dtype {data.dtype}"
                            " (convert with .astype(np.float32) first)")
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx = None          # the Function that made this tensor (None for leaves)
        self._out_index = 0       # which output of _ctx this is
        self._retain = False      # keep .grad on a non-leaf (retain_grad)

    @classmethod
    def _wrap(cls, array, requires_grad):
        """Fast constructor for op outputs (no conversion, no checks)."""
        t = cls.__new__(cls)
        t.data, t.grad, t.requires_grad = array, None, requires_grad
        t._ctx, t._out_index, t._retain = None, 0, False
        return t

    # ----- array facts -----
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: backend.device_of(self.data))
    is_leaf = property(lambda self: self._ctx is None)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        dev = "" if self.device == "cpu" else f", device='{self.device}'"
        return f"Tensor({backend.to_numpy(self.data)!r}{dev}{grad})"

    def numpy(self) -> np.ndarray:
        """A host copy of the data as a NumPy array."""
        return np.array(backend.to_numpy(self.data), copy=True)

    def item(self) -> float:
        """The single value of a one-element tensor as a Python number (synchronises a GPU)."""
        return self.data.item()

    def detach(self) -> "Tensor":
        """The same data, cut from the graph (no gradient flows back through it)."""
        return Tensor._wrap(self.data, False)

    def retain_grad(self) -> "Tensor":
        """Keep ``.grad`` on this non-leaf tensor after backward (leaves always keep theirs)."""
        self._retain = True
        return self

    def requires_grad_(self, flag: bool = True) -> "Tensor":
        if flag and self.dtype.kind != "f":
            raise TypeError(f"only floating-point tensors can require a gradient; got dtype {self.dtype}")
        self.requires_grad = flag
        return self

    def to(self, device=None, dtype=None) -> "Tensor":
        """A copy on another device and/or dtype (this tensor itself if nothing changes).

        A leaf keeps requires_grad; a non-leaf is differentiable through the move."""
        data = self.data
        if dtype is not None and data.dtype != np.dtype(dtype):
            if self._ctx is not None and self.requires_grad:
                from .ops.basic import cast
                return cast(self, dtype).to(device)
            data = data.astype(dtype)
        if device is not None:
            data = backend.to_device(data, device)
        if data is self.data:
            return self
        return Tensor(data, requires_grad=self.requires_grad)

    # ----- the backward pass -----
    def backward(self, grad=None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) * grad into every leaf's ``.grad``.

        grad: same shape as self; may be omitted only for a one-element tensor (then 1).
        retain_graph: keep saved arrays so that backward can run through this graph again.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require a gradient "
                               "(no input had requires_grad=True, or it was made under no_grad)")
        xp = get_array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a one-element tensor; this one has "
                                   f"shape {self.shape}: pass grad= with that shape")
            grad = xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad, dtype=self.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"backward(): grad has shape {grad.shape} but the tensor has shape {self.shape}")
        if self._ctx is None:
            self.grad = _accumulate(self.grad, grad)
            return

        # Reverse topological order of the Functions reachable from self (iterative DFS, post-order).
        order, visited, stack = [], set(), [(self._ctx, False)]
        while stack:
            fn, expanded = stack.pop()
            if expanded:
                order.append(fn)
                continue
            if id(fn) in visited:
                continue
            visited.add(id(fn))
            stack.append((fn, True))
            for t in fn.inputs:
                if t is not None and t._ctx is not None and id(t._ctx) not in visited:
                    stack.append((t._ctx, False))

        pending = {id(self._ctx): [None] * len(self._ctx.outputs)}  # fn -> gradient of each output
        pending[id(self._ctx)][self._out_index] = grad
        for fn in reversed(order):
            grad_outputs = pending.pop(id(fn), None)
            if grad_outputs is None or all(g is None for g in grad_outputs):
                continue
            if fn.saved is None:
                raise RuntimeError(
                    f"backward through {type(fn).__name__} a second time: its saved arrays were freed "
                    "after the first backward. Pass retain_graph=True to the first backward() to keep them")
            for ref, g in zip(fn.outputs, grad_outputs):
                out = ref()
                if out is not None and out._retain and g is not None:
                    out.grad = _accumulate(out.grad, g)
            if fn.widened:                   # forward ran in float32 (float16_in_float32): so does backward
                grad_outputs = _recast(grad_outputs, _FLOAT16, _FLOAT32)
            grads_in = fn.backward(*grad_outputs)
            if not isinstance(grads_in, tuple):
                grads_in = (grads_in,)
            if any(fn.needs_input_grad[len(grads_in):]):
                raise RuntimeError(f"{type(fn).__name__}.backward returned {len(grads_in)} gradients but "
                                   f"input {len(grads_in)} needs one")
            for t, g, needed in zip(fn.inputs, grads_in, fn.needs_input_grad):
                if not needed or g is None:   # None: this input's gradient is zero on this path
                    continue
                if not is_array(g):     # a NumPy scalar, from arithmetic on 0-d arrays
                    g = np.asarray(g)
                g = _sum_to_shape(g, t.shape)
                if fn.widened and g.dtype == _FLOAT32:
                    g = g.astype(_FLOAT16)           # back to the float16 input's dtype
                if g.dtype != t.dtype:
                    raise RuntimeError(f"{type(fn).__name__}.backward returned a {g.dtype} gradient "
                                       f"for a {t.dtype} input (a silent dtype change is a bug)")
                if t._ctx is None:
                    if any(g is go for go in grad_outputs):
                        g = g.copy()  # never let a leaf's .grad alias a gradient shared elsewhere
                    t.grad = _accumulate(t.grad, g)
                else:
                    slots = pending.setdefault(id(t._ctx), [None] * len(t._ctx.outputs))
                    slots[t._out_index] = _accumulate(slots[t._out_index], g)
            if not retain_graph:
                fn.saved = None

    # ----- operators (thin: each calls a Function from tinyvit.ops) -----
    def __add__(self, other):
        return _basic().add(self, other)

    def __radd__(self, other):
        return _basic().add(other, self)

    def __sub__(self, other):
        return _basic().sub(self, other)

    def __rsub__(self, other):
        return _basic().sub(other, self)

    def __mul__(self, other):
        return _basic().mul(self, other)

    def __rmul__(self, other):
        return _basic().mul(other, self)

    def __truediv__(self, other):
        return _basic().div(self, other)

    def __rtruediv__(self, other):
        return _basic().div(other, self)

    def __neg__(self):
        return _basic().neg(self)

    def __pow__(self, exponent):
        return _basic().pow(self, exponent)

    def __matmul__(self, other):
        return _basic().matmul(self, other)

    def __rmatmul__(self, other):
        return _basic().matmul(other, self)

    def __getitem__(self, index):
        return _basic().getitem(self, index)

    # ----- methods mirroring the functional API -----
    def sum(self, axis=None, keepdims=False):
        return _basic().sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return _basic().mean(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return _basic().max(self, axis, keepdims)

    def reshape(self, *shape):
        return _basic().reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)

    def transpose(self, *axes):
        return _basic().transpose(self, axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else (axes or None))

    def permute(self, *axes):
        return self.transpose(*axes)

    @property
    def T(self):
        return _basic().transpose(self, None)

    def exp(self):
        return _basic().exp(self)

    def log(self):
        return _basic().log(self)

    def sqrt(self):
        return _basic().sqrt(self)

    def tanh(self):
        return _basic().tanh(self)

    def relu(self):
        return _basic().relu(self)

    def astype(self, dtype):
        return _basic().cast(self, dtype)


@functools.cache
def _basic():
    from .ops import basic  # late import: ops import this module
    return basic


def tensor(data, requires_grad: bool = False, dtype=None, device=None) -> Tensor:
    """Make a Tensor (float data defaults to float32); see ``Tensor``."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype, device=device)


def as_array(x):
    """The raw array behind a Tensor, or the array itself."""
    return x.data if isinstance(x, Tensor) else x
