"""Small, fixed cases of every tinyvit CUDA kernel, for the prepared GPU session (tools/gpu_session.sh).
Run from the repository's root with PYTHONPATH=.:

    python3 tools/gpu_cases.py env               # versions; every kernel entry compiled and loaded (registers,
                                                 # shared memory); a RawModule with NVRTC_OPTIONS runs
    python3 tools/gpu_cases.py sanitize          # every kernel once, forward + backward, then a sync; run it
                                                 # under compute-sanitizer --tool memcheck | racecheck | synccheck
    python3 tools/gpu_cases.py bench             # ms per forward+backward (attention, LayerNorm, GELU, linear):
                                                 # tinyvit kernel, tinyvit reference
                                                 # (CuPy ops), PyTorch eager (if importable)
    TINYVIT_CUPY_NO_POOL=1 ...                   # no CuPy memory pool (for memcheck: exact bounds)
    python3 tools/gpu_cases.py sanitize --emulate   # the same cases on the CPU through tests/cuda_emulator

The cases reach what the small test shapes do not: several key and query tiles (N = 70, 197), head
sizes 32, 33, 64 and 128 (each head-size class of the attention kernels, a ragged last column group,
and above 48 KB of shared memory: the opt-in path), float64, a map gradient (dattn), no samples (B = 0:
nothing launched), K = 1000 classes (8 warps per row in the loss), labels outside [0, K) on the
unchecked path (NaN rows, and nothing read out of bounds: memcheck's case), LayerNorm rows > 64
(several column chunks), the linear and patch-embedding GEMMs.
"""
import argparse
import os
import sys
import time

import numpy as np


