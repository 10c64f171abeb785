"""One emulated attention forward and backward, of the kernels as they are or with a defect put in,
compared with the reference: what the sanitizer tests (tests/test_cuda_emulator_sanitizers.py) run,
each in a process of its own started by sanitize.py's environment.

    python tests/cuda_emulator/mutants.py intact | missing-barrier | unbounded-load

    missing-barrier   attention_forward without the __syncthreads at the top of its loop over key
                      tiles: a fast warp loads the next tile of keys and values into shared memory
                      while slower ones still read the last (a write-after-read race, which changes a
                      result only when the threads' timing lets a warp run that far ahead)
    unbounded-load    load_rows without its `row < tokens ?` guard: the rows of a tile past the last
                      token are read from beyond the q, k, v buffer (multiplied by weights of 0 for
                      keys, so a result changes only where what lies there is NaN or infinite)

B = 1, N = 40 tokens (two tiles of 32 keys and queries), one head of 8: small enough for a sanitized
build (10-30 times slower); both defects are met in the first kernel, attention_forward. Prints the
largest difference from the reference; exit status 0 when the results agree (float64, 1e-10), 1
when they do not. A sanitizer's report ends the process first.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]     # tests/, for cuda_emulator

from cuda_emulator import emulator  # noqa: E402

MUTANTS = {
    "intact": None,
    "missing-barrier": ("        __syncthreads();                            "
                        "// every warp is done with the previous tile\n", ""),
    "unbounded-load": ("row < tokens ? src[(long long)row * ld + c] * factor : T(0);",
                       "src[(long long)row * ld + c] * factor;"),
}


def mutated_source(name: str) -> str:
    from tinyvit.kernels.cuda import attention
    if MUTANTS[name] is None:
        return attention.SOURCE
    old, new = MUTANTS[name]
    assert attention.SOURCE.count(old) == 1, f"{name}: the code to change is not in attention.cu"
    return attention.SOURCE.replace(old, new)


def run(name: str) -> float:
    """The largest difference, scaled by max(1, |reference|), of outputs and gradients."""
    import tinyvit as tv
    from tinyvit.kernels.cuda import attention
    from tinyvit.ops import attention as reference
    source = mutated_source(name)
    library = emulator.build(source, Path(tempfile.gettempdir()) / "tinyvit_cuda_mutants")
    attention.SOURCE = source
    attention.kernel = emulator.Emulation(library).kernel
    attention.get_array_module = lambda *a: emulator.nan_numpy
    attention.max_shared_bytes = lambda: emulator.OPTIN_LIMIT
    rng = np.random.default_rng(0)
    b, n, h, dh = 1, 40, 1, 8
    d = h * dh
    data = [rng.standard_normal((b, n, d)), rng.standard_normal((d, 3 * d)) * 2 * d ** -0.5,
            rng.standard_normal(3 * d) * 0.1, rng.standard_normal((d, d)) * d ** -0.5, rng.standard_normal(d) * 0.1]
    upstream = [rng.standard_normal((b, n, d)), rng.standard_normal((b, h, n, n))]
    results = []
    for function in (attention.MultiHeadAttention, reference.MultiHeadAttention):
        ins = [tv.Tensor(a, requires_grad=True) for a in data]
        out, attn = function.apply(*ins, h, 0.0, False, return_attention=True)
        ((out * tv.Tensor(upstream[0])).sum() + (attn * tv.Tensor(upstream[1])).sum()).backward()
        results.append([out.data, attn.data] + [t.grad for t in ins])
    return max(float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())) for a, b in zip(*results))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in MUTANTS:
        print(__doc__, file=sys.stderr)
        return 2
    worst = run(argv[0])
    print(f"{argv[0]}: max scaled difference from the reference {worst:.2e}")
    return 0 if worst <= 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
