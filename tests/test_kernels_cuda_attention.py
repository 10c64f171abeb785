"""kernels/cuda/attention.py (fused multi-head attention, CUDA) against ops/attention.py on the GPU:
the output, the attention map and the gradient of every input, on the same CuPy arrays, the
reference under use_kernels(False) and the kernels under use_kernels("all") (through
F.multi_head_attention, the switchboard), float64 and float32, odd batches and sequence lengths
(N = 1, 5, 17, 65, 197, 257: one tile of 32 keys or many, and ragged last ones), head sizes
1, 32, 48, 64, 80, 128, an upstream gradient on the output, on the output and the map, or on the
map alone, biases or none.

float64: rtol = atol = 1e-12 (measured on the CPU emulation of the kernels: 7e-15 of the scale).
float32: rtol 1e-4, atol 2e-5 times the array's largest magnitude. The kernels sum the logits,
softmax and products in other orders than cuBLAS and CuPy do (online softmax over tiles of 32 keys,
A from exp(S - logsumexp) rather than exp(S - max) / sum), and backward takes delta from
dctx . ctx rather than sum(dA * A); the CPU emulation measured at most 3e-6 of the scale.

The GPU tests carry the gpu mark (pytest -m gpu) and skip without a CUDA device. The tests at the
end (no mark) check the launch arithmetic and the compiled kernels' names on the CPU.
"""
import math
import re

import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.kernels import cuda as cuda_kernels, kernel_for, use_kernels
from tinyvit.kernels.cuda import attention as k_attention
from tinyvit.ops import attention as reference

from conftest import CUDA
from kernel_checks import F64, assert_same

OPS = ["multi_head_attention"]
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device with CuPy here (pip install 'tinyvit[gpu]')")

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-4, 2e-5)}
NAMES = ["x", "w_qkv", "b_qkv", "w_proj", "b_proj"]

# (B, N, heads, D_h)
CASES = [(3, 1, 2, 32), (5, 5, 3, 32), (3, 17, 4, 48), (3, 65, 3, 64), (3, 197, 2, 80), (1, 257, 2, 64),
         (1, 65, 1, 128), (2, 6, 4, 1)]


def arrays(rng, b, n, d):
    """x, w_qkv, b_qkv, w_proj, b_proj with weights ~ 1/sqrt(D), so that logits are of order 1-10
    (softmax neither uniform nor one-hot)."""
    s = 1.0 / math.sqrt(d)
    return [rng.standard_normal((b, n, d)), rng.standard_normal((d, 3 * d)) * 2 * s, rng.standard_normal(3 * d) * 0.1,
            rng.standard_normal((d, d)) * s, rng.standard_normal(d) * 0.1]


def upstream_for(rng, b, n, d, heads, m, outputs):
    """[g_out] or [g_out, g_attn], None for an output that gets no gradient; "sum" for sum(output)."""
    g_out, g_attn = rng.standard_normal((b, m, d)), rng.standard_normal((b, heads, m, n))
    return {"out": [g_out], "both": [g_out, g_attn], "map only": [None, g_attn], "sum": ["sum"]}[outputs]


def run(fn, arrays, upstream, dtype, wants_grad=None):
    """fn on CuPy Tensors of the host arrays in dtype (None stays None; wants_grad[i] False: a
    constant), then one backward of sum_k sum(upstream[k] * output_k) ("sum": sum(output_k), whose
    gradient arrives as a broadcast of ones). Returns host copies: (outputs, inputs' gradients)."""
    import cupy
    ins = [None if a is None else
           tv.Tensor(cupy.asarray(a, dtype=dtype), requires_grad=wants_grad is None or bool(wants_grad[i]))
           for i, a in enumerate(arrays)]
    outs = fn(*ins)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    terms = [o.sum() if isinstance(g, str) else (o * tv.Tensor(cupy.asarray(g, dtype=dtype))).sum()
             for o, g in zip(outs, upstream) if g is not None]
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    loss.backward()
    return ([o.data.get() for o in outs],
            [None if t is None or t.grad is None else t.grad.get() for t in ins])


def check(kernel_fn, reference_fn, arrays, upstream, dtype, wants_grad=None):
    """kernel_fn under use_kernels("all") and reference_fn under use_kernels(False) on the same
    inputs and upstream gradients: every output and input gradient the same within TOL[dtype]."""
    with use_kernels("all"):
        outs_k, grads_k = run(kernel_fn, arrays, upstream, dtype, wants_grad)
    with use_kernels(False):
        outs_r, grads_r = run(reference_fn, arrays, upstream, dtype, wants_grad)
    assert len(outs_k) == len(outs_r)
    name = np.dtype(dtype).name
    for i, (a, b) in enumerate(zip(outs_k, outs_r)):
        assert_same(a, b, *TOL[dtype], what=f"output {i} ({name})")
    for what, a, b in zip(NAMES, grads_k, grads_r):
        assert_same(a, b, *TOL[dtype], what=f"gradient of {what} ({name})")
    return outs_k, grads_k


