"""Module and Parameter: the containers every layer and model is built from (PyTorch's names and behaviour).

A ``Parameter`` is a Tensor that requires a gradient. A ``Module`` remembers, in the order they are
assigned, the Parameters, sub-Modules and buffers (non-trained arrays) set as its attributes, so that

    model.named_parameters()   ->  ("blocks.0.attn.qkv.weight", Parameter), ...
    model.state_dict()         ->  {"blocks.0.attn.qkv.weight": array, ...}

walk the whole tree without any registration code in the layers themselves.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .. import backend
from ..autograd import Tensor, is_array


class Parameter(Tensor):
    """A Tensor that is a trainable weight of a Module: requires_grad=True, floating point only.

    data: an array (kept as it is, dtype and device included), a Tensor (its array is used), or a
    Python number/list (converted to the default dtype, float32 unless changed).
    """

    def __init__(self, data, requires_grad: bool = True):
        if isinstance(data, Tensor):
            data = data.data
        if not is_array(data):
            data = np.asarray(data)
            if data.dtype.kind in "iub":
                raise TypeError(f"Parameter needs floating-point data, got {data.dtype}")
            data = data.astype(backend.get_default_dtype())
        if data.dtype.kind != "f":
            raise TypeError(f"Parameter needs floating-point data, got dtype {data.dtype} "
                            f"(shape {data.shape}); convert with .astype(np.float32) first")
        super().__init__(data, requires_grad=requires_grad)

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


def _addindent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    return "\n".join([lines[0]] + [" " * spaces + line for line in lines[1:]])


def _raw(value):
    """The array behind a Tensor, or the value itself."""
    return value.data if isinstance(value, Tensor) else value


class Module:
    """Base class of every layer and model.

    Subclasses call ``super().__init__()`` first, assign Parameters and sub-Modules as attributes
    (registration order is the order of ``named_parameters``) and implement ``forward``; calling the
    module calls ``forward``. ``training`` is True after construction (``train()``/``eval()`` switch it
    for the whole tree; dropout and drop-path read it).
    """

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    # ----------------------------------------------------------------- attribute registration
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"cannot assign {name!r} before Module.__init__() is called: "
                                 f"call super().__init__() first in {type(self).__name__}.__init__")
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            self._forget(name)
            params[name] = value
        elif isinstance(value, Module):
            self._forget(name)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(f"cannot assign a {type(value).__name__} to parameter {name!r} of "
                                f"{type(self).__name__} (expected a Parameter or None)")
            params[name] = None
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign a {type(value).__name__} to sub-module {name!r} of "
                                f"{type(self).__name__} (expected a Module or None)")
            modules[name] = None
        elif name in buffers:
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name):
        for registry in (self._parameters, self._buffers, self._modules):
            registry.pop(name, None)
        self._non_persistent.discard(name)
        self.__dict__.pop(name, None)

    def __getattr__(self, name):  # only called when normal lookup fails
        for registry in ("_parameters", "_buffers", "_modules"):
            d = self.__dict__.get(registry)
            if d is not None and name in d:
                return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        if name in self._parameters or name in self._buffers or name in self._modules:
            self._forget(name)
        else:
            object.__delattr__(self, name)

    def register_parameter(self, name: str, param) -> None:
        """Register ``param`` (a Parameter, or None for an absent optional weight) under ``name``."""
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter: {name!r} must be a Parameter or None, got {type(param).__name__}")
        self._forget(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, value, persistent: bool = True) -> None:
        """Register a state array that is not trained (an array, a Tensor or None) under ``name``.

        Buffers move with ``to()`` and, when persistent, are saved in ``state_dict()``."""
        if value is not None and not (is_array(value) or isinstance(value, Tensor)):
            raise TypeError(f"register_buffer: {name!r} must be an array, a Tensor or None, got {type(value).__name__}")
        self._forget(name)
        self._buffers[name] = value
        if not persistent:
            self._non_persistent.add(name)

    def add_module(self, name: str, module) -> None:
        """Register a sub-module under ``name`` (what ``self.name = module`` does)."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module: {name!r} must be a Module or None, got {type(module).__name__}")
        self._forget(name)
        self._modules[name] = module

    # ----------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ----------------------------------------------------------------- walking the tree
    def named_children(self):
        """(name, module) for each direct sub-module, in registration order."""
        for name, m in self._modules.items():
            if m is not None:
                yield name, m

    def children(self):
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "", _memo=None):
        """(dotted name, module) for this module ("") and every sub-module, pre-order, each once."""
        memo = set() if _memo is None else _memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self.named_children():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """(dotted name, Parameter) in registration order, e.g. "blocks.0.attn.qkv.weight".

        A Parameter shared by several modules is listed once (under its first name) unless
        remove_duplicate=False."""
        seen = set()
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for mod_name, m in mods:
            for name, p in m._parameters.items():
                if p is None or (remove_duplicate and id(p) in seen):
                    continue
                seen.add(id(p))
                yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True):
        seen = set()
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for mod_name, m in mods:
            for name, b in m._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                yield (f"{mod_name}.{name}" if mod_name else name), b

    def buffers(self, recurse: bool = True):
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of scalar weights (each shared Parameter counted once)."""
        return sum(int(p.size) for p in self.parameters() if p.requires_grad or not trainable_only)

    def apply(self, fn):
        """Call ``fn(module)`` on every sub-module and then on self (as PyTorch); returns self."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ----------------------------------------------------------------- state
    def _state_items(self):
        """(name, owner module, key in owner, kind) for everything state_dict saves, in order:
        each module's parameters, then its persistent buffers, pre-order (as PyTorch)."""
        for mod_name, m in self.named_modules():
            pre = f"{mod_name}." if mod_name else ""
            for key, p in m._parameters.items():
                if p is not None:
                    yield pre + key, m, key, "parameter"
            for key, b in m._buffers.items():
                if b is not None and key not in m._non_persistent:
                    yield pre + key, m, key, "buffer"

    def state_dict(self) -> dict:
        """{dotted name: array} for every parameter and persistent buffer.

        The values are the live arrays themselves (NumPy or CuPy), not copies: an optimizer step or
        a ``load_state_dict`` changes them. Copy them ({k: v.copy() ...}) to keep a snapshot.
        A Parameter shared under two names appears under both (as in PyTorch)."""
        out = OrderedDict()
        for name, m, key, kind in self._state_items():
            value = m._parameters[key] if kind == "parameter" else m._buffers[key]
            out[name] = _raw(value)
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy the arrays of ``state_dict`` into this module's parameters and buffers, in place.

        Each value is converted to the dtype of the array it replaces and moved to its device (the
        Parameter objects stay the same objects, so an optimizer built on them keeps working).
        Nothing is loaded unless everything fits: a shape mismatch always raises, and with
        ``strict=True`` (the default) so do missing and unexpected keys, in one ValueError that lists
        all the problems. Returns (missing_keys, unexpected_keys)."""
        targets = OrderedDict((name, (m, key, kind)) for name, m, key, kind in self._state_items())
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        mismatched, staged, transposed = [], [], []
        for name, (m, key, kind) in targets.items():
            if name not in state_dict:
                continue
            current = m._parameters[key] if kind == "parameter" else m._buffers[key]
            dest = _raw(current)
            value = _raw(state_dict[name])
            shape = tuple(getattr(value, "shape", np.shape(value)))
            if shape != tuple(dest.shape):
                mismatched.append(f"{name}: checkpoint shape {shape} != model shape {tuple(dest.shape)}")
                transposed.append((shape, dest))
                continue
            if not is_array(value):
                value = np.asarray(value)
            value = backend.to_device(value, backend.device_of(dest))
            xp = backend.get_array_module(dest)
            staged.append((dest, xp.asarray(value, dtype=dest.dtype)))
        problems = []
        if mismatched:
            problems.append("shape mismatch:\n    " + "\n    ".join(mismatched))
            if any(shape[::-1] == tuple(dest.shape) or len(shape) == 4 for shape, dest in transposed):
                # our Linear weights are (in, out), the paper's x E; PyTorch's are (out, in)
                problems.append("these look like PyTorch/timm layouts: load them with tinyvit.io.load_pretrained, "
                                "which converts timm state dicts (and official .npz files)")
        if strict and missing:
            problems.append("missing keys: " + ", ".join(missing))
        if strict and unexpected:
            problems.append("unexpected keys: " + ", ".join(unexpected))
        if problems:
            raise ValueError(f"load_state_dict for {type(self).__name__}: nothing was loaded because of\n  "
                             + "\n  ".join(problems))
        for dest, value in staged:
            dest[...] = value
        return missing, unexpected

    # ----------------------------------------------------------------- modes, gradients, devices
    def train(self, mode: bool = True):
        """Set ``training`` on this module and every sub-module; returns self."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        """``train(False)``: dropout and drop-path become identities."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Forget the gradients (``grad = None``) of every parameter."""
        for p in self.parameters():
            p.grad = None

    def requires_grad_(self, flag: bool = True):
        """Freeze (False) or unfreeze every parameter; returns self."""
        for p in self.parameters():
            p.requires_grad = bool(flag)
        return self

    def to(self, device=None, dtype=None):
        """Move every parameter and buffer to ``device`` and/or cast the floating ones to ``dtype``,
        in place: the Parameter objects stay the same (an optimizer keeps working), their ``.data``
        (and ``.grad``) change. Returns self."""
        def convert(array):
            if array is None:
                return None
            if dtype is not None and array.dtype.kind == "f" and array.dtype != np.dtype(dtype):
                array = array.astype(dtype)
            if device is not None:
                array = backend.to_device(array, device)
            return array

        if dtype is not None and np.dtype(dtype).kind != "f":
            raise TypeError(f"Module.to: dtype must be floating point, got {np.dtype(dtype)}")
        for p in self.parameters():
            p.data, p.grad = convert(p.data), convert(p.grad)
        for m in self.modules():
            for key, b in m._buffers.items():
                if isinstance(b, Tensor):
                    b.data = convert(b.data)
                elif b is not None:
                    m._buffers[key] = convert(b)
        return self

    # ----------------------------------------------------------------- printing
    def extra_repr(self) -> str:
        """The arguments shown between the parentheses of this module's repr line."""
        return ""

    def __repr__(self):
        lines = [f"({name}): {_addindent(repr(m), 2)}" for name, m in self.named_children()]
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        body = "\n  ".join(([extra] if extra else []) + lines)
        return f"{type(self).__name__}(\n  {body}\n)"

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules))


