"""Optimizers (SGD, Adam, AdamW), learning-rate schedules and gradient clipping.

Every update is written out below, on whole arrays and in place on ``p.data`` (NumPy or CuPy: the
state lives on the parameter's device and nothing is copied to the host, so ``step()`` never
synchronises a GPU). Semantics follow PyTorch's torch.optim exactly, so results can be compared
number for number. The paper (appendix B.1) pre-trains with Adam (beta1=0.9, beta2=0.999, weight
decay 0.1), fine-tunes with SGD with momentum 0.9, uses a linear warmup followed by cosine or linear
decay, and clips gradients at global norm 1.

    opt = AdamW(param_groups_weight_decay(model, 0.05), lr=1e-3)
    sched = LRScheduler(opt, lambda s: warmup_cosine(s, total_steps, warmup_steps, base_lr=1e-3))
    for batch in data:
        model.zero_grad(); loss = ...; loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step(); sched.step()
"""
from __future__ import annotations

import math

import numpy as np

from . import backend
from .autograd import Tensor, is_array
from .kernels import kernel_for

# ====================================================================== the optimizer base


class Optimizer:
    """Holds ``param_groups``: a list of dicts {"params": [Parameter, ...], "lr": ..., ...}, each with
    its own hyperparameters (missing ones come from the optimizer's defaults), and ``state``: per
    parameter (keyed by ``id(p)``) a dict of numbers and arrays (step count, moments).

    params: an iterable of Parameters, or of dicts {"params": [...], "weight_decay": 0.0, "lr": ...}.
    A group's learning rate can be changed at any time: ``opt.param_groups[i]["lr"] = 1e-4``
    (``opt.lr = x`` sets it in every group).
    """

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        self.param_groups: list[dict] = []
        self.state: dict[int, dict] = {}
        if isinstance(params, Tensor):
            params = [params]
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        for group in params:
            self.add_param_group(group)

    def add_param_group(self, group: dict) -> None:
        """Add a group of parameters with its own hyperparameters (e.g. when unfreezing layers)."""
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("a parameter group must be a dict with a 'params' key")
        group = dict(group)
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in group["params"]:
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__} can only optimize Tensors/Parameters, got {type(p).__name__}")
            if p.dtype.kind != "f":
                raise TypeError(f"{type(self).__name__}: parameter of dtype {p.dtype} is not floating point")
            if id(p) in seen:
                raise ValueError("some parameters appear in more than one parameter group (or twice in one)")
            seen.add(id(p))
        unknown = set(group) - set(self.defaults) - {"params", "lr_scale", "name"}
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown hyperparameters {sorted(unknown)} in a parameter group "
                             f"(known: {sorted(self.defaults)})")
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self._check_hyperparameters(group)
        self.param_groups.append(group)

    def _check_hyperparameters(self, group: dict) -> None:
        if group["lr"] < 0:
            raise ValueError(f"invalid learning rate {group['lr']}")
        if group["weight_decay"] < 0:
            raise ValueError(f"invalid weight_decay {group['weight_decay']}")

    @property
    def lr(self):
        """The learning rate of the first group (``param_groups[i]["lr"]`` for the others)."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        for group in self.param_groups:
            group["lr"] = value

    def zero_grad(self) -> None:
        """Forget the gradients (``grad = None``) of every parameter this optimizer updates."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def step(self) -> None:
        """Update every parameter that has a gradient (those with ``grad is None`` are skipped), one
        after the other with ``_update``; with kernels on, the switchboard's kernel takes them all
        (kernels/cpu/optim.py: the same updates in place, the large parameters' among threads)."""
        items = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.shape != p.shape:
                    raise ValueError(f"gradient of shape {p.grad.shape} for a parameter of shape {p.shape}")
                items.append((p, p.grad, self._state_of(p), group))
        if not items:
            return
        kernel = kernel_for("optimizer_step", items[0][0])
        if kernel is not None:
            kernel(items, self._update)
            return
        for item in items:
            self._update(*item)

    def _update(self, p, g, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _state_of(self, p) -> dict:
        """The state dict of parameter p, its arrays moved to p's device and dtype if p has moved
        (``model.to(...)`` after some steps): a cheap check, no data is read."""
        state = self.state.setdefault(id(p), {})
        device = backend.device_of(p.data)
        for key, value in state.items():
            if is_array(value) and (value.dtype != p.dtype or backend.device_of(value) != device):
                state[key] = backend.to_device(value, device).astype(p.dtype, copy=False)
        return state

    # ----------------------------------------------------------------- saving and restoring
    def state_dict(self) -> dict:
        """{"state": {index: {"step": int, "exp_avg": array, ...}}, "param_groups": [{"lr": ..., "params":
        [index, ...]}, ...]} with parameters numbered in group order (as PyTorch). The arrays are the
        live state arrays (copy them for a snapshot); everything else is a plain number or tuple, so the
        whole thing can be flattened into a safetensors or npz file."""
        index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[id(p)] for p in group["params"]]} for group in self.param_groups]
        state = {index[pid]: dict(s) for pid, s in self.state.items() if pid in index and s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore hyperparameters, step counts and moments saved by ``state_dict`` (copies of the
        arrays, in each parameter's dtype, on its device). The groups must have the same sizes and the
        moments the parameters' shapes; nothing is changed unless everything fits."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the saved state has {len(saved_groups)} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        params = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"load_state_dict: group {i} has {len(saved['params'])} parameters in the saved "
                                 f"state, {len(group['params'])} here")
            params.update(zip(map(int, saved["params"]), group["params"]))
        new_state = {}
        for idx, saved in state_dict["state"].items():
            p = params.get(int(idx))
            if p is None:
                raise ValueError(f"load_state_dict: state for parameter {idx}, which no group lists")
            new_state[id(p)] = {key: _loaded(value, key, p, idx) for key, value in saved.items()}
        self.state = new_state
        for saved, group in zip(saved_groups, self.param_groups):
            group.update((key, _plain(value)) for key, value in saved.items() if key != "params")


def _loaded(value, key, p, idx):
    """A saved state entry of parameter p (number idx) as the optimizer keeps it: the step count an
    int, a moment a copy in p's dtype on p's device (of p's shape), anything else a plain number."""
    if key == "step":
        return int(value)
    if not (is_array(value) and (value.ndim > 0 or p.ndim == 0)):
        return _plain(value)
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"load_state_dict: {key} of parameter {idx} has shape {tuple(value.shape)}, "
                         f"the parameter {tuple(p.shape)}")
    xp = backend.get_array_module(p.data)
    return xp.array(backend.to_device(value, backend.device_of(p.data)), dtype=p.dtype, copy=True)