def through_f(heads, return_attention=False, p=0.0, seed=3):
    """F.multi_head_attention (the switchboard's choice) after tinyvit.manual_seed(seed)."""
    def fn(*t):
        tv.manual_seed(seed)
        return F.multi_head_attention(*t, heads, p, p > 0, return_attention)
    return fn


def applied(function, heads, return_attention=False, p=0.0, seed=3, **extra):
    """function.apply directly (for num_outputs, which F does not take)."""
    def fn(*t):
        tv.manual_seed(seed)
        return function.apply(*t, heads, p, p > 0, return_attention=return_attention, **extra)
    return fn


# ---------------------------------------------------------------- GPU: equal to the reference


@pytest.mark.gpu
@needs_cuda
def test_the_switchboard_picks_the_cuda_kernel():
    """With use_kernels("all"), CuPy float32 and float64 arrays get kernels/cuda/attention.py's Function
    (so the comparisons below do test the kernels, not the reference twice)."""
    import cupy
    for dtype in (cupy.float32, cupy.float64):
        with use_kernels("all"):
            assert kernel_for("multi_head_attention", cupy.ones((2, 3, 4), dtype)) is k_attention.MultiHeadAttention
        with use_kernels(False):
            assert kernel_for("multi_head_attention", cupy.ones((2, 3, 4), dtype)) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("b,n,heads,dh", CASES)
@pytest.mark.parametrize("outputs", ["out", "both", "map only"])
def test_attention_equals_reference(dtype, b, n, heads, dh, outputs):
    """The "multi_head_attention" kernel: out, the attention map and the gradients of x, U_qkv, b_qkv,
    U_msa and b_proj equal the reference's, with an upstream gradient on the output, on the output
    and the map, or through the map alone (then U_msa and b_proj get none)."""
    rng = np.random.default_rng(b * n + dh)
    d = heads * dh
    ra = outputs != "out"
    _, grads = check(through_f(heads, ra), through_f(heads, ra), arrays(rng, b, n, d),
                     upstream_for(rng, b, n, d, heads, n, outputs), dtype)
    if outputs == "map only":
        assert grads[3] is None and grads[4] is None and grads[0] is not None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("b,n,heads,dh", [CASES[1], CASES[3], CASES[4]])
