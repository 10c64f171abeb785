"""The stand-in's modules: cupy (with linalg, lib.stride_tricks, random, cuda) and cupyx (with
scatter_add and scipy.special.erf). Each looks a name up in the installed CuPy first: a name CuPy
lacks is an AttributeError, a call CuPy's signature refuses a TypeError, a host array where CuPy
needs a device array a TypeError; only then does NumPy compute, on unwrapped arrays.

What CuPy can only do on a GPU (RawKernel, RawModule, memory pools, streams beyond a no-op
synchronize, cuBLAS settings) is absent, an AttributeError that says so.
"""
from __future__ import annotations

import math
import types

import cupy as REAL                                   # the installed package: names and signatures
import cupyx as REALX
import cupyx.scipy.special  # noqa: F401  (makes REALX.scipy.special an attribute)
import numpy as np

from . import array as _array
from .array import ndarray, refuse_host, unwrap, wrap
from .device import Device, Stream
from .signatures import Check, signature_of

# Functions whose CuPy code copies host arguments to the device itself (so a host array is fine):
# the constructors, the *_like family (it reads only shape, dtype and order) and einsum, which
# calls cupy.asarray on every operand (cupy/linalg/_einsum.py); and those that only look at types.
ACCEPTS_HOST = {"asarray", "asanyarray", "array", "asnumpy", "zeros_like", "ones_like", "empty_like",
                "full_like", "einsum", "get_array_module", "result_type", "can_cast", "isscalar",
                "ndim", "shape", "iscomplexobj", "isrealobj"}
# Functions NumPy answers with a Python bool or int but CuPy with a 0-d device array.
ARRAY_RESULT = {"allclose", "array_equal", "array_equiv", "count_nonzero"}
# ufunc.at in CuPy is a scatter: only these ufuncs have one (_kernel.pyx, ufunc.at).
SCATTER_UFUNCS = {"add", "subtract", "maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor"}
# Parameters CuPy reads on the host (shapes, axes, split points, pad widths: Python sequences, so a
# host array is fine and a device array is refused, as CuPy's Py_ssize_t conversions refuse it),
# and, per function or method, the index/value parameters that CuPy copies to the device itself.
HOST_PARAMETERS = {"shape", "newshape", "strides", "axis", "axes", "axis1", "axis2", "source", "destination",
                   "indices_or_sections", "pad_width", "constant_values", "reps"}
HOST_PARAMETERS_OF = {"take": {"indices"}, "put": {"indices", "values"}, "repeat": {"repeats"}}


class Namespace(types.ModuleType):
    """A module whose names are the real CuPy module's, implemented with the NumPy module ``host``
    (None: only the names given in ``provided`` exist in the stand-in)."""

    def __init__(self, name, real, host, provided=None):
        super().__init__(name)
        self.__dict__.update(_real=real, _host=host)
        for key, value in (provided or {}).items():
            if not hasattr(real, key):
                raise AssertionError(f"the stand-in provides {name}.{key}, which CuPy {REAL.__version__} lacks")
            setattr(self, key, value)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if not hasattr(self._real, name):
            raise AttributeError(f"module {self.__name__.replace('_standin', '')!r} has no attribute "
                                 f"{name!r} (not in the installed CuPy {REAL.__version__})")
        value = self._make(name, getattr(self._real, name))
        setattr(self, name, value)
        return value

    def __dir__(self):
        return dir(self._real)

    def _make(self, name, real):
        qualname = f"{self._real.__name__}.{name}"
        missing = AttributeError(f"the CuPy stand-in does not implement {qualname} (it needs a GPU, or "
                                 "nothing here uses it yet: add it to tests/cupy_standin)")
        if isinstance(real, types.ModuleType):
            raise missing
        if isinstance(real, type) or not callable(real):
            if getattr(real, "__module__", "numpy").split(".")[0] in ("numpy", "builtins"):
                return real                            # dtypes (cupy.float32 is numpy.float32), pi, newaxis
            raise missing
        host = getattr(self._host, name, None) if self._host is not None else None
        if host is None:
            raise missing
        if type(real).__name__ == "ufunc":
            return Ufunc(qualname, real, host)
        return Function(qualname, real, host)