def _plain(value):
    """A Python number or tuple from what a checkpoint file gave back (0-d or 1-d arrays, lists)."""
    if hasattr(value, "tolist"):
        value = value.tolist()                 # a 0-d array or NumPy scalar -> a number; 1-d -> a list
    return tuple(value) if isinstance(value, list) else value


# ====================================================================== the optimizers


class SGD(Optimizer):
    """Stochastic gradient descent with momentum (PyTorch semantics). For each parameter p with
    gradient g, momentum mu, dampening tau, weight decay lambda:

        g <- g + lambda p                                  (L2 penalty added to the gradient)
        b <- g                         on the first step
        b <- mu b + (1 - tau) g        after that          (the momentum buffer)
        g <- g + mu b  if nesterov else  b
        p <- p - lr g
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum needs momentum > 0 and dampening = 0")
        if momentum < 0:
            raise ValueError(f"SGD: invalid momentum {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                                      weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        lr, mu, tau, wd = group["lr"], group["momentum"], group["dampening"], group["weight_decay"]
        if wd != 0:
            g = g + wd * p.data
        if mu != 0:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = backend.get_array_module(g).copy(g)   # an array of its own
            else:
                b = state["momentum_buffer"]
                b[...] = mu * b + (1 - tau) * g
            b = state["momentum_buffer"]
            g = g + mu * b if group["nesterov"] else b
        p.data -= lr * g


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015), PyTorch semantics: weight decay is an L2 penalty added to the gradient.
    For each parameter p with gradient g, at step t = 1, 2, ...:

        g <- g + lambda p                               (only when weight_decay = lambda > 0)
        m <- beta1 m + (1 - beta1) g                    (first moment, m_0 = 0)
        v <- beta2 v + (1 - beta2) g^2                  (second moment, v_0 = 0)
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    The last line is the paper's p <- p - lr m_hat / (sqrt(v_hat) + eps) with the bias-corrected
    moments m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t) folded, as PyTorch folds them, into
    a step size lr / (1 - beta1^t) and a divisor sqrt(1 - beta2^t): PyTorch's numbers (to rounding),
    and those of the kernels, which repeat these operations in this order (kernels/cpu/optim.py in
    place and among threads, kernels/cuda/optim.py in one launch: both bit for bit).
    """

    _decoupled = False          # AdamW: True (kernels/cpu/optim.py and kernels/cuda/optim.py read it)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _check_hyperparameters(self, group):
        super()._check_hyperparameters(group)
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must be in [0, 1), got {group['betas']}")
        if group["eps"] < 0:
            raise ValueError(f"{type(self).__name__}: invalid eps {group['eps']}")

    def _update(self, p, g, state, group):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        xp = backend.get_array_module(p.data)
        if not state:
            state.update(step=0, exp_avg=xp.zeros_like(p.data), exp_avg_sq=xp.zeros_like(p.data))
        state["step"] = t = state["step"] + 1              # a Python int: no device round trip
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if wd != 0 and self._decoupled:
            p.data *= 1 - lr * wd                         # AdamW: p <- p - lr lambda p
        elif wd != 0:
            g = g + wd * p.data                           # Adam: the L2 penalty's gradient
        m[...] = b1 * m + (1 - b1) * g                    # [...]: into the state's own arrays
        v[...] = b2 * v + (1 - b2) * (g * g)
        p.data -= lr / (1 - b1 ** t) * (m / (xp.sqrt(v) / math.sqrt(1 - b2 ** t) + eps))


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019; PyTorch's AdamW). At each step,
    before the Adam update of ``Adam`` (which then sees no L2 term):

        p <- p - lr lambda p
    """

    _decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# Position embeddings of every kind (learned 1-D, the 2-D row and column tables, the relative tables
# of each block) and the class token: no weight decay, as timm's no_weight_decay() names them.
NO_WEIGHT_DECAY = ("cls_token", "pos_embed", "pos_embed_row", "pos_embed_col", "rel_pos", "dist_token")


def param_groups_weight_decay(model, weight_decay: float, skip=NO_WEIGHT_DECAY):
    """Two parameter groups, as timm: [{"params": no_decay, "weight_decay": 0.0},
    {"params": decay, "weight_decay": weight_decay}]. No decay for biases and norm weights (every
    parameter with at most one axis) and for parameters named in ``skip`` (matched on the full dotted
    name or its last part, plus the names a model's ``no_weight_decay()`` method returns). Frozen
    parameters (requires_grad=False) are left out."""
    skip = set(skip)
    if hasattr(model, "no_weight_decay"):
        skip |= set(model.no_weight_decay())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or name in skip or name.rsplit(".", 1)[-1] in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


# ====================================================================== gradient clipping


def clip_grad_norm(parameters, max_norm: float):
    """Scale all gradients together so that their global L2 norm is at most ``max_norm`` (PyTorch's
    clip_grad_norm_). With ||g|| = sqrt(sum over parameters of sum(g^2)):

        g <- g * min(1, max_norm / (||g|| + 1e-6))

    The new gradients are new arrays (``p.grad = p.grad * c``): a gradient array may be shared.
    Returns ||g|| before clipping, still on the gradients' device (a 0-d CuPy array on a GPU, a NumPy
    scalar on the CPU): no GPU synchronisation here; ``float(norm)`` when you want the number."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return np.zeros((), dtype=backend.get_default_dtype())
    xp = backend.get_array_module(params[0].grad)
    norms = [xp.linalg.norm(p.grad.reshape(-1)) for p in params]
    total = xp.linalg.norm(xp.stack(norms))
    coef = xp.minimum(max_norm / (total + 1e-6), 1.0)
    for p in params:
        p.grad = p.grad * coef.astype(p.grad.dtype)
    return total


