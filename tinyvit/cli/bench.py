"""`tinyvit bench`: training-step throughput, step time, peak memory and MFU on tinyvit's three paths
(fused, per-op kernels, reference ops), optionally against PyTorch; each run a JSON record (--json
FILE, --record DIR)."""
from __future__ import annotations

import shlex

from . import UsageError, model_args


def command_line(args) -> str:
    """The `tinyvit bench` command that repeats this run, every setting spelled out."""
    words = ["tinyvit", "bench", "--model", args.model]
    words += [f"--model-arg={pair}" for pair in args.model_arg or []]
    words += ["--batch-size", str(args.batch_size), "--device", args.device, "--dtype", args.dtype]
    words += ["--precision", "tf32"] if args.precision == "tf32" else []
    words += ["--threads", str(args.threads)] if args.threads else []
    words += ["--kernels", args.kernels, "--warmup", str(args.warmup), "--steps", str(args.steps)]
    words += ["--rounds", str(args.rounds)] if args.rounds != 1 else []
    if args.compare:
        words += ["--compare", args.compare, "--torch-attention", args.torch_attention]
    words += ["--peak-tflops", f"{args.peak_tflops:g}"] if args.peak_tflops else []
    words += ["--seed", str(args.seed)] if args.seed else []
    return shlex.join(words)


def cmd_bench(args) -> int:
    """Time the training step (forward, cross-entropy, backward, AdamW), print the report and write
    the record where asked."""
    from ..bench import format_report, run_benchmark, write_json, write_record
    from ..bench.run import kernels_setting
    if args.compare == "torch":
        import importlib.util
        # Found, not imported: run_benchmark sets PyTorch's thread settings before it loads.
        if importlib.util.find_spec("torch") is None:
            raise UsageError("--compare torch needs PyTorch: pip install 'tinyvit[reference]'")
    if args.record_name is not None and args.record is None:
        raise UsageError("--record-name names the file that --record DIR writes: give --record too")
    # all (both, its former spelling): the three paths; None: as the switch is (TINYVIT_KERNELS)
    args.kernels = kernels_setting("both" if args.kernels in ("all", "both") else args.kernels)
    try:
        report = run_benchmark(model=args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                               tf32=args.precision == "tf32", threads=args.threads, warmup=args.warmup, steps=args.steps,
                               rounds=args.rounds, kernels=args.kernels, compare=args.compare,
                               torch_attention=args.torch_attention, peak_tflops=args.peak_tflops,
                               model_args=model_args(args.model_arg), seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report["command"] = command_line(args)
    print(format_report(report))
    if args.json:
        print(f"record written to {write_json(report, args.json)}")
    if args.record:
        print(f"record written to {write_record(report, args.record, args.record_name)}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="time the training step (images/s, memory, MFU), kernels on/off, vs PyTorch",
                       description="Time one training step (forward, cross-entropy, backward, AdamW update) on a "
                                   "synthetic batch: median step time over --steps after --warmup steps, images/s, "
                                   "peak memory and model FLOPs utilisation, on tinyvit's paths: the fused step a "
                                   "training run takes (kernels.fuse(model)) and the model as written with its "
                                   "per-op kernels (--kernels on, the default), the reference ops alone (off), or "
                                   "all three (all, with the price of readability: the reference's step time over "
                                   "the fused one's). --compare torch runs the same model, weights, batch and thread "
                                   "count in PyTorch eager and prints each path's ratio to it. Every run is a JSON "
                                   "record (machine, date, commit, command, versions, numbers): --json FILE, --record DIR.")
    p.add_argument("--model", default="vit-cifar/4", help="named variant (default vit-cifar/4: dim 192, depth 6, "
                                                          "3 heads, patch 4, 32x32, 10 classes)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="ViTConfig override (repeatable)")
    p.add_argument("--batch-size", type=int, default=128, help="images per training step")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="the parameters' and images' dtype")
    p.add_argument("--precision", choices=("fp32", "tf32"), default="fp32",
                   help="matrix products, as `tinyvit train --precision`: fp32, or tf32 (TF32 tensor cores; cuda, "
                        "float32; every side)")
    p.add_argument("--tf32", dest="precision", action="store_const", const="tf32",
                   help="the same as --precision tf32 (an older spelling)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for NumPy's BLAS, tinyvit's element-wise blocks and torch.set_num_threads "
                        "(default: OPENBLAS_NUM_THREADS or OMP_NUM_THREADS if set, else all cores available)")
    p.add_argument("--kernels", choices=("on", "off", "all", "both"), default=None,
                   help="on: the fused step and the plain model with its per-op kernels; off: the reference "
                        "ops alone (use_kernels(False)); all: all three, one after the other (both: its former "
                        "spelling, which records keep) (default: on, unless TINYVIT_KERNELS=0)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported (default 10)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --kernels all or --compare: time every side --steps more times, in turn, this many "
                        "rounds in all, so that a change in the machine's load hits all alike (default 1)")
    p.add_argument("--compare", choices=("torch",), default=None, help="also time PyTorch eager on the same setup")
    p.add_argument("--torch-attention", choices=("explicit", "sdpa"), default="explicit",
                   help="PyTorch attention: explicit softmax(q k^T) v as tinyvit (default) or "
                        "F.scaled_dot_product_attention")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s for MFU (default: measure a square matmul)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic batch")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the record to FILE (JSON)")
    p.add_argument("--record", metavar="DIR", default=None,
                   help="also add the record to DIR as <date>-<commit>-<name>.json, never replacing one "
                        "(the repository keeps them in docs/bench/records)")
    p.add_argument("--record-name", metavar="NAME", default=None,
                   help="the <name> of --record's file (default: model, device, dtype, kernels, comparison)")
    p.set_defaults(func=cmd_bench)
