"""The stand-in's ndarray: a NumPy array in a wrapper that behaves like cupy.ndarray toward NumPy,
tinyvit and host arrays. Each rule below follows cupy/_core/core.pyx and _routines_indexing.pyx
(CuPy 14.2), where the method of the same name lives:

- no implicit conversion: ``__array__`` raises CuPy's TypeError, there is no buffer, no
  ``__array_interface__`` and no ``__index__`` (so ``np.asarray(a)``, ``range(a)`` fail as on a GPU);
  ``float(a)``, ``int(a)``, ``bool(a)`` and printing go through ``.get()`` as CuPy's do;
- NumPy functions on it dispatch, like CuPy's, through ``__array_ufunc__``/``__array_function__``
  to the stand-in function of the same name (``np.exp(a)`` is ``cupy.exp(a)``), and fail where
  CuPy has no such function or the arguments hold a host array;
- operators with a host ndarray raise (the ufunc refuses it); Python and NumPy scalars are fine;
- results are never NumPy scalars: ``a.sum()`` and ``a[0]`` of a vector are 0-d device arrays;
- indexing accepts host integer/boolean arrays and lists (CuPy copies them to the device);
  assigning a non-scalar host array through basic indexing (``a[...] = host``) raises CuPy's
  ValueError, through advanced indexing it is copied like CuPy does;
- only the methods and attributes cupy.ndarray has, with CuPy's parameters (see signatures.py).
"""
from __future__ import annotations

import warnings

import numpy as np

from . import signatures
from .device import Device, MemoryPointer

IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")

PY_SCALARS = (int, float, bool, complex)

# Every read of device data by the host (get, item, tolist, and what goes through them: bool(), int(),
# float(), printing, cupy.asnumpy). On a GPU each one waits for the queue of kernels to drain, so a
# training step must make none: tests count them (host_reads()).
_host_reads = [0]


def host_reads() -> int:
    """How many times the host has read device data so far."""
    return _host_reads[0]


def is_scalar(x) -> bool:
    """A Python or NumPy scalar: what CuPy's kernels take as a value (CScalar), nothing else."""
    return type(x) in PY_SCALARS or isinstance(x, np.generic)


def wrap(x):
    """NumPy results -> stand-in arrays (NumPy scalars become 0-d arrays, as CuPy returns them)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return ndarray._of(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(wrap(v) for v in x)
    if isinstance(x, list):
        return [wrap(v) for v in x]
    return x


def unwrap(x):
    """Stand-in arrays -> their NumPy arrays, inside lists, tuples and dicts too."""
    if isinstance(x, ndarray):
        return x._a
    if x is None or type(x) in PY_SCALARS:
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: unwrap(v) for k, v in x.items()}
    return x


def find_host_array(x):
    """The first host numpy.ndarray in x (looking into lists, tuples and dicts), or None."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, ndarray) or x is None or type(x) in PY_SCALARS:
        return None
    if isinstance(x, (list, tuple)):
        x = list(x)
    elif isinstance(x, dict):
        x = list(x.values())
    else:
        return None
    for v in x:
        found = find_host_array(v)
        if found is not None:
            return found
    return None


def refuse_host(where: str, *args, **kwargs) -> None:
    host = find_host_array((args, kwargs))
    if host is not None:
        raise TypeError(f"{where}: expected cupy.ndarray, got numpy.ndarray (shape {host.shape}); "
                        "CuPy does not copy host arrays implicitly: use cupy.asarray first")


def _should_use_rop(x, y) -> bool:
    """core.pyx _should_use_rop: defer to y (NotImplemented) if y opts out of ufuncs or outranks."""
    y_ufunc = getattr(y, "__array_ufunc__", _HANDLED)
    if y_ufunc is not _HANDLED:
        return y_ufunc is None
    return getattr(x, "__array_priority__", 0) < getattr(y, "__array_priority__", 0)


_HANDLED = object()


def _binary(name, reflected=False):
    """x <op> y as core.pyx writes it: a stand-in y goes straight to the ufunc, anything else through
    NumPy's ufunc machinery (which calls __array_ufunc__, which refuses a host array)."""
    np_ufunc = getattr(np, name)

    def op(self, other):
        if isinstance(other, ndarray):
            ufunc = _namespace().cupy_function(name)
            return ufunc(other, self) if reflected else ufunc(self, other)
        if _should_use_rop(self, other):
            return NotImplemented
        return np_ufunc(other, self) if reflected else np_ufunc(self, other)

    op.__name__ = f"__{'r' if reflected else ''}{name}__"
    return op


