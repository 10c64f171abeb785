"""Finite-difference gradient checking, the proof that every handwritten backward is right.

For a function y = f(x_1, ..., x_k) and a *random* upstream gradient G (the same shape as y) we check
the scalar L = sum(G * f(x)). Its analytic gradient comes from our backward (``L.backward``); the
numeric one from central differences

    dL/dx[i] ~ (L(x + eps e_i) - L(x - eps e_i)) / (2 eps)          error O(eps^2)

in float64. G must be random: with G = 1 the true gradient of a softmax is exactly zero (its outputs
sum to one whatever the input), so a wrong backward that also returns zero for G = 1, such as
g - sum(g * y) without the leading factor y, still passes.

For inputs too large to perturb element by element, "random" mode compares directional derivatives
along random directions v: (L(x + eps v) - L(x - eps v)) / (2 eps) against <dL/dx, v>.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .autograd import Tensor, no_grad
from .backend import get_array_module, to_numpy


class GradcheckError(AssertionError):
    """Raised when an analytic gradient disagrees with finite differences."""


@dataclass
class GradcheckResult:
    ok: bool
    max_error: float     # worst |analytic - numeric| / (atol + rtol * |numeric|); <= 1 passes
    max_rel_error: float  # worst |analytic - numeric| / max(|analytic|, |numeric|, tiny)
    where: str           # which input (and element or direction) holds the worst error
    checked: int         # how many numeric derivatives were compared

    def __str__(self):
        status = "ok" if self.ok else "FAILED"
        return (f"gradcheck {status}: worst relative error {self.max_rel_error:.3g} at {self.where} "
                f"({self.checked} derivatives checked)")


def _outputs(fn, inputs):
    out = fn(*inputs)
    return out if isinstance(out, (tuple, list)) else (out,)


def _loss_value(fn, inputs, upstream) -> float:
    with no_grad():
        outs = _outputs(fn, inputs)
        return float(sum((o.data * g).sum() for o, g in zip(outs, upstream) if g is not None))


def gradcheck(fn, inputs, *, eps: float = 1e-6, atol: float = 1e-6, rtol: float = 1e-4,
              mode: str = "auto", max_full: int = 4096, directions: int = 8, seed: int = 0,
              raise_on_failure: bool = True) -> GradcheckResult:
    """Compare ``fn``'s backward with central differences for every input that requires grad.

    fn: callable taking ``inputs`` (Tensors) and returning a Tensor or a tuple of Tensors.
    inputs: list of Tensors; those with requires_grad=True (parameters included) are checked and
        must be float64. Non-tensors (ints, label arrays) are passed through unchanged.
    mode: "full" (every element), "random" (``directions`` random directions per input) or
        "auto" (full for inputs with at most ``max_full`` elements, else random).
    A derivative passes when |analytic - numeric| <= atol + rtol * |numeric|.
    Returns a GradcheckResult; raises GradcheckError on failure unless raise_on_failure=False.
    """
    rng = np.random.default_rng(seed)
    checked_inputs = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    if not checked_inputs:
        raise ValueError("gradcheck: no input has requires_grad=True, so there is nothing to check")
    for i, t in enumerate(checked_inputs):
        if t.dtype != np.float64:
            raise ValueError(f"gradcheck needs float64 inputs (finite differences in float32 are "
                             f"too noisy); input {i} of shape {t.shape} is {t.dtype}")
        t.grad = None

    # Analytic: backward of L = sum(G * y) with a random upstream G for each output.
    outs = _outputs(fn, inputs)
    xp = get_array_module(outs[0].data)
    upstream = []
    for o in outs:
        if o.requires_grad and o.dtype.kind == "f":
            upstream.append(xp.asarray(rng.standard_normal(o.shape)).astype(o.dtype))
        else:
            upstream.append(None)
    if all(g is None for g in upstream):
        raise ValueError("gradcheck: no output of fn depends on an input that requires grad")
    # One scalar from all outputs and one backward, so a multi-output op gets all its output
    # gradients in the same backward call (as in real use).
    loss = sum((o * g).sum() for o, g in zip(outs, upstream) if g is not None)
    loss.backward(retain_graph=True)
    analytic = [to_numpy(t.grad) if t.grad is not None else np.zeros(t.shape) for t in checked_inputs]

    worst = (0.0, 0.0, "nowhere")  # (scaled error, relative error, where)
    checked = 0

    def compare(numeric, ana, where):
        nonlocal worst, checked
        checked += 1
        diff = abs(ana - numeric)
        scaled = diff / (atol + rtol * abs(numeric))
        rel = diff / max(abs(ana), abs(numeric), 1e-12)
        if scaled > worst[0]:
            worst = (scaled, rel, where)

    for k, t in enumerate(checked_inputs):
        name = f"input {inputs.index(t) if any(t is x for x in inputs) else k} {tuple(t.shape)}"
        flat = t.data.reshape(-1)  # a view: perturbing it perturbs t.data
        use_full = mode == "full" or (mode == "auto" and t.size <= max_full)
        if use_full:
            for i in range(t.size):
                orig = flat[i].item()
                flat[i] = orig + eps
                plus = _loss_value(fn, inputs, upstream)
                flat[i] = orig - eps
                minus = _loss_value(fn, inputs, upstream)
                flat[i] = orig
                idx = tuple(int(j) for j in np.unravel_index(i, t.shape))
                compare((plus - minus) / (2 * eps), float(analytic[k].reshape(-1)[i]), f"{name} element {idx}")
        else:
            original = t.data.copy()
            for d in range(directions):
                v = rng.standard_normal(t.shape)
                v /= np.linalg.norm(v)
                v_dev = xp.asarray(v)
                t.data[...] = original + eps * v_dev
                plus = _loss_value(fn, inputs, upstream)
                t.data[...] = original - eps * v_dev
                minus = _loss_value(fn, inputs, upstream)
                t.data[...] = original
                compare((plus - minus) / (2 * eps), float((analytic[k] * v).sum()), f"{name} direction {d}")

    result = GradcheckResult(ok=worst[0] <= 1.0, max_error=worst[0], max_rel_error=worst[1],
                             where=worst[2], checked=checked)
    if not result.ok and raise_on_failure:
        raise GradcheckError(str(result))
    return result
