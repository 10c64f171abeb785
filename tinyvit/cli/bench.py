"""`tinyvit bench`: training-step throughput, step time, peak memory and MFU, optionally against PyTorch."""
from __future__ import annotations

import json
import shlex

from . import UsageError, model_args


def command_line(args) -> str:
    """The `tinyvit bench` command that repeats this run, every setting spelled out."""
    words = ["tinyvit", "bench", "--model", args.model]
    words += [f"--model-arg={pair}" for pair in args.model_arg or []]
    words += ["--batch-size", str(args.batch_size), "--device", args.device, "--dtype", args.dtype]
    words += ["--tf32"] if args.tf32 else []
    words += ["--threads", str(args.threads)] if args.threads else []
    words += ["--gemms"] if args.gemms else ["--warmup", str(args.warmup)]
    words += ["--steps", str(args.steps)]
    words += ["--rounds", str(args.rounds)] if args.rounds != 1 else []
    if args.compare:
        words += ["--compare", args.compare, "--torch-attention", args.torch_attention]
    words += ["--peak-tflops", f"{args.peak_tflops:g}"] if args.peak_tflops else []
    words += ["--seed", str(args.seed)] if args.seed else []
    return shlex.join(words)


def cmd_bench(args) -> int:
    """Time the training step (forward, cross-entropy, backward, AdamW) and print the report."""
    from ..bench import format_report, run_benchmark
    if args.compare == "torch":
        import importlib.util
        # Found, not imported: run_benchmark sets PyTorch's thread settings before it loads.
        if importlib.util.find_spec("torch") is None:
            raise UsageError("--compare torch needs PyTorch: pip install 'tinyvit[reference]'")
    if args.gemms:
        return _bench_gemms(args)
    try:
        report = run_benchmark(model=args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                               tf32=args.tf32, threads=args.threads, warmup=args.warmup, steps=args.steps,
                               rounds=args.rounds, compare=args.compare, torch_attention=args.torch_attention,
                               peak_tflops=args.peak_tflops, model_args=model_args(args.model_arg), seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report["command"] = command_line(args)
    print(format_report(report))
    return _write_json(report, args.json)


def _bench_gemms(args) -> int:
    """--gemms: the step's matrix products one by one (tinyvit.bench_gemms)."""
    from ..bench_gemms import format_gemm_report, run_gemm_benchmark
    if args.device != "cpu" or args.dtype != "float32" or args.tf32 or args.rounds != 1:
        raise UsageError("--gemms times float32 CPU products: drop --device, --dtype, --tf32 and --rounds")
    try:
        report = run_gemm_benchmark(model=args.model, batch_size=args.batch_size, threads=args.threads,
                                    repeats=args.steps, compare=args.compare, model_args=model_args(args.model_arg),
                                    seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report["command"] = command_line(args)
    print(format_gemm_report(report))
    return _write_json(report, args.json)


def _write_json(report: dict, path) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"report written to {path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="time the training step (images/s, memory, MFU), optionally against PyTorch",
                       description="Time one training step (forward, cross-entropy, backward, AdamW update) on a "
                                   "synthetic batch: median step time over --steps after --warmup steps, images/s, "
                                   "peak memory and model FLOPs utilisation. --compare torch runs the same model, "
                                   "weights, batch and thread count in PyTorch eager and prints the ratio.")
    p.add_argument("--model", default="vit-cifar/4", help="named variant (default vit-cifar/4: dim 192, depth 6, "
                                                          "3 heads, patch 4, 32x32, 10 classes)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="ViTConfig override (repeatable)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", "--precision", dest="dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--tf32", action="store_true", help="TF32 tensor-core matmuls (cuda, float32; both sides)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for NumPy's BLAS, tinyvit's element-wise blocks and torch.set_num_threads "
                        "(default: OPENBLAS_NUM_THREADS or OMP_NUM_THREADS if set, else all cores available)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported (default 10)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --compare: time both sides --steps more times, in turn, this many rounds in all, "
                        "so that a change in the machine's load hits both alike (default 1)")
    p.add_argument("--compare", choices=("torch",), default=None, help="also time PyTorch eager on the same setup")
    p.add_argument("--torch-attention", choices=("explicit", "sdpa"), default="explicit",
                   help="PyTorch attention: explicit softmax(q k^T) v as tinyvit (default) or "
                        "F.scaled_dot_product_attention")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s for MFU (default: measure a square matmul)")
    p.add_argument("--gemms", action="store_true",
                   help="instead of the step, time each 2-D matrix product of one step alone (CPU, float32): "
                        "NumPy, OpenBLAS with beta = 1 and, with --compare torch, PyTorch; --steps calls of each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    p.set_defaults(func=cmd_bench)
