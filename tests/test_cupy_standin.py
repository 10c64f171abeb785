"""The CuPy stand-in (tests/cupy_standin) catches what goes wrong between host and device as CuPy
does, and no more: (a) NumPy functions applied to a device array, (b) host arrays mixed into device
operations, (c) NumPy-only functions and arguments, (d) implicit conversions to the host. Then:
tinyvit on the stand-in computes what it computes on NumPy (a ViT's forward and backward, and the
CuPy fallbacks of the CPU kernels), and the stand-in offers only what the installed cupy offers.

Each expectation is CuPy 14.2's behaviour, read in its source (cupy/_core/core.pyx: __array__,
__array_ufunc__, __array_function__, the operators; _kernel.pyx: the ufunc's arguments;
_routines_indexing.pyx: indexing and assignment). The tests of (a)-(d) take ``cp``, the stand-in or,
on a CUDA machine (marked gpu), the real CuPy: there they check that the stand-in's expectations
are CuPy's own.
"""
import operator
import pickle

import numpy as np
import pytest

import cupy_standin
import tinyvit as tv
from conftest import CUDA
from tinyvit import backend
from tinyvit.models import ViT, ViTConfig

pytestmark = pytest.mark.skipif(not cupy_standin.available(), reason="the stand-in needs the cupy package")
IMPLICIT = "Implicit conversion to a NumPy array is not allowed"


@pytest.fixture
def standin(monkeypatch):
    """The stand-in, installed as tinyvit's CuPy for the test."""
    return cupy_standin.install(monkeypatch)


@pytest.fixture(params=[pytest.param("standin", id="standin"), pytest.param("cupy", id="gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA device: the real CuPy half of these checks needs one")])])
def cp(request):
    """The stand-in, or the real CuPy (on a CUDA machine) to hold the stand-in to."""
    if request.param == "standin":
        return request.getfixturevalue("standin")
    import cupy
    return cupy


@pytest.fixture
def dev(cp):
    return cp.asarray(np.arange(6.0).reshape(2, 3))


@pytest.fixture
def host():
    return np.ones((2, 3))


# ---------------------------------------------------------------- (a) NumPy functions on a device array


def test_numpy_conversions_of_a_device_array_raise(dev):
    for convert in (np.asarray, np.array, np.ascontiguousarray, lambda a: np.random.default_rng(0).permutation(a)):
        with pytest.raises(TypeError, match=IMPLICIT):
            convert(dev)
    with pytest.raises(TypeError, match=IMPLICIT):
        np.testing.assert_allclose(dev, dev)


def test_numpy_functions_cupy_lacks_raise_on_a_device_array(dev):
    with pytest.raises(TypeError, match="__array_ufunc__"):
        np.spacing(dev)                                   # a ufunc CuPy does not have
    with pytest.raises(TypeError, match="no implementation found for 'numpy.insert'"):
        np.insert(dev, 0, 1.0)                            # a function CuPy does not have
    with pytest.raises(TypeError, match="Wrong arguments"):
        np.exp(dev, where=dev > 0)                        # an argument CuPy's ufuncs do not take


def test_numpy_functions_cupy_has_dispatch_to_cupy_as_in_cupy(cp, dev):
    """Not an error on a GPU either: CuPy's __array_ufunc__/__array_function__ run cupy.exp for
    np.exp and so on, and the result stays on the device."""
    for result in (np.exp(dev), np.sum(dev), np.concatenate([dev, dev]), np.linalg.norm(dev), np.add(dev, 1)):
        assert isinstance(result, cp.ndarray)
    np.testing.assert_allclose(np.exp(dev).get(), np.exp(dev.get()))


# ---------------------------------------------------------------- (b) host arrays in device operations


def test_operators_refuse_host_arrays(dev, host):
    for op in (operator.add, operator.mul, operator.truediv, operator.lt):
        with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
            op(dev, host)
        with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
            op(host, dev)
    for product in (lambda: dev @ host.T, lambda: host.T @ dev):
        with pytest.raises(TypeError, match="numpy.ndarray"):
            product()
    with pytest.raises(TypeError, match="Unsupported type"):
        dev * np.array(2.0)                               # a 0-d host array is an array too
    with pytest.raises(TypeError, match="Unsupported type"):
        dev += host
    assert isinstance(dev + np.float32(2), type(dev)) and isinstance(2 * dev, type(dev))   # scalars are fine