@pytest.mark.parametrize("outputs", ["out", "map only", "sum"])
def test_attention_without_biases_equals_reference(dtype, b, n, heads, dh, outputs):
    """b_qkv = b_proj = None; and an upstream gradient that is a broadcast of ones (sum(out))."""
    rng = np.random.default_rng(n)
    d = heads * dh
    data = arrays(rng, b, n, d)
    data[2] = data[4] = None
    ra = outputs == "map only"
    check(through_f(heads, ra), through_f(heads, ra), data, upstream_for(rng, b, n, d, heads, n, outputs), dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("which", range(6))
def test_attention_one_input_at_a_time_equals_reference(dtype, which):
    """Only some inputs want a gradient: each one alone, then the weights with x a constant."""
    rng = np.random.default_rng(which)
    b, n, heads, dh = 3, 37, 2, 32
    wants = [int(i == which) for i in range(5)] if which < 5 else [0, 1, 1, 1, 1]
    check(through_f(heads, True), through_f(heads, True), arrays(rng, b, n, heads * dh),
          upstream_for(rng, b, n, heads * dh, heads, n, "both"), dtype, wants_grad=wants)


def first_rows(function, heads, m, return_attention, p=0.0):
    """The reference's full attention, cut to its first m tokens' outputs (and attention rows)."""
    full = applied(function, heads, return_attention, p)

    def fn(*t):
        out = full(*t)
        if return_attention:
            return out[0][:, :m], out[1][:, :, :m]
        return out[:, :m]
    return fn


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("outputs", ["out", "both", "map only"])
def test_fewer_outputs_equal_the_first_rows_of_the_reference(dtype, m, outputs):
    """num_outputs=M < N (q from the first M tokens, every token a key and value): out (B, M, D),
    attn (B, H, M, N) and every input's gradient equal the first M rows of the reference's."""
    b, n, heads, dh = 3, 65, 2, 64
    rng = np.random.default_rng(m)
    ra = outputs != "out"
    outs, _ = check(applied(k_attention.MultiHeadAttention, heads, ra, num_outputs=m),
                    first_rows(reference.MultiHeadAttention, heads, m, ra), arrays(rng, b, n, heads * dh),
                    upstream_for(rng, b, n, heads * dh, heads, m, outputs), dtype)
    assert outs[0].shape == (b, m, heads * dh)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("m", [None, 3])
def test_attention_dropout_runs_the_reference(dtype, m):
    """Training with attn_dropout > 0 is left to the reference (the same seeded mask): the same
    numbers bit for bit, also cut to num_outputs rows."""
    b, n, heads, dh = 3, 9, 2, 16
    rng = np.random.default_rng(1)
    data, up = arrays(rng, b, n, heads * dh), upstream_for(rng, b, n, heads * dh, heads, m or n, "both")
    extra = {} if m is None else {"num_outputs": m}
    want_fn = (applied(reference.MultiHeadAttention, heads, True, 0.3) if m is None
               else first_rows(reference.MultiHeadAttention, heads, m, True, 0.3))
    got = run(applied(k_attention.MultiHeadAttention, heads, True, 0.3, **extra), data, up, dtype)
    want = run(want_fn, data, up, dtype)
    for a, b_ in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_array_equal(a, b_)


@pytest.mark.gpu
@needs_cuda
def test_large_logits_stay_finite():
    """Logits past +-100 (exp overflows float32 past 88): the online softmax subtracts the running
    max, so the float32 kernels' output, map and gradients are finite and equal the float64
    reference's to float32's precision at that scale."""
    rng = np.random.default_rng(2)
    b, n, heads, dh = 2, 70, 2, 32
    d = heads * dh
    data = arrays(rng, b, n, d)
    data[0] = data[0] * 3.0
    q = (data[0] @ data[1][:, :d]).reshape(b, n, heads, dh)
    k = (data[0] @ data[1][:, d:2 * d]).reshape(b, n, heads, dh)
    assert np.abs(np.einsum("bihc,bjhc->bhij", q, k)).max() / math.sqrt(dh) > 100
    up = upstream_for(rng, b, n, d, heads, n, "both")
    with use_kernels("all"):
        outs, grads = run(through_f(heads, True), data, up, np.float32)
    with use_kernels(False):
        outs64, grads64 = run(through_f(heads, True), data, up, np.float64)
    for a, b_ in zip(outs + grads, outs64 + grads64):
        assert np.isfinite(a).all()
        scale = max(1.0, float(np.abs(b_).max()))
        np.testing.assert_allclose(a, b_, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_inference_equals_reference(dtype):
    """Under no_grad (nothing saved, no logsumexp kept for a backward), out and attn equal the reference's."""
    import cupy
    rng = np.random.default_rng(4)
    data = [cupy.asarray(a, dtype=dtype) for a in arrays(rng, 5, 197, 3 * 64)]
    with tv.no_grad():
        with use_kernels("all"):
            got = F.multi_head_attention(*data, 3, return_attention=True)
        with use_kernels(False):
            want = F.multi_head_attention(*data, 3, return_attention=True)
    for a, b in zip(got, want):
        assert_same(a.data.get(), b.data.get(), *TOL[dtype], what="inference")


# ---------------------------------------------------------------- CPU: launch arithmetic, names


def test_source_constants_match_python():
    """SOURCE's block shape (its constexpr ints) is the one the launcher sizes grids and shared memory by."""
    values = {}
    for name, expression in re.findall(r"constexpr int (\w+) = ([\w *+/]+);", k_attention.SOURCE):
        values[name] = eval(expression, {}, dict(values))         # e.g. BLOCK_ROWS = WARPS * ROWS
    for name in ("WARP", "WARPS", "ROWS", "BLOCK_ROWS", "TILE", "MAX_HEAD_DIM", "DELTA_WARPS"):
        assert values[name] == getattr(k_attention, name), name


@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("dh", [1, 32, 48, 64, 80, 128])
def test_launch_config_covers_every_row_within_the_limits(itemsize, dh):
    """For ViT's sizes and beyond (N up to 577, B*H up to 4096 x 16): the tiled kernels' grid is
    (B*H, blocks covering the M queries, or the N keys for dkdv, with no empty block), y within
    CUDA's 65535; attention_delta's warps cover the B*H*M rows; 128 or 256 threads; shared memory
    within an A100's opt-in limit (163 KB), and within the default 48 KB for float32 heads up to 64."""
    for b, h, m, n in [(1, 1, 1, 1), (3, 2, 5, 5), (128, 12, 197, 197), (4096, 16, 577, 577), (7, 3, 1, 65)]:
        for name in k_attention.KERNEL_NAMES:
            grid, block, shared = k_attention.launch_config(name, b, h, m, n, dh, itemsize)
            if name == "attention_delta":
                rows = b * h * m
                assert grid[0] * k_attention.DELTA_WARPS >= rows > (grid[0] - 1) * k_attention.DELTA_WARPS
                assert block == (256,) and shared == 0
                continue
            rows = n if name == "attention_backward_dkdv" else m
            assert grid[0] == b * h and grid[1] <= k_attention.MAX_GRID_Y
            assert grid[1] * k_attention.BLOCK_ROWS >= rows > (grid[1] - 1) * k_attention.BLOCK_ROWS
            assert block == (128,)
            assert shared <= 166912, (name, dh, itemsize, shared)
            if itemsize == 4 and dh <= 64:
                assert shared <= k_attention.STATIC_SHARED_LIMIT, (name, dh, shared)


def test_shared_bytes_by_hand():
    """The arrays each kernel's comment lists, counted by hand for D_h = 64 (rows padded to 65)."""
    f32 = {"attention_forward": (16 * 64 + 32 * 65 + 32 * 64) * 4,       # qs, ks, vs
           "attention_probabilities": (16 * 64 + 32 * 65) * 4,            # qs, ks
           "attention_delta": 0,
           "attention_backward_dq": (2 * 16 * 64 + 2 * 32 * 65) * 4,      # qs, dos, ks, vs
           "attention_backward_dkdv": (2 * 16 * 64 + 2 * 32 * 65 + 2 * 32) * 4}  # kb, vb, qs, dos, L, delta
    for name, want in f32.items():
        assert k_attention.shared_bytes(name, 64, 4) == want, name
        assert k_attention.shared_bytes(name, 64, 8) == 2 * want, name


def test_kernels_fit():
    """Heads beyond MAX_HEAD_DIM, or shared memory beyond the device's limit, go to the reference."""
    assert k_attention.kernels_fit(128, 8, 166912)          # A100, float64, D_h = 128: 97 KB
    assert not k_attention.kernels_fit(128, 8, 65536)       # a 64 KB GPU (T4) cannot hold that
    assert k_attention.kernels_fit(64, 4, 49152)
    assert not k_attention.kernels_fit(129, 4, 1 << 20)
    assert not k_attention.kernels_fit(0, 4, 1 << 20)


@pytest.mark.parametrize("arch", cuda_kernels.SM_ARCHS)
def test_every_launched_kernel_is_compiled(arch):
    """Each name the launcher asks for (every kernel, _f32 and _f64, the tiled ones in each head-size
    class) is a kernel of SOURCE's CUBIN."""
    from test_kernels_cuda_compile import _nvrtc, compile_source
    cubin = compile_source(_nvrtc(), k_attention.SOURCE, "attention", arch)
    names = k_attention.entry_names()
    assert len(names) == 2 * (3 * len(k_attention.HEAD_CLASSES) + 2)
    for name in names:
        assert name.encode() in cubin, name


@pytest.mark.parametrize("dh,size", [(1, 32), (32, 32), (33, 64), (48, 64), (64, 64), (65, 128), (128, 128)])
def test_each_head_size_runs_in_its_class(dh, size):
    """A head of dh columns runs the tiled kernels compiled for the smallest class that holds it, so a
    lane keeps size / 32 columns: none for a head of 32 or 64 multiplies padding."""
    assert k_attention.head_class(dh) == size
    assert k_attention.entry_name("attention_forward", np.float32, dh) == f"attention_forward_d{size}_f32"
    assert k_attention.entry_name("attention_delta", np.float64, dh) == "attention_delta_f64"
    with pytest.raises(ValueError, match="beyond MAX_HEAD_DIM"):
        k_attention.head_class(129)


def test_loads_do_not_divide_per_element():
    """The tiled kernels find a loaded element's row and column by warp and lane, not by dividing its
    index by dh: one integer division in each (b = bh / heads, once per thread), where the loads
    divided per element before (3 to 5 divisions and remainders in each kernel's PTX)."""
    from cuda_checks import ptx_by_entry
    for name, ptx in ptx_by_entry(k_attention.SOURCE).items():
        if "delta" not in name:
            divisions = re.findall(r"\b(?:div|rem)\.[su](?:32|64)", ptx)
            assert len(divisions) == 1, (name, divisions)