class Identity(Module):
    """y = x (a placeholder layer, e.g. a model without a pre-logits layer)."""

    def forward(self, x, *args, **kwargs):
        return x


class Sequential(Module):
    """Sub-modules applied one after the other: ``Sequential(a, b, c)(x) == c(b(a(x)))``.

    Sub-modules are named "0", "1", ... (or by the keys of an OrderedDict passed alone)."""

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        items = list(self._modules.items())
        if isinstance(index, slice):
            return Sequential(OrderedDict(items[index]))
        return items[_check_index(index, len(items), "Sequential")][1]

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of sub-modules (e.g. the transformer blocks), named "0", "1", ... so that their
    parameters are "blocks.0.attn.qkv.weight", ... Supports indexing, len, iteration, append, extend."""

    def __init__(self, modules=()):
        super().__init__()
        self.extend(modules)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        mods = list(self._modules.values())
        if isinstance(index, slice):
            return ModuleList(mods[index])
        return mods[_check_index(index, len(mods), "ModuleList")]

    def __setitem__(self, index, module):
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList items must be Modules, got {type(module).__name__}")
        self._modules[str(_check_index(index, len(self), "ModuleList"))] = module  # keeps its position

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules):
        for m in modules:
            self.append(m)
        return self

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleList has no forward(): iterate over it in the parent's forward")


def _check_index(index, n, what):
    index = int(index)
    if not -n <= index < n:
        raise IndexError(f"{what} index {index} is out of range for {n} modules")
    return index % n