def _inplace(name):
    def op(self, other):
        _namespace().cupy_function(name)(self, other, out=self)
        return self
    return op


def _namespace():
    """namespace.py (which imports this module, hence not imported at the top)."""
    global _NAMESPACE
    if _NAMESPACE is None:
        from . import namespace
        _NAMESPACE = namespace
    return _NAMESPACE


_NAMESPACE = None


def prepare_index(index):
    """(the NumPy index, whether it is advanced): host arrays, lists and bools become index arrays
    (CuPy copies them to the device, _prepare_slice_list); ints, slices, None and ... stay."""
    items = index if isinstance(index, tuple) else (index,)
    out, advanced = [], False
    for s in items:
        if s is None or s is Ellipsis or isinstance(s, slice):
            out.append(s)
        elif isinstance(s, ndarray):
            out.append(s._a)
            advanced = True
        elif np.isscalar(s) and not isinstance(s, (bool, np.bool_)):
            out.append(s)
        else:
            a = np.asarray(unwrap(s))
            if isinstance(s, (list, tuple)) and a.size == 0:
                a = a.astype(np.int32)             # an empty list means no indices, not an empty mask
            if a.dtype.kind not in "biu":
                raise IndexError("arrays used as indices must be of integer or boolean type "
                                 f"(actual: {a.dtype.type})")
            out.append(a)
            advanced = True
    return (tuple(out) if isinstance(index, tuple) else out[0]), advanced


def scalar_fill_value(value, dtype):
    """cupy.ndarray.fill(value) for a value that is not a device array: a host scalar only."""
    value = np.asarray(value, dtype=dtype)
    if value.shape != ():
        raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
    return value[()]


