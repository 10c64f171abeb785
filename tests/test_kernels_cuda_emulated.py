"""The CUDA C++ of every kernels/cuda module, run on the CPU (tests/cuda_emulator: g++ against a shim
that gives each CUDA thread an OS thread, __syncthreads a barrier, warp shuffles an exchange) and
compared with the reference ops: outputs and every input's gradient, in float64 (rtol 1e-10, atol
1e-12) and float32 (rtol 2e-5, atol 2e-6; atol relative to max(1, max |reference|)), on tiny shapes
and on shapes of several tiles; the AdamW step bit for bit; the edge inputs (strided parameters,
no samples, weights of another dtype, labels out of range). The Functions of kernels/cuda get NumPy
arrays, their `kernel` replaced by the emulator's (which also checks each launch's argument types
against the C parameters, the grid and block limits and the shared-memory opt-in), their
get_array_module by a NumPy whose empty() is NaN-filled, so an output element no kernel writes fails
the comparison. The emulator's own checks (and that a broken kernel fails) are tests/test_cuda_emulator.py.

This proves the kernels' arithmetic, indexing and synchronisation structure without a GPU; not their
speed, nor the last ulp a GPU's math functions give (float32 tolerance), nor races that only real
warp scheduling would expose (see tests/cuda_emulator/emulator.py; a ThreadSanitizer build finds
more: tests/cuda_emulator/sanitize.py). The GPU tests (`pytest -m gpu`, tests/test_kernels_cuda_*.py)
remain the proof on hardware.
"""
import collections
import gc
import weakref

import numpy as np
import pytest
from cuda_emulator.harness import DTYPES, TOL, compare, emulate, libraries  # noqa: F401 (fixtures)

import tinyvit as tv
from tinyvit import nn, optim
from tinyvit.kernels import use_kernels
from tinyvit.kernels.cuda import attention as k_attention
from tinyvit.kernels.cuda import gelu as k_gelu
from tinyvit.kernels.cuda import layernorm as k_layernorm
from tinyvit.kernels.cuda import loss as k_loss
from tinyvit.kernels.cuda import optim as k_optim
from tinyvit.ops import activation, attention, loss, norm

# attention at heads of 64-128 and several tiles: float32 sums over 128 columns and 70 keys in other
# orders than the reference's GEMMs (test_kernels_cuda_attention.py's tolerance on the GPU)
ATTENTION_TOL = {np.float64: TOL[np.float64], np.float32: (1e-4, 2e-5)}


# ---------------------------------------------------------------- layernorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (9, 1)])
def test_layernorm(emulate, dtype, shape):
    """Rows of 7 elements, and of one (x_hat = 0 and rstd = 1/sqrt(eps) = 316: dL/dx = rstd (g - mean(g))
    must come out exactly 0, which a fused g * gamma - mean(g) does not give: the H100's first run)."""
    run = emulate("layernorm")
    rng = np.random.default_rng(0)
    d = shape[-1]
    x, gamma, beta = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(d), rng.standard_normal(d)
    compare(lambda *t: k_layernorm.LayerNorm.apply(*t, 1e-5), lambda *t: norm.LayerNorm.apply(*t, 1e-5),
            [x, gamma, beta], [rng.standard_normal(shape)], dtype, f"LayerNorm {shape}")
    assert {name for name, *_ in run.log} >= {f"{k}_{'f64' if dtype == np.float64 else 'f32'}" for k in
                                              ("layer_norm_forward", "layer_norm_backward_dx",
                                               "layer_norm_param_grads", "sum_chunks")}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 7), (9, 1)])
def test_add_layernorm(emulate, dtype, shape):
    emulate("layernorm")
    rng = np.random.default_rng(1)
    d = shape[-1]
    data = [rng.standard_normal(shape), rng.standard_normal(shape), rng.standard_normal(d), rng.standard_normal(d)]

    def reference(x, branch, gamma, beta):
        s = x + branch
        return s, norm.LayerNorm.apply(s, gamma, beta, 1e-6)

    compare(lambda *t: k_layernorm.AddLayerNorm.apply(*t, 1e-6), reference, data,
            [rng.standard_normal(shape), rng.standard_normal(shape)], dtype, f"AddLayerNorm {shape}")