clip_grad_norm_ = clip_grad_norm  # PyTorch's name


# ====================================================================== learning-rate schedules


def _progress(step, total_steps, warmup_steps):
    """Fraction of the decay phase done at ``step``, clipped to [0, 1]."""
    return min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float = 0.0) -> float:
    """Linear warmup then cosine decay, as the official ViT code (appendix B.1):

        step < warmup:   lr = base_lr * step / warmup_steps
        after:           lr = min_lr + (base_lr - min_lr) * (1 + cos(pi * progress)) / 2,
                         progress = (step - warmup_steps) / (total_steps - warmup_steps), clipped to [0, 1]

    A pure function of the step, so resuming needs nothing but the step number."""
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * _progress(step, total_steps, warmup_steps)))


def warmup_linear(step: int, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float = 0.0) -> float:
    """Linear warmup then linear decay to ``min_lr`` at ``total_steps``:

        step < warmup:   lr = base_lr * step / warmup_steps
        after:           lr = min_lr + (base_lr - min_lr) * (1 - progress)   (progress as in warmup_cosine)
    """
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    return min_lr + (base_lr - min_lr) * (1.0 - _progress(step, total_steps, warmup_steps))


class LRScheduler:
    """Sets every group's learning rate from ``lr_fn(step)`` (times the group's "lr_scale", default 1,
    e.g. for layer-wise decay). The lr for step 0 is set at construction; call ``step()`` after each
    ``optimizer.step()``.

        sched = LRScheduler(opt, lambda s: warmup_cosine(s, 10_000, 500, base_lr=3e-3))
    """

    def __init__(self, optimizer: Optimizer, lr_fn, step: int = 0):
        self.optimizer, self.lr_fn = optimizer, lr_fn
        self.step_count = int(step)
        self._apply()

    def _apply(self):
        self.last_lr = float(self.lr_fn(self.step_count))
        for group in self.optimizer.param_groups:
            group["lr"] = self.last_lr * group.get("lr_scale", 1.0)

    def step(self) -> float:
        """Advance one step and set the new learning rate; returns it."""
        self.step_count += 1
        self._apply()
        return self.last_lr

    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step_count = int(state_dict["step"])
        self._apply()