def test_functions_refuse_host_arrays(cp, dev, host):
    calls = [lambda: cp.matmul(dev, host.T), lambda: cp.exp(host), lambda: cp.where(dev > 0, host, 0.0),
             lambda: cp.concatenate([dev, host]), lambda: cp.maximum(dev, host), lambda: dev.dot(host.T),
             lambda: cp.exp([1.0, 2.0])]
    for call in calls:
        with pytest.raises(TypeError):
            call()
    with pytest.raises((TypeError, AttributeError)):   # CuPy: 'list' object has no attribute 'sum'
        cp.sum([1.0, 2.0])


def test_assignment_of_a_host_array_as_cupy_does_it(cp, dev, host):
    """Basic indexing fills from a host scalar only (CuPy's ValueError); advanced indexing copies
    host values and indices to the device, as CuPy's scatter does."""
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        dev[...] = host
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        dev[0] = host[0]
    dev[...] = np.float64(7.0)
    dev[np.array([1])] = np.full((1, 3), 2.0)
    assert dev.get().tolist() == [[7.0] * 3, [2.0] * 3]
    assert dev[np.array([1, 0])].get()[0].tolist() == [2.0] * 3 and dev[[0]].shape == (1, 3)


def test_host_arrays_are_welcome_where_cupy_copies_them(cp, host):
    d = cp.asarray(host)
    host[...] = 5.0
    assert d.get().tolist() == [[1.0] * 3] * 2, "cupy.asarray copies the host array"
    assert isinstance(cp.zeros_like(host), cp.ndarray) and cp.split(d, np.array([1]), axis=1)[1].shape == (2, 2)
    assert isinstance(cp.einsum("ij->i", host), cp.ndarray)


# ---------------------------------------------------------------- (c) NumPy-only functions and arguments


def test_numpy_only_functions_are_missing(cp):
    from cupy_standin.namespace import REAL           # the installed cupy package
    numpy_only = sorted(n for n in dir(np) if not n.startswith("_") and callable(getattr(np, n))
                        and not hasattr(REAL, n))
    assert {"errstate", "insert", "spacing", "vecdot"} <= set(numpy_only)
    for name in numpy_only:
        with pytest.raises(AttributeError, match="no attribute"):
            getattr(cp, name)


def test_numpy_only_arguments_raise(cp, dev):
    calls = [lambda: cp.sum(dev, initial=0.0), lambda: dev.sum(where=dev > 0), lambda: dev.max(initial=0.0),
             lambda: cp.add(dev, dev, where=dev > 0), lambda: cp.ones(3, like=dev), lambda: dev.item(0),
             lambda: cp.asarray(np.ones(2), device="cpu"), lambda: cp.mean(dev, where=dev > 0)]
    for call in calls:
        with pytest.raises(TypeError):
            call()


def test_what_needs_a_gpu_is_absent(standin):
    cp = standin
    for get in (lambda: cp.RawKernel, lambda: cp.RawModule, lambda: cp.get_default_memory_pool,
                lambda: cp.cuda.Event):
        with pytest.raises(AttributeError, match="does not implement"):
            get()


# ---------------------------------------------------------------- (d) implicit conversions


def test_conversions_to_python_go_through_get_as_in_cupy(cp, dev):
    total = dev.sum()
    assert isinstance(total, cp.ndarray) and total.shape == (), "reductions give 0-d device arrays"
    assert isinstance(dev[0, 1], cp.ndarray), "and so does indexing an element"
    assert float(total) == 15.0 and int(dev[1, 2]) == 5 and bool(dev[0, 1]) and dev[1, 0].item() == 3.0
    with pytest.raises(TypeError):
        float(dev)                                         # more than one element
    with pytest.raises(ValueError, match="ambiguous"):
        bool(dev)
    for use_as_index in (operator.index, range, lambda i: [1, 2, 3][i]):
        with pytest.raises(TypeError):                    # cupy.ndarray has no __index__
            use_as_index(dev[0, 1].astype(np.int64))
    with pytest.raises(TypeError):
        memoryview(dev)
    assert not isinstance(dev.data, memoryview) and hasattr(dev.data, "ptr"), ".data is a device pointer"
    assert pickle.loads(pickle.dumps(dev)).get().tolist() == dev.tolist()