def cases():
    """(name, make) pairs: make(xp, dtype) -> (fn, arrays, upstream)."""
    import tinyvit as tv
    import tinyvit.functional as F

    def attention(b, n, h, dh, with_map):
        def make(xp, dtype, rng):
            d = h * dh
            s = d ** -0.5
            arrays = [rng.standard_normal((b, n, d)), rng.standard_normal((d, 3 * d)) * 2 * s,
                      rng.standard_normal(3 * d) * 0.1, rng.standard_normal((d, d)) * s, rng.standard_normal(d) * 0.1]
            up = [rng.standard_normal((b, n, d))] + ([rng.standard_normal((b, h, n, n))] if with_map else [])
            return (lambda *t: F.multi_head_attention(*t, h, 0.0, False, with_map)), arrays, up
        return make

    def layer_norm(rows, d):
        def make(xp, dtype, rng):
            arrays = [rng.standard_normal((rows, d)) * 2 + 3, rng.standard_normal(d), rng.standard_normal(d)]
            return (lambda x, g, b: F.layer_norm(x, g, b, 1e-6)), arrays, [rng.standard_normal((rows, d))]
        return make

    def gelu(shape, approximate):
        def make(xp, dtype, rng):
            return (lambda x: F.gelu(x, approximate)), [rng.standard_normal(shape) * 3], [rng.standard_normal(shape)]
        return make

    def cross_entropy(n, k, smoothing, bad_labels=False):
        def make(xp, dtype, rng):
            labels = rng.integers(0, k, size=n)
            if bad_labels:                               # past the last class, before the first, far past
                labels[:3] = [k, -1, 10 ** 6]
            labels = xp.asarray(labels)
            return (lambda x: F.cross_entropy(x, tv.Tensor(labels), smoothing, check_labels=not bad_labels)), \
                [rng.standard_normal((n, k)) * 3], ["sum"]
        return make

    def linear(shape, d_out):
        def make(xp, dtype, rng):
            d_in = shape[-1]
            arrays = [rng.standard_normal(shape), rng.standard_normal((d_in, d_out)) * d_in ** -0.5,
                      rng.standard_normal(d_out)]
            return F.linear, arrays, [rng.standard_normal(shape[:-1] + (d_out,))]
        return make

    def patch_embed(shape, p, d):
        def make(xp, dtype, rng):
            b, c, hh, ww = shape
            arrays = [rng.standard_normal(shape), rng.standard_normal((c * p * p, d)) * 0.1, rng.standard_normal(d)]
            return (lambda i, w, bias: F.patch_embed(i, w, bias, p)), arrays, \
                [rng.standard_normal((b, (hh // p) * (ww // p), d))]
        return make

    return [
        ("attention N=70 H=2 dh=64 +map", attention(2, 70, 2, 64, True)),
        ("attention N=40 H=1 dh=33", attention(2, 40, 1, 33, False)),
        ("attention N=33 H=1 dh=128 (>48 KB smem)", attention(1, 33, 1, 128, True)),
        ("attention N=65 H=3 dh=32 (vit-cifar/4)", attention(2, 65, 3, 32, False)),
        ("attention N=197 H=2 dh=64 (vit-s/16)", attention(1, 197, 2, 64, False)),
        ("attention B=0 (nothing launched)", attention(0, 5, 2, 16, True)),
        ("layer_norm 300x33", layer_norm(300, 33)),
        ("layer_norm 130x768", layer_norm(130, 768)),
        ("gelu erf", gelu((7, 300), "none")),
        ("gelu tanh", gelu((5000,), "tanh")),
        ("cross_entropy K=10", cross_entropy(37, 10, 0.1)),
        ("cross_entropy K=1000", cross_entropy(9, 1000, 0.0)),
        ("cross_entropy labels out of range (NaN expected)", cross_entropy(7, 10, 0.1, bad_labels=True)),
        ("linear (B, N, D) -> 4D", linear((3, 65, 48), 192)),
        ("patch_embed 32x32, P=4", patch_embed((3, 3, 32, 32), 4, 48)),
    ]


def run_case(xp, make, dtype, seed=0):
    import tinyvit as tv
    rng = np.random.default_rng(seed)
    fn, arrays, upstream = make(xp, dtype, rng)
    ins = [tv.Tensor(xp.asarray(np.asarray(a, dtype=dtype)), requires_grad=True) for a in arrays]
    outs = fn(*ins)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    terms = [o.sum() if isinstance(g, str) else (o * tv.Tensor(xp.asarray(np.asarray(g, dtype=dtype)))).sum()
             for o, g in zip(outs, upstream)]
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    loss.backward()
    return [o.data for o in outs] + [t.grad for t in ins]


def adamw_case(xp, dtype):
    import tinyvit.nn as nn
    import tinyvit.optim as optim
    rng = np.random.default_rng(0)
    ps = [nn.Parameter(xp.asarray(rng.standard_normal(s).astype(dtype))) for s in [(64, 64), (5000,), (7,), (1,)]]
    opt = optim.AdamW(ps, lr=1e-3, weight_decay=0.05)
    for _ in range(2):
        for p in ps:
            p.grad = xp.asarray(rng.standard_normal(p.shape).astype(dtype))
        opt.step()
    return [p.data for p in ps]


def sanitize(xp, sync):
    from tinyvit.kernels import use_kernels
    failures = 0
    with use_kernels("all"):
        for dtype in (np.float32, np.float64):
            for name, make in cases():
                try:
                    results = run_case(xp, make, dtype)
                    sync()
                    finite = "NaN expected" in name or all(bool(xp.isfinite(r).all()) for r in results if r is not None)
                    print(f"ok   {name} {np.dtype(dtype).name}{'' if finite else '  (NON-FINITE VALUES)'}", flush=True)
                except Exception as exc:           # keep going: one failure should not hide the others
                    failures += 1
                    print(f"FAIL {name} {np.dtype(dtype).name}: {type(exc).__name__}: {exc}", flush=True)
            try:
                adamw_case(xp, dtype)
                sync()
                print(f"ok   adamw {np.dtype(dtype).name}", flush=True)
            except Exception as exc:
                failures += 1
                print(f"FAIL adamw {np.dtype(dtype).name}: {type(exc).__name__}: {exc}", flush=True)
    return failures


def bench(repeats=20):
    """ms per forward + backward, float32, for the three paths; one line per op and size."""
    import cupy
    from tinyvit.kernels import use_kernels
    try:
        import torch
    except Exception:
        torch = None
    sizes = {"vit-cifar/4 B=128": (128, 65, 192, 3), "vit-s/16 B=64": (64, 197, 384, 6), "vit-b/16 B=64": (64, 197, 768, 12)}

    def timed(step):
        for _ in range(3):
            step()
        cupy.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        cupy.cuda.runtime.deviceSynchronize()
        return (time.perf_counter() - start) / repeats * 1e3

    import tinyvit as tv
    import tinyvit.functional as F
    for label, (b, n, d, h) in sizes.items():
        rng = np.random.default_rng(0)
        x = cupy.asarray(rng.standard_normal((b, n, d)), dtype=cupy.float32)
        w_qkv = cupy.asarray(rng.standard_normal((d, 3 * d)) * d ** -0.5, dtype=cupy.float32)
        w_proj = cupy.asarray(rng.standard_normal((d, d)) * d ** -0.5, dtype=cupy.float32)
        b_qkv, b_proj = cupy.zeros(3 * d, cupy.float32), cupy.zeros(d, cupy.float32)
        g = cupy.ones((d,), cupy.float32)
        w_fc = cupy.asarray(rng.standard_normal((d, 4 * d)) * d ** -0.5, dtype=cupy.float32)
        b_fc = cupy.zeros(4 * d, cupy.float32)
        ops = {
            "attention": lambda t: F.multi_head_attention(t, tv.Tensor(w_qkv, requires_grad=True), tv.Tensor(b_qkv, requires_grad=True),
                                                          tv.Tensor(w_proj, requires_grad=True), tv.Tensor(b_proj, requires_grad=True), h),
            "layer_norm": lambda t: F.layer_norm(t, tv.Tensor(g, requires_grad=True), tv.Tensor(g * 0, requires_grad=True), 1e-6),
            "gelu(4D)": lambda t: F.gelu(F.concat([t, t, t, t], axis=-1)),
            "linear(D->4D)": lambda t: F.linear(t, tv.Tensor(w_fc, requires_grad=True), tv.Tensor(b_fc, requires_grad=True)),
        }
        for op, fn in ops.items():
            row = []
            for setting in ("all", False):
                def step():
                    with use_kernels(setting):
                        t = tv.Tensor(x, requires_grad=True)
                        fn(t).sum().backward()
                row.append(timed(step))
            line = f"{label:20s} {op:12s} kernel {row[0]:8.3f} ms  reference {row[1]:8.3f} ms"
            if torch is not None:
                tx = torch.as_tensor(x, device="cuda").requires_grad_()
                tw, tb = torch.as_tensor(w_qkv, device="cuda").requires_grad_(), torch.as_tensor(b_qkv, device="cuda").requires_grad_()
                tp, tpb = torch.as_tensor(w_proj, device="cuda").requires_grad_(), torch.as_tensor(b_proj, device="cuda").requires_grad_()
                tg = torch.as_tensor(g, device="cuda").requires_grad_()
                tfc, tfb = torch.as_tensor(w_fc, device="cuda").requires_grad_(), torch.as_tensor(b_fc, device="cuda").requires_grad_()

                def torch_attention(t):
                    q, k, v = (t @ tw + tb).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                    return o.transpose(1, 2).reshape(b, n, d) @ tp + tpb
                torch_ops = {"attention": torch_attention,
                             "layer_norm": lambda t: torch.nn.functional.layer_norm(t, (d,), tg, tg * 0, 1e-6),
                             "gelu(4D)": lambda t: torch.nn.functional.gelu(torch.cat([t, t, t, t], -1)),
                             "linear(D->4D)": lambda t: t @ tfc + tfb}

                def torch_step():
                    tx.grad = None
                    torch_ops[op](tx).sum().backward()
                line += f"  torch {timed(torch_step):8.3f} ms"
            print(line, flush=True)


def environment():
    """Versions, and every kernel entry point compiled and loaded, with its resources."""
    import re
    import cupy
    from cupy.cuda import nvrtc, runtime
    from tinyvit.kernels import cuda
    from tinyvit.kernels.cuda import attention, gelu, layernorm, loss, optim as k_optim
    print(sys.version.split()[0], "numpy", np.__version__, "cupy", cupy.__version__, "runtime",
          runtime.runtimeGetVersion(), "driver", runtime.driverGetVersion(), "nvrtc", nvrtc.getVersion())
    m = cupy.RawModule(code='extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }',
                       options=cuda.NVRTC_OPTIONS)
    x = cupy.zeros(32, cupy.float32)
    m.get_function("k")((1,), (32,), (x,))
    runtime.deviceSynchronize()
    print("RawModule with", cuda.NVRTC_OPTIONS, "runs:", float(x.sum()) == 32.0)
    print("opt-in shared memory per block:", attention.max_shared_bytes())
    pattern = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+?)_(?:##SUFFIX|f32|f64)\(")
    for module in (attention, gelu, layernorm, loss, k_optim):
        start = time.time()
        names = module.entry_names() if hasattr(module, "entry_names") else \
            [f"{name}_{suffix}" for name in sorted(set(pattern.findall(module.SOURCE))) for suffix in ("f32", "f64")]
        for name in names:
            k = cuda.kernel(module.SOURCE, name)
            print(f"  {name}: regs {k.num_regs}, local {k.local_size_bytes} B, "
                  f"static smem {k.shared_size_bytes} B, max threads {k.max_threads_per_block}")
        print(f"{module.__name__}: compile + load {time.time() - start:.1f} s", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["env", "sanitize", "bench"])
    parser.add_argument("--emulate", action="store_true", help="run the cases in tests/cuda_emulator (CPU)")
    args = parser.parse_args()
    if args.emulate:
        sys.path[:0] = ["tests"]
        from cuda_emulator import emulator
        from tinyvit.kernels import cuda as cuda_pkg
        import tinyvit.kernels as kernels
        from tinyvit.kernels.cuda import attention, gelu, layernorm, loss, optim as k_optim
        import tempfile
        build = os.path.join(tempfile.gettempdir(), "cuda_gpu_cases_build")
        for module in (attention, gelu, layernorm, loss, k_optim):
            em = emulator.Emulation(emulator.build(module.SOURCE, build))
            module.kernel = em.kernel
            module.get_array_module = lambda *a: emulator.nan_numpy
        attention.max_shared_bytes = lambda: emulator.OPTIN_LIMIT
        kernels.CPU_KERNELS = dict(kernels.CUDA_KERNELS)          # NumPy arrays take the CUDA kernels
        kernels._load = lambda package, where: kernels.__dict__["importlib"].import_module(
            f"tinyvit.kernels.cuda.{where.split(':')[0]}").__dict__[where.split(':')[1]]
        sys.exit(1 if sanitize(np, lambda: None) else 0)
    import cupy
    if os.environ.get("TINYVIT_CUPY_NO_POOL") == "1":
        # one cudaMalloc per array: compute-sanitizer memcheck then sees each array's own bounds
        # (CuPy's pool sub-allocates 512-byte-rounded pieces of large chunks, hiding small overruns)
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
    if args.mode == "env":
        return environment()
    if args.mode == "sanitize":
        sys.exit(1 if sanitize(cupy, cupy.cuda.runtime.deviceSynchronize) else 0)
    bench()


if __name__ == "__main__":
    main()