# ====================================================================== weight averaging


class WeightEMA:
    """An exponential moving average of a model's parameters (Polyak averaging, as timm's ModelEmaV3):
    after every optimizer step t = 1, 2, ...

        theta_ema <- d_t theta_ema + (1 - d_t) theta,      d_t = min(decay, (1 + t) / (10 + t))

    The ramp d_t keeps a short run's average from being dominated by the random initialisation (after
    t steps the weights of the first ones have decayed by the product of the d's). Evaluated with
    theta_ema, a model sees its last ~1 / (1 - decay) steps' noise averaged out. The paper does not use
    it (its appendix evaluates the final weights); it is one of the small-data recipes' tools.

        ema = WeightEMA(model, decay=0.999)
        ... opt.step(); ema.update()
        with ema.applied():          # the model holds theta_ema inside the block
            evaluate(model, ...)
    """

    def __init__(self, model, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay} (e.g. 0.999; 0 turns the average off)")
        self.decay, self.step_count = float(decay), 0
        self.params = dict(model.named_parameters())
        self.average = {name: p.data.copy() for name, p in self.params.items()}    # on the parameters' device

    def update(self) -> None:
        """One step of the average, in place on the device (no host sync)."""
        self.step_count += 1
        d = min(self.decay, (1 + self.step_count) / (10 + self.step_count))
        for name, p in self.params.items():
            avg = self.average[name]
            avg *= d
            avg += (1.0 - d) * p.data

    def applied(self):
        """Context manager: inside it the model's parameters hold the average (arrays swapped, not
        copied), outside the trained weights again."""
        return _Swapped(self.params, self.average)

    def state_dict(self) -> dict:
        return {"step": self.step_count, **{f"ema.{name}": a for name, a in self.average.items()}}

    def load_state_dict(self, state: dict) -> None:
        missing = [name for name in self.average if f"ema.{name}" not in state]
        if missing:
            raise ValueError(f"EMA state lacks {len(missing)} parameters (e.g. {missing[0]}): not this model's")
        self.step_count = int(state["step"])
        for name, avg in self.average.items():
            avg[...] = backend.to_device(state[f"ema.{name}"], backend.device_of(avg))


class _Swapped:
    def __init__(self, params: dict, arrays: dict):
        self.params, self.arrays = params, arrays

    def __enter__(self):
        for name, p in self.params.items():
            p.data, self.arrays[name] = self.arrays[name], p.data

    def __exit__(self, *exc):
        self.__enter__()                     # swapping again puts both back
        return False