def test_backend_sees_a_cupy_array(cp, dev):
    assert backend.is_cupy_array(dev) and backend.get_array_module(dev) is cp
    assert backend.get_array_module(tv.Tensor(dev)) is cp and backend.device_of(dev) == "cuda:0"
    h = backend.to_numpy(dev)
    assert isinstance(h, np.ndarray) and h.tolist() == dev.tolist()
    back = tv.Tensor(h).to("cuda")
    assert back.device == "cuda:0" and isinstance(back.data, cp.ndarray)


def test_install_answers_the_imports(standin):
    import cupy
    import cupyx.scipy.special
    assert cupy is standin and cupyx.scipy.special.erf is cupy_standin.modules()[1].scipy.special.erf
    assert backend.cupy_module() is standin


# ---------------------------------------------------------------- tinyvit on the stand-in equals NumPy


def test_vit_forward_and_backward_equal_numpy(standin):
    cp = standin
    tv.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, in_channels=3, num_classes=3, dim=8, depth=2, num_heads=2,
                    mlp_dim=12, dropout=0.0)
    with backend.default_dtype(np.float64):
        model = ViT(cfg)
    rng = np.random.default_rng(0)
    for p in model.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.4
    images = rng.standard_normal((2, 3, 8, 8))
    labels = np.array([0, 2])

    def run(xp):
        x = tv.Tensor(xp.asarray(images), requires_grad=True)
        loss = tv.functional.cross_entropy(model(x), xp.asarray(labels))
        loss.backward()
        grads = {n: backend.to_numpy(p.grad) for n, p in model.named_parameters()}
        model.zero_grad()
        return float(loss.item()), backend.to_numpy(x.grad), grads

    loss, gx, grads = run(np)
    model.to(device="cuda")
    assert isinstance(next(model.parameters()).data, cp.ndarray)
    loss_d, gx_d, grads_d = run(cp)
    assert loss_d == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(gx_d, gx, rtol=1e-10, atol=1e-13)
    for name in grads:
        np.testing.assert_allclose(grads_d[name], grads[name], rtol=1e-10, atol=1e-13, err_msg=name)


def test_cpu_kernels_fall_back_on_device_arrays(standin):
    """The CPU kernels' CuPy branches (one block, no threads): each kernel on device arrays equals
    the reference op on host arrays, output and every gradient."""
    from test_kernels_cpu import BROADCAST_CASES
    from kernel_checks import cpu_kernel
    rng = np.random.default_rng(5)
    for name, (reference, call, shapes) in BROADCAST_CASES.items():
        arrays = [rng.standard_normal(s) for s in shapes]
        results = []
        for xp, fn in ((np, call(reference)), (standin, call(cpu_kernel(name)))):
            ins = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in arrays]
            out = fn(*ins)
            out = out[0] if isinstance(out, (tuple, list)) else out
            up = xp.asarray(np.random.default_rng(6).standard_normal(out.shape))
            (out * tv.Tensor(up)).sum().backward()
            results.append([backend.to_numpy(out.data)] + [backend.to_numpy(t.grad) for t in ins])
        for i, (got, want) in enumerate(zip(results[1], results[0])):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"{name}: array {i}")
    from tinyvit.kernels.cpu import threads
    assert threads.flat_blocks(standin.zeros(10**6)) == [slice(None)], "one block on a device"


# ---------------------------------------------------------------- no more than the installed cupy


def test_every_name_and_method_is_cupys(standin):
    from cupy_standin.namespace import REAL as real
    cp, dev = standin, standin.zeros(3)
    public = [n for n in dir(type(dev)) if not n.startswith("_")]
    assert set(public) <= set(dir(real.ndarray)), set(public) - set(dir(real.ndarray))
    for namespace in (cp, cp.linalg, cp.random, cp.cuda, cp.lib.stride_tricks):
        provided = [n for n in vars(namespace) if not n.startswith("_")]
        assert all(hasattr(namespace._real, n) for n in provided), namespace.__name__