class ndarray:
    """cupy.ndarray on the CPU: ``_a`` is the NumPy array that holds the "device" memory."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("the CuPy stand-in has no device memory to point into")
        self._a = np.empty(shape, dtype=dtype, order=order)

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        self = object.__new__(cls)
        self._a = a
        return self

    # ---------------------------------------------------------------- to the host, explicitly only

    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT)

    def get(self, stream=None, order="C", out=None, blocking=True):
        _host_reads[0] += 1
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"Only numpy.ndarray can be obtained from cupy.ndarray, not {type(out)}")
            if out.dtype != self.dtype:
                raise TypeError(f"dtype mismatch: {out.dtype} != {self.dtype}")
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, not {type(arr)}")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"shape/dtype mismatch: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
        self._a[...] = arr

    def item(self):
        _host_reads[0] += 1
        return self._a.item()

    def tolist(self):
        _host_reads[0] += 1
        return self._a.tolist()

    def __bool__(self):
        if self.size == 0:
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, but in "
                          "future this will result in an error.", DeprecationWarning, stacklevel=2)
            return False
        if self.size > 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. "
                             "Use a.any() or a.all()")
        return bool(self.get())

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __repr__(self):
        return repr(self.get())

    def __str__(self):
        return str(self.get())

    def __format__(self, spec):
        return format(self.get(), spec)

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def __reduce__(self):
        return _rebuild, (self.get(),)

    # ---------------------------------------------------------------- NumPy's protocols (core.pyx)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        ns = _namespace()
        inout = inputs
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            inout += out
            kwargs["out"] = out[0]
        if method not in ("__call__", "outer", "at", "reduce", "accumulate", "reduceat"):
            return NotImplemented
        func = ns.cupy_function(ufunc.__name__, default=None) or ns.special_function(ufunc.__name__)
        if func is None:
            return NotImplemented
        if method != "__call__":
            func = getattr(func, method, None)
            if func is None:
                return NotImplemented
        if any(not is_scalar(x) and not isinstance(x, (ndarray, np.ndarray)) for x in inout):
            return NotImplemented
        if ufunc.__name__ in ("greater", "greater_equal", "less", "less_equal", "equal", "not_equal"):
            inputs = tuple(x.item() if isinstance(x, np.ndarray) and x.ndim == 0 else x for x in inputs)
        return func(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        ns = _namespace()
        target = ns.CUPY
        try:
            for part in func.__module__.split(".")[1:]:
                target = getattr(target, part)
            cupy_func = getattr(target, func.__name__)
        except AttributeError:
            return NotImplemented
        if cupy_func is func or not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        return cupy_func(*args, **kwargs)

    # ---------------------------------------------------------------- indexing

    def __getitem__(self, index):
        index, _ = prepare_index(index)
        return wrap(self._a[index])

    def __setitem__(self, index, value):
        index, advanced = prepare_index(index)
        if isinstance(value, ndarray):
            value = value._a
        elif not advanced:
            value = scalar_fill_value(value, self.dtype)       # basic indexing: y.fill(value)
        else:
            value = np.asarray(unwrap(value))                   # advanced: core.array(value)
        self._a[index] = value

    def __delitem__(self, index):
        raise ValueError("cannot delete array elements")

    def _scatter(self, op, slices, value):
        index, _ = prepare_index(slices)
        op.at(self._a, index, unwrap(value) if isinstance(value, ndarray) else np.asarray(unwrap(value)))

    def scatter_add(self, slices, value):
        self._scatter(np.add, slices, value)

    def scatter_max(self, slices, value):
        self._scatter(np.maximum, slices, value)

    def scatter_min(self, slices, value):
        self._scatter(np.minimum, slices, value)

    def fill(self, value):
        self._a.fill(value._a[()] if isinstance(value, ndarray) and value.ndim == 0 else
                     scalar_fill_value(unwrap(value), self.dtype))

    # ---------------------------------------------------------------- attributes

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T))
    mT = property(lambda self: ndarray._of(self._a.mT))
    real = property(lambda self: ndarray._of(self._a.real))
    imag = property(lambda self: ndarray._of(self._a.imag))
    base = property(lambda self: None if self._a.base is None else wrap(self._a.base))
    data = property(lambda self: MemoryPointer(self._a))
    device = property(lambda self: Device(0))

    @shape.setter
    def shape(self, new):
        self._a.shape = new

    def ptp(self, axis=None, out=None, keepdims=False):
        signatures.check_no_host("cupy.ndarray.ptp", out)
        return wrap(np.ptp(self._a, axis=axis, out=unwrap(out), keepdims=keepdims))

    def reduced_view(self, dtype=None):
        return self


ndarray.__module__ = "cupy_standin"       # backend.is_cupy_array: type(a).__module__ starts with "cupy"


def _rebuild(host):
    return ndarray._of(np.array(host))


# The operators (core.pyx): a ufunc each, NotImplemented where the other operand outranks.
for _name, _ufunc in [("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "divide"),
                      ("floordiv", "floor_divide"), ("mod", "remainder"), ("pow", "power"),
                      ("matmul", "matmul"), ("divmod", "divmod"), ("and", "bitwise_and"),
                      ("or", "bitwise_or"), ("xor", "bitwise_xor"), ("lshift", "left_shift"),
                      ("rshift", "right_shift"), ("lt", "less"), ("le", "less_equal"),
                      ("gt", "greater"), ("ge", "greater_equal")]:
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
    if _name not in ("lt", "le", "gt", "ge"):
        setattr(ndarray, f"__r{_name}__", _binary(_ufunc, reflected=True))
    if _name not in ("lt", "le", "gt", "ge", "divmod", "matmul"):
        setattr(ndarray, f"__i{_name}__", _inplace(_ufunc))


def _eq(name, default):
    np_ufunc = getattr(np, name)

    def op(self, other):
        if isinstance(other, ndarray):
            return _namespace().cupy_function(name)(self, other)
        if _should_use_rop(self, other):
            return NotImplemented
        if other is None or (type(other).__eq__ is object.__eq__ and not is_scalar(other)
                             and not isinstance(other, np.ndarray)):
            return ndarray._of(np.full(self.shape, default))    # never equal to an element
        return np_ufunc(self, other)
    return op


ndarray.__eq__ = _eq("equal", False)
ndarray.__ne__ = _eq("not_equal", True)
for _name, _ufunc in [("neg", "negative"), ("pos", "positive"), ("abs", "absolute"), ("invert", "invert")]:
    setattr(ndarray, f"__{_name}__", (lambda u: lambda self: _namespace().cupy_function(u)(self))(_ufunc))
