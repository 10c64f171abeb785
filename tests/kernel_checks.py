"""What the kernel test files (test_kernels_cpu*.py) share: the kernel a name stands for, the small
block sizes, one forward and backward with given upstream gradients, and the comparison of a
kernel with its reference. The fixtures small_blocks and num_threads are in conftest.py."""
import numpy as np

import tinyvit as tv
from tinyvit.kernels import kernel_for, use_kernels

def cpu_kernel(name):
    """The kernel that CPU_KERNELS names for op ``name``: what the switchboard picks for NumPy floats."""
    with use_kernels(True):
        kernel = kernel_for(name, np.zeros(1))
    assert kernel is not None, f"no CPU kernel for {name!r}"
    return kernel


SMALL_BLOCK = 64          # elements per block: rows of up to 64 elements, several rows per block for D <= 32
SMALL_SAMPLES = 2         # attention samples per block: a batch of 5 is blocks of 2, 2, 1


def forward_backward(fn, arrays, upstream, dtype, wants_grad=None):
    """Run fn on Tensors made from ``arrays`` in ``dtype`` (None stays None; wants_grad[i] False: input
    i is a constant), then one backward of sum_k sum(upstream[k] * output_k) over the outputs whose
    upstream is not None (so each used output receives exactly upstream[k], an unused one None);
    upstream[k] = "sum" takes sum(output_k), whose gradient arrives as a read-only broadcast of 1.
    Returns (the outputs' arrays, each input's gradient or None)."""
    ins = [None if a is None else
           tv.Tensor(np.array(a, dtype=dtype), requires_grad=wants_grad is None or bool(wants_grad[i]))
           for i, a in enumerate(arrays)]
    outs = fn(*ins)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    assert len(upstream) == len(outs), f"{len(outs)} outputs, {len(upstream)} upstream gradients"
    terms = [o.sum() if isinstance(g, str) and g == "sum" else (o * tv.Tensor(np.asarray(g, dtype=dtype))).sum()
             for o, g in zip(outs, upstream) if g is not None]
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    loss.backward()
    return [o.data for o in outs], [None if t is None else t.grad for t in ins]


F64 = dict(rtol=1e-12, atol=1e-12)


def assert_same(got, want, rtol, atol, what):
    """Arrays of one shape and dtype with |got - want| <= rtol |want| + atol max(1, max |want|) (atol
    is relative to the array's scale: a sum that cancels to ~0 is compared at the size of its terms),
    or both None."""
    if want is None or got is None:
        assert got is None and want is None, f"{what}: {'kernel' if got is None else 'reference'} gave None"
        return
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)


def assert_kernel_equals_reference(kernel_fn, reference_fn, arrays, upstream, dtype, tol, wants_grad=None,
                                   names=None):
    """kernel_fn and reference_fn on the same inputs and upstream gradients (forward_backward): every
    output and every input's gradient the same within tol (rtol, atol of assert_same)."""
    outs_k, grads_k = forward_backward(kernel_fn, arrays, upstream, dtype, wants_grad)
    outs_r, grads_r = forward_backward(reference_fn, arrays, upstream, dtype, wants_grad)
    names = names or [f"input {i}" for i in range(len(arrays))]
    assert len(outs_k) == len(outs_r), f"the kernel gave {len(outs_k)} outputs, the reference {len(outs_r)}"
    for i, (a, b) in enumerate(zip(outs_k, outs_r)):
        assert_same(a, b, *tol, what=f"output {i} ({np.dtype(dtype).name})")
    for name, a, b in zip(names, grads_k, grads_r):
        assert_same(a, b, *tol, what=f"gradient of {name} ({np.dtype(dtype).name})")
    return outs_k, grads_k