class Function:
    """A CuPy function computed by NumPy: CuPy's signature, no host arrays (unless ACCEPTS_HOST)."""

    def __init__(self, qualname, real, host):
        self.__name__ = qualname.rsplit(".", 1)[-1]
        self.__qualname__ = qualname
        self.check = Check(qualname, signature_of(real))
        self.host = host

    def __call__(self, *args, **kwargs):
        self.check(args, kwargs)
        out = kwargs.get("out")
        if self.__name__ in ACCEPTS_HOST:
            args, kwargs = unwrap(args), unwrap(kwargs)
        else:
            args, kwargs = device_arguments(self.check, args, kwargs)
        result = self.host(*args, **kwargs)
        if isinstance(out, ndarray) and result is out._a:
            return out
        if self.__name__ in ARRAY_RESULT:
            result = np.asarray(result)
        return wrap(result)

    def __repr__(self):
        return f"<stand-in for {self.__qualname__}>"


class Ufunc:
    """A cupy.ufunc: operands are device arrays or Python/NumPy scalars (a host array or a list is
    CuPy's "Unsupported type"); keyword arguments out, dtype and casting only."""

    KEYWORDS = ("out", "dtype", "casting")

    def __init__(self, qualname, real, host):
        self.__name__ = qualname.rsplit(".", 1)[-1]
        self.__qualname__ = qualname
        self.nin, self.nout, self.nargs = real.nin, real.nout, real.nargs
        self.host = host

    def __call__(self, *args, **kwargs):
        wrong = {k: v for k, v in kwargs.items() if k not in self.KEYWORDS}
        if wrong:
            raise TypeError(f"Wrong arguments {wrong}")
        if not self.nin <= len(args) <= self.nargs:
            raise TypeError(f"Wrong number of arguments for {self.__name__!r}. It must be either "
                            f"{self.nin} or {self.nargs} (with outputs), but given {len(args)}.")
        outs = args[self.nin:] + ((kwargs["out"],) if kwargs.get("out") is not None else ())
        for a in args[:self.nin] + outs:
            if not isinstance(a, ndarray) and not _array.is_scalar(a):
                raise TypeError(f"Unsupported type {type(a)}")
        for a in outs:
            if not isinstance(a, ndarray):
                raise TypeError(f"Output arguments must be cupy.ndarray, not {type(a)}")
        result = self.host(*unwrap(args), **unwrap(kwargs))
        if len(outs) == 1 and result is outs[0]._a:
            return outs[0]
        return wrap(result)

    def at(self, a, indices, b=None):
        if self.__name__ not in SCATTER_UFUNCS:
            raise NotImplementedError(f"`{self.__name__}.at` is not supported yet")
        if not isinstance(a, ndarray):
            raise AttributeError(f"'{type(a).__name__}' object has no attribute '_scatter_op'")
        a._scatter(self.host, indices, b)

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        if self.__name__ == "add":
            return array.sum(axis, dtype, out, keepdims)
        if self.__name__ == "multiply":
            return array.prod(axis, dtype, out, keepdims)
        raise NotImplementedError(f"`{self.__name__}.reduce` is not supported yet")

    def accumulate(self, array, axis=0, dtype=None, out=None):
        if self.__name__ == "add":
            return array.cumsum(axis, dtype, out)
        if self.__name__ == "multiply":
            return array.cumprod(axis, dtype, out)
        raise NotImplementedError(f"`{self.__name__}.accumulate` is not supported yet")

    def outer(self, A, B, **kwargs):
        A, B = asarray(A), asarray(B)                  # core.array: host operands are copied here
        return self(A.reshape(A.shape + (1,) * B.ndim), B.reshape((1,) * A.ndim + B.shape), **kwargs)

    def __repr__(self):
        return f"<stand-in ufunc '{self.__name__}'>"


# ---------------------------------------------------------------- cupy's own functions