# ---------------------------------------------------------------- gelu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["GELU", "GELUTanh"])
def test_gelu(emulate, kind, dtype):
    run = emulate("gelu")
    kernel_op, reference_op = getattr(k_gelu, kind), getattr(activation, kind)
    rng = np.random.default_rng(2)
    x, b, gy = rng.standard_normal((3, 7)) * 3, rng.standard_normal(7), rng.standard_normal((3, 7))
    compare(lambda x: kernel_op.apply(x), lambda x: reference_op.apply(x), [x], [gy], dtype, kind)
    compare(lambda x, b: kernel_op.apply(x, b), lambda x, b: reference_op.apply(x + b), [x, b], [gy], dtype,
            f"{kind} with bias")
    assert len(run.log) == 2 and all(name.startswith(kernel_op._kernel) for name, *_ in run.log), run.log


# ---------------------------------------------------------------- attention


def _attend(function, heads, return_attention, m=None):
    """function.apply with heads, no dropout; m: the kernel's num_outputs, or the reference's first m
    rows of its outputs (the reference has no num_outputs)."""
    kernel = function is k_attention.MultiHeadAttention

    def fn(*t):
        extra = {"num_outputs": m} if kernel and m is not None else {}
        out = function.apply(*t, heads, 0.0, False, return_attention=return_attention, **extra)
        if m is not None and not kernel:
            return (out[0][:, :m], out[1][:, :, :m]) if return_attention else out[:, :m]
        return out
    return fn


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(emulate, dtype):
    """B=2, N=5, D=16, 2 heads: the output alone, with the attention map, and num_outputs M=2."""
    run = emulate("attention")
    rng = np.random.default_rng(3)
    b, n, d, h = 2, 5, 16, 2
    s = d ** -0.5
    data = [rng.standard_normal((b, n, d)), rng.standard_normal((d, 3 * d)) * 2 * s,
            rng.standard_normal(3 * d) * 0.1, rng.standard_normal((d, d)) * s, rng.standard_normal(d) * 0.1]
    g_out, g_attn = rng.standard_normal((b, n, d)), rng.standard_normal((b, h, n, n))
    compare(_attend(k_attention.MultiHeadAttention, h, False), _attend(attention.MultiHeadAttention, h, False),
            data, [g_out], dtype, "MultiHeadAttention")
    compare(_attend(k_attention.MultiHeadAttention, h, True), _attend(attention.MultiHeadAttention, h, True),
            data, [g_out, g_attn], dtype, "MultiHeadAttention return_attention")
    compare(_attend(k_attention.MultiHeadAttention, h, True, 2), _attend(attention.MultiHeadAttention, h, True, 2),
            data, [g_out[:, :2], g_attn[:, :, :2]], dtype, "MultiHeadAttention num_outputs=2")
    launched = {name for name, *_ in run.log}            # every kernel, the tiled ones for heads <= 32
    assert launched == {k_attention.entry_name(k, dtype, d // h) for k in k_attention.KERNEL_NAMES}, launched
    assert "attention_forward_d32_" + ("f32" if dtype == np.float32 else "f64") in launched


# every (N, D_h) in float64; in float32 (the arithmetic is the same template) two of them
SEVERAL_TILES = [(n, dh, np.float64) for n in (40, 70) for dh in (33, 64, 128)] + [(70, 64, np.float32),
                                                                                  (40, 128, np.float32)]


@pytest.mark.parametrize("n,dh,dtype", SEVERAL_TILES,
                         ids=[f"N{n}-dh{dh}-{np.dtype(t).name}" for n, dh, t in SEVERAL_TILES])
def test_attention_over_several_tiles(emulate, dtype, n, dh):
    """Shapes the small test above does not reach: N = 40 and 70 (two and three tiles of 32 keys, the
    last ragged; three and five blocks of 16 queries), head sizes 33 (a ragged column group, in the
    class of 64), 64 and 128 (the largest, past 48 KB of shared memory in float64), with the attention
    map and its gradient, all N queries and, at N = 70 (heads of 64 and 128), fewer (M = 17 < N: more
    key tiles than query blocks in dkdv)."""
    run = emulate("attention")
    rng = np.random.default_rng(n + dh)
    b, h = 1, 2 if dh == 33 else 1              # two heads: q, k, v of head 1 at column offsets 33, 66, 99
    d = h * dh
    s = d ** -0.5
    data = [rng.standard_normal((b, n, d)), rng.standard_normal((d, 3 * d)) * 2 * s,
            rng.standard_normal(3 * d) * 0.1, rng.standard_normal((d, d)) * s, rng.standard_normal(d) * 0.1]
    g_out, g_attn = rng.standard_normal((b, n, d)), rng.standard_normal((b, h, n, n))
    compare(_attend(k_attention.MultiHeadAttention, h, True), _attend(attention.MultiHeadAttention, h, True),
            data, [g_out, g_attn], dtype, f"MultiHeadAttention N={n} dh={dh}", ATTENTION_TOL)
    if n == 70 and dh != 33:
        m = 17
        compare(_attend(k_attention.MultiHeadAttention, h, False, m),
                _attend(attention.MultiHeadAttention, h, False, m), data, [g_out[:, :m]], dtype,
                f"MultiHeadAttention N={n} dh={dh} num_outputs={m}", ATTENTION_TOL)
    launched = {name for name, *_ in run.log}            # the tiled kernels of dh's class: 64 for 33
    assert launched == {k_attention.entry_name(k, dtype, dh) for k in k_attention.KERNEL_NAMES}, launched
    assert f"attention_forward_d{64 if dh == 33 else dh}_{'f32' if dtype == np.float32 else 'f64'}" in launched


# ---------------------------------------------------------------- loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(emulate, dtype):
    """Integer labels and probabilities (whose gradient is wanted too), with and without smoothing."""
    emulation = emulate("loss")
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((2, 3, 10)) * 3
    labels = rng.integers(0, 10, size=(2, 3))
    p = rng.random((2, 3, 10))
    probs = p / p.sum(-1, keepdims=True)
    for eps in (0.0, 0.1):
        def run(function, eps=eps):
            def fn(x, *target):
                return function.apply(x, target[0] if target else tv.Tensor(labels), eps)
            return fn
        compare(run(k_loss.CrossEntropy), run(loss.CrossEntropy), [logits], [2.5], dtype,
                f"CrossEntropy labels eps={eps}")
        compare(run(k_loss.CrossEntropy), run(loss.CrossEntropy), [logits, probs], [2.5], dtype,
                f"CrossEntropy probabilities eps={eps}")
    launched = [name.rsplit("_", 1)[0] for name, *_ in emulation.log]
    assert launched == ["cross_entropy_forward", "cross_entropy_backward"] * 4, launched


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_of_many_classes(emulate, dtype):
    """K = 1000 (ImageNet's classes): 8 warps per row, whose maxima and sums meet in shared memory
    (block_max, block_sum) before the last warp-level reduction."""
    emulation = emulate("loss")
    rng = np.random.default_rng(9)
    logits, labels = rng.standard_normal((5, 1000)) * 3, rng.integers(0, 1000, size=5)
    p = rng.random((5, 1000))
    for eps in (0.0, 0.1):
        compare(lambda x: k_loss.CrossEntropy.apply(x, tv.Tensor(labels), eps),
                lambda x: loss.CrossEntropy.apply(x, tv.Tensor(labels), eps), [logits], [2.5], dtype,
                f"CrossEntropy K=1000 labels eps={eps}")
    compare(lambda x, t: k_loss.CrossEntropy.apply(x, t, 0.1), lambda x, t: loss.CrossEntropy.apply(x, t, 0.1),
            [logits, p / p.sum(-1, keepdims=True)], [2.5], dtype, "CrossEntropy K=1000 probabilities")
    assert {block for _, _, block, _ in emulation.log} == {(256, 1, 1)}, emulation.log


# ---------------------------------------------------------------- edge inputs


@pytest.mark.parametrize("kind", ["LayerNorm", "GELU"])
def test_strided_parameters_are_read_as_laid_out(emulate, kind):
    """gamma, beta (LayerNorm) and the bias (GELU) as strided views (every other element of a longer
    array): the kernels index them as contiguous arrays, so they must get contiguous copies (the
    emulated launch refuses a pointer to a non-contiguous array, as CuPy would pass it unchecked)."""
    emulate("layernorm" if kind == "LayerNorm" else "gelu")
    rng = np.random.default_rng(10)
    x, gy = rng.standard_normal((3, 7)), rng.standard_normal((3, 7))
    params = [rng.standard_normal(14)[::2], rng.standard_normal(14)[::2]]
    assert not params[0].flags.c_contiguous

    def run(function):
        ins = [tv.Tensor(x, requires_grad=True)] + [tv.Tensor(a, requires_grad=True) for a in params]
        out = function(*ins)
        out.backward(gy)
        return [out.data] + [t.grad for t in ins]

    if kind == "LayerNorm":
        got = run(lambda x, g, b: k_layernorm.LayerNorm.apply(x, g, b, 1e-5))
        want = run(lambda x, g, b: norm.LayerNorm.apply(x, g, b, 1e-5))
    else:
        got = run(lambda x, b, _: k_gelu.GELU.apply(x, b))[:3]
        want = run(lambda x, b, _: activation.GELU.apply(x + b))[:3]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("return_attention", [False, True])
def test_attention_of_no_samples(emulate, return_attention):
    """B = 0: empty outputs, an empty dL/dx and zero weight gradients (the reference's), and no kernel
    launched (CUDA refuses a grid with no blocks)."""
    run = emulate("attention")
    rng = np.random.default_rng(11)
    d, h = 16, 2
    x = tv.Tensor(np.zeros((0, 5, d)), requires_grad=True)
    ws = [tv.Tensor(rng.standard_normal(s), requires_grad=True) for s in [(d, 3 * d), (3 * d,), (d, d), (d,)]]
    out = k_attention.MultiHeadAttention.apply(x, *ws, h, 0.0, False, return_attention=return_attention)
    outs = out if return_attention else (out,)
    assert [o.shape for o in outs] == [(0, 5, d), (0, h, 5, 5)][:len(outs)]
    loss = outs[0].sum() + (outs[1].sum() if return_attention else 0.0)
    loss.backward()
    assert x.grad.shape == (0, 5, d)
    for w in ws:
        np.testing.assert_array_equal(w.grad, np.zeros(w.shape))
    assert run.log == []


def test_attention_refuses_weights_of_another_dtype(emulate):
    """x float32 with float64 weights: refused with a TypeError before anything launches (the kernels
    read every array as x's dtype)."""
    run = emulate("attention")
    rng = np.random.default_rng(12)
    d = 16
    x = rng.standard_normal((2, 5, d)).astype(np.float32)
    ws = [rng.standard_normal(s) for s in [(d, 3 * d), (3 * d,), (d, d), (d,)]]
    for i in range(4):
        mixed = [w.astype(np.float32) for w in ws]
        mixed[i] = ws[i]
        with pytest.raises(TypeError, match=["w_qkv", "b_qkv", "w_proj", "b_proj"][i] + " is float64, x is float32"):
            k_attention.MultiHeadAttention.apply(tv.Tensor(x), *map(tv.Tensor, mixed), 2)
    assert run.log == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_range_labels_give_nan_rows(emulate, dtype):
    """Labels outside [0, K), which only the check_labels=False path lets through: such a row's loss
    (so the mean) and its row of dL/dlogits are NaN, and nothing is read from another row or past the
    logits (labels K and -1, the last row's label far past the buffer); the other rows' gradients are
    the reference's."""
    emulate("loss")
    rng = np.random.default_rng(13)
    k = 10
    logits = rng.standard_normal((4, k)).astype(dtype)
    labels = np.array([3, k, -1, 1000])
    x = tv.Tensor(logits, requires_grad=True)
    value = k_loss.CrossEntropy.apply(x, tv.Tensor(labels), 0.1)
    value.backward()
    assert np.isnan(value.data)
    assert np.isnan(x.grad[1:]).all() and np.isfinite(x.grad[0]).all()
    xr = tv.Tensor(logits, requires_grad=True)
    loss.CrossEntropy.apply(xr, tv.Tensor(np.array([3, 0, 0, 0])), 0.1).backward()
    np.testing.assert_allclose(x.grad[0], xr.grad[0], rtol=TOL[dtype][0], atol=TOL[dtype][1])


# ---------------------------------------------------------------- optim

SHAPES = [(3, 5), (7,), (2100,), (4,)]          # 2100: two blocks of ELEMENTS_PER_BLOCK, the last ragged


def _adamw_steps(dtype, fused):
    """Two AdamW steps on parameters of SHAPES in two groups, the last parameter without gradient:
    by kernels/cuda/optim.step (fused) or by the plain loop; host copies of parameters and moments."""
    rng = np.random.default_rng(5)
    ps = [nn.Parameter(rng.standard_normal(s).astype(dtype)) for s in SHAPES]
    opt = optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.0}],
                      lr=0.01, weight_decay=0.1)
    for _ in range(2):
        for p in ps[:-1]:
            p.grad = rng.standard_normal(p.shape).astype(dtype)
        if fused:
            items = [(p, p.grad, opt._state_of(p), group) for group in opt.param_groups
                     for p in group["params"] if p.grad is not None]
            k_optim.step(items, opt._update)
        else:
            with use_kernels(False):
                opt.step()
    states = [opt.state.get(id(p), {}) for p in ps]
    return [p.data.copy() for p in ps], [{k: np.copy(v) for k, v in s.items()} for s in states]


