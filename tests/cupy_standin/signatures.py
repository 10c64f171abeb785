"""What the installed CuPy accepts: names and parameters, read from the real package (it imports
without a GPU). A call the stand-in checks here fails exactly when the same call would fail in
CuPy for its arguments' names or number (TypeError), before any NumPy code runs.

Python functions give their signature to inspect; CuPy's Cython methods and ufunc methods do not,
but CuPy is built with Cython's embedsignature, so their docstrings start with it:
``_ndarray_base.sum(self, axis=None, dtype=None, out=None, keepdims=False) -> _ndarray_base``.
"""
from __future__ import annotations

import inspect
import re

class _Default:
    def __repr__(self):
        return "..."


_DEFAULT = _Default()                 # a default value the docstring gives but we need not know
_HEAD = re.compile(r"^[\w.]+\((.*)\)(\s*->.*)?$")


def docstring_signature(func):
    """The signature in the first docstring line (Cython embedsignature), or None."""
    doc = (getattr(func, "__doc__", None) or "").lstrip().split("\n", 1)[0].strip()
    match = _HEAD.match(doc)
    if not match:
        return None
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for i, item in enumerate(_split(match.group(1))):
        if i == 0 and item == "self" or item == "/":
            continue
        if item == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif item.startswith("**"):
            params.append(inspect.Parameter(item[2:], inspect.Parameter.VAR_KEYWORD))
        elif item.startswith("*"):
            params.append(inspect.Parameter(item[1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            name, eq, _ = item.partition("=")
            name = name.split()[-1]                    # drop a Cython type: 'Py_ssize_t axis1'
            params.append(inspect.Parameter(name, kind, default=_DEFAULT if eq else inspect.Parameter.empty))
    try:
        return inspect.Signature(params)
    except ValueError:                                 # a form this little parser does not know
        return None


def _split(text):
    """Split a parameter list at the commas outside brackets and quotes."""
    items, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        items.append(text[start:].strip())
    return items


def signature_of(func):
    """CuPy's signature of ``func`` (a function, method or ufunc method), or None if unknown."""
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return docstring_signature(func)


class Check:
    """CuPy's signature of one function, checked against calls: TypeError, as CuPy raises it, if the
    signature does not take the arguments. Whether it does depends on their number and keywords
    only, so each verdict is worked out once (inspect's bind is slow for a check on every op)."""

    def __init__(self, where: str, signature):
        self.where, self.signature = where, signature
        self._verdicts, self._names = {}, {}

    def __call__(self, args, kwargs) -> None:
        if self.signature is None:
            return
        key = (len(args), tuple(kwargs))
        verdict = self._verdicts.get(key, "")
        if verdict == "":
            try:
                self.signature.bind(*args, **kwargs)
                verdict = None
            except TypeError as exc:
                verdict = f"{exc} (CuPy's signature is {self.where.rsplit('.', 1)[-1]}{self.signature})"
            self._verdicts[key] = verdict
        if verdict is not None:
            raise TypeError(f"{self.where}: {verdict}")

    def positional_names(self, n: int) -> list:
        """The parameter name each of n positional arguments binds to (None where unknown)."""
        if n not in self._names:
            names = []
            for p in (self.signature.parameters.values() if self.signature is not None else ()):
                if p.kind == p.VAR_POSITIONAL:
                    names += [p.name] * (n - len(names))
                elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    names.append(p.name)
            self._names[n] = (names + [None] * n)[:n]
        return self._names[n]


def check_no_host(where: str, *values) -> None:
    from .array import refuse_host
    refuse_host(where, *values)