def _from_host(obj, dtype, order, ndmin=0):
    a = np.array(unwrap(obj), dtype=dtype, order=order, copy=True, ndmin=ndmin)   # a host -> device copy
    if a.dtype.kind not in "biufc":
        raise ValueError(f"Unsupported dtype {a.dtype}")
    return ndarray._of(a)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if isinstance(a, ndarray):
        out = np.asarray(a._a, dtype=dtype, order=order, copy=copy)
        return a if out is a._a else ndarray._of(out)
    if copy is False:
        raise ValueError("Unable to avoid copy while creating an array as requested.")
    return _from_host(a, dtype, order or "K")


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        out = np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin)
        return obj if out is obj._a else ndarray._of(out)
    return _from_host(obj, dtype, order, ndmin)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    a = np.asarray(a, order=order)
    if out is not None:
        out[...] = a
        return out
    return a


def get_array_module(*args):
    return CUPY if any(isinstance(a, ndarray) for a in args) else np


def device_arguments(check, args, kwargs):
    """The NumPy call's arguments: device arrays unwrapped, host arrays refused (TypeError), except in
    the parameters CuPy reads on the host (HOST_PARAMETERS), which are passed on as they are."""
    where = check.where
    host_ok = HOST_PARAMETERS | HOST_PARAMETERS_OF.get(where.rsplit(".", 1)[-1], set())

    def convert(name, value):
        if name in host_ok:
            return value
        refuse_host(where, value)
        if isinstance(value, (list, tuple)) and not _all_device_arrays(value):
            raise TypeError(f"{where}: a Python {type(value).__name__} of numbers where CuPy needs a "
                            "cupy.ndarray (CuPy does not convert lists here: use cupy.asarray first)")
        return unwrap(value)

    return (tuple(convert(n, v) for n, v in zip(check.positional_names(len(args)), args)),
            {k: convert(k, v) for k, v in kwargs.items()})


def _all_device_arrays(sequence) -> bool:
    """True for a (nested) list or tuple of device arrays only, e.g. concatenate's ``tup``."""
    return all(_all_device_arrays(v) if isinstance(v, (list, tuple)) else isinstance(v, ndarray)
               for v in sequence)


def _method(name, signature):
    """cupy.ndarray.<name>: CuPy's parameters, host arrays only where CuPy takes them."""
    check = Check(f"cupy.ndarray.{name}", signature)

    def method(self, *args, **kwargs):
        check(args, kwargs)
        out = kwargs.get("out")
        args, kwargs = device_arguments(check, args, kwargs)
        result = getattr(self._a, name)(*args, **kwargs)
        if result is self._a:
            return self
        if isinstance(out, ndarray) and result is out._a:
            return out
        return wrap(result)

    method.__name__ = name
    return method


for _name in dir(REAL.ndarray):
    if (not _name.startswith("_") and _name not in ndarray.__dict__ and hasattr(np.ndarray, _name)
            and callable(getattr(REAL.ndarray, _name))):
        setattr(ndarray, _name, _method(_name, signature_of(getattr(REAL.ndarray, _name))))


# ---------------------------------------------------------------- cupy.random, cupy.cuda


class Random(Namespace):
    """cupy.random on a NumPy Generator: CuPy's functions and parameters, other numbers than a GPU's."""

    def __init__(self):
        super().__init__("cupy_standin.random", REAL.random, None)
        self.seed()

    def seed(self, seed=None):
        self._gen = np.random.default_rng(seed)

    def random(self, size=None, dtype=float):
        return ndarray._of(np.asarray(self._gen.random(size, dtype=_float(dtype))))

    random_sample = random

    def rand(self, *size, dtype=float):
        return self.random(size, dtype)

    def standard_normal(self, size=None, dtype=float):
        return ndarray._of(np.asarray(self._gen.standard_normal(size, dtype=_float(dtype))))

    def randn(self, *size, dtype=float):
        return self.standard_normal(size, dtype)

    def normal(self, loc=0.0, scale=1.0, size=None, dtype=float):
        refuse_host("cupy.random.normal", loc, scale)
        return wrap(np.asarray(self._gen.normal(unwrap(loc), unwrap(scale), size)).astype(_float(dtype)))

    def uniform(self, low=0.0, high=1.0, size=None, dtype=float):
        refuse_host("cupy.random.uniform", low, high)
        return wrap(np.asarray(self._gen.uniform(unwrap(low), unwrap(high), size)).astype(_float(dtype)))

    def randint(self, low, high=None, size=None, dtype="l"):
        return wrap(np.asarray(self._gen.integers(low, high, size, dtype=dtype)))

    def permutation(self, a):
        refuse_host("cupy.random.permutation", a)
        return wrap(self._gen.permutation(unwrap(a)))

    def shuffle(self, a):
        if not isinstance(a, ndarray):
            raise TypeError(f"The array must be cupy.ndarray, not {type(a)}")
        self._gen.shuffle(a._a)