@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw_step(emulate, dtype):
    """The multi-tensor AdamW step equals the plain loop bit for bit (both round each operation once)."""
    run = emulate("optim")
    got, got_state = _adamw_steps(dtype, fused=True)
    want, want_state = _adamw_steps(dtype, fused=False)
    assert len(run.log) == 2 and run.log[0][1] == (4, 1, 1), run.log
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b, err_msg=f"parameter {i}")
    for i, (a, b) in enumerate(zip(got_state, want_state)):
        assert a.keys() == b.keys(), i
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"state {i} {key}")
    print(f"AdamW {np.dtype(dtype).name}: bit for bit")


def test_the_adamw_table_lives_until_the_kernel_has_read_it(emulate, monkeypatch):
    """The launch is asynchronous: the table of parameter records (host records and their device
    copy, which under CUPY_ENABLE_UMP=1 may be the host memory itself, as it is for NumPy here) is
    held until an event recorded after the launch has completed, and let go at a later step."""
    emulate("optim")

    class Event:                                         # a launch that is still running until told
        done = False

    events = []
    monkeypatch.setattr(k_optim, "_completion_event", lambda *_: events.append(Event()) or events[-1],
                        raising=False)
    monkeypatch.setattr(k_optim, "_in_flight", collections.deque(), raising=False)
    tables = []
    launch = k_optim._launch

    def spy(name, dtype, grid, block, args):
        tables.append(weakref.ref(args[0]))
        launch(name, dtype, grid, block, args)

    monkeypatch.setattr(k_optim, "_launch", spy)
    rng = np.random.default_rng(14)
    ps = [nn.Parameter(rng.standard_normal(s)) for s in [(3, 5), (7,)]]
    opt = optim.AdamW(ps, lr=0.01)

    def step():
        for p in ps:
            p.grad = rng.standard_normal(p.shape)
        k_optim.step([(p, p.grad, opt._state_of(p), opt.param_groups[0]) for p in ps], opt._update)
        gc.collect()

    step()
    assert len(tables) == 1 and tables[0]() is not None, "the table was freed while the kernel may read it"
    events[0].done = True
    step()
    assert tables[0]() is None and tables[1]() is not None      # the finished launch's table let go