class RandomState:
    """cupy.random.RandomState(seed): a generator of its own (standard_normal and random suffice here)."""

    def __init__(self, seed=None, method=None):
        self._gen = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=float):
        return ndarray._of(np.asarray(self._gen.standard_normal(size, dtype=_float(dtype))))

    def random_sample(self, size=None, dtype=float):
        return ndarray._of(np.asarray(self._gen.random(size, dtype=_float(dtype))))


Random.RandomState = RandomState


def _float(dtype):
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"cupy.random supports float32 and float64 only, not {dtype}")
    return dtype.type


_runtime = Namespace("cupy_standin.cuda.runtime", REAL.cuda.runtime, None, dict(
    getDeviceCount=lambda: Device.count, getDevice=lambda: 0, deviceSynchronize=lambda: None))

_cuda = Namespace("cupy_standin.cuda", REAL.cuda, None, dict(
    Device=Device, runtime=_runtime, get_current_stream=lambda device=None: Stream(), Stream=Stream,
    is_available=lambda: True, get_device_id=lambda: 0))


# ---------------------------------------------------------------- cupyx


def _host_erf(x, out=None, dtype=None, casting="same_kind"):
    """erf element-wise (libm's, via math.erf), float32 stays float32 as in cupyx's ufunc."""
    x = np.asarray(x)
    kind = np.dtype(dtype) if dtype is not None else (x.dtype if x.dtype in (np.float32, np.float64) else np.float64)
    y = np.frompyfunc(math.erf, 1, 1)(x.astype(np.float64)).astype(kind)
    if out is None:
        return y
    out[...] = y
    return out


def _scatter(name, op):
    def scatter(a, slices, value):
        """cupyx.<name>(a, slices, value): a[slices] <op>= value, repeated indices accumulating."""
        if not isinstance(a, ndarray):
            raise TypeError(f"cupyx.{name}: a must be a cupy.ndarray, not {type(a)}")
        a._scatter(op, slices, value)
    scatter.__name__ = name
    return scatter


_special = Namespace("cupyx_standin.scipy.special", REALX.scipy.special, None, dict(
    erf=Ufunc("cupyx.scipy.special.erf", REALX.scipy.special.erf, _host_erf)))

CUPYX = Namespace("cupyx_standin", REALX, None, dict(
    scatter_add=_scatter("scatter_add", np.add), scatter_max=_scatter("scatter_max", np.maximum),
    scatter_min=_scatter("scatter_min", np.minimum),
    scipy=Namespace("cupyx_standin.scipy", REALX.scipy, None, dict(special=_special))))

CUPY = Namespace("cupy_standin", REAL, np, dict(
    ndarray=ndarray, asarray=asarray, asanyarray=asarray, array=array, asnumpy=asnumpy,
    get_array_module=get_array_module, random=Random(), cuda=_cuda,
    linalg=Namespace("cupy_standin.linalg", REAL.linalg, np.linalg),
    lib=Namespace("cupy_standin.lib", REAL.lib, np.lib, dict(
        stride_tricks=Namespace("cupy_standin.lib.stride_tricks", REAL.lib.stride_tricks, np.lib.stride_tricks)))))
CUPY.__version__ = REAL.__version__


def cupy_function(name, default=AttributeError):
    """CUPY.<name>, or ``default`` where the stand-in (like CuPy) has no such name."""
    try:
        return getattr(CUPY, name)
    except AttributeError:
        if default is AttributeError:
            raise
        return default


def special_function(name):
    return getattr(_special, name, None)
