"""The `opfuse` command: demo | explain | bisect | bench."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence


def demo(args: argparse.Namespace) -> int:
    """Compile a small built-in model, show the fusion table, check it against eager and
    measure the speedup."""
    import torch

    import opfuse
    from opfuse.bench.models import demo_model
    from opfuse.bench.timing import time_interleaved

    model, inputs = demo_model()
    shape = tuple(inputs[0].shape)
    print(f"model: {type(model).__name__}, input {shape}, {torch.get_num_threads()} threads")
    fast = opfuse.compile(model, inputs)
    print(fast.report)
    with torch.no_grad():
        ref, out = model(*inputs), fast(*inputs)
    diff = (ref - out).abs().max().item()
    ok = torch.allclose(ref, out, rtol=1e-4, atol=1e-5)
    print(f"\nmatches eager: {'yes' if ok else 'NO'} (max abs difference {diff:.2e})")
    t = time_interleaved(
        {"eager": lambda: model(*inputs), "opfuse": lambda: fast(*inputs)}, reps=args.reps
    )
    e, o = t["eager"].median, t["opfuse"].median
    print(f"eager {e * 1e3:.2f} ms, opfuse {o * 1e3:.2f} ms (median of {args.reps}): {e / o:.2f}x")
    return 0 if ok else 1


def bench(args: argparse.Namespace) -> int:
    from opfuse.bench.run import main

    return main(
        quick=args.quick,
        reps=args.reps,
        out=args.out,
        only=args.only,
        training=not args.no_training,
        memory=not args.no_memory,
        matmul_precision=args.matmul_precision,
        device=args.device,
        keep_heap=args.keep_heap,
        engines=not args.no_engines,
        dynamic=not args.no_dynamic,
    )


def explain(args: argparse.Namespace) -> int:
    from opfuse.tools.explain_cli import run

    return run(args)


def bisect(args: argparse.Namespace) -> int:
    from opfuse.tools.explain_cli import run_bisect

    return run_bisect(args)


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    p = argparse.ArgumentParser(prog="opfuse", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compile a built-in model, check it, time it")
    d.add_argument("--reps", type=int, default=20)
    d.set_defaults(fn=demo)
    b = sub.add_parser("bench", help="eager vs inductor vs opfuse, side by side")
    b.add_argument("--quick", action="store_true", help="a small subset (CI smoke test)")
    b.add_argument("--reps", type=int, default=15)
    b.add_argument("--out", help="directory for results.md / results.json / plots")
    b.add_argument("--only", help="run the cases whose name contains this (or a group)")
    b.add_argument("--no-training", action="store_true", help="skip the training steps")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    b.add_argument(
        "--no-dynamic",
        action="store_true",
        help="skip the rows that call a model with a new size every call (generation, "
        "sequence lengths)",
    )
    b.add_argument(
        "--no-engines",
        action="store_true",
        help="leave ONNX Runtime and OpenVINO out of the model rows (they run when installed: "
        "pip install opfuse[engines])",
    )
    b.add_argument(
        "--matmul-precision",
        choices=("highest", "high", "medium"),
        default="highest",
        help="torch.set_float32_matmul_precision for every candidate (below highest, "
        "opfuse may choose oneDNN's faster, less exact float32 GEMM)",
    )
    b.add_argument(
        "--device",
        default="cpu",
        help="where the models and inputs live: cpu, or cuda[:N] (opfuse then generates "
        "Triton; training and memory rows are CPU-only and skipped)",
    )
    b.add_argument(
        "--keep-heap",
        action="store_true",
        help="glibc keeps freed memory for reuse (opfuse.keep_freed_memory) for every "
        "candidate: warm calls then fault no pages in",
    )
    b.set_defaults(fn=bench)
    from opfuse.tools.explain_cli import add_arguments

    e = sub.add_parser("explain", help="what fused, what did not, and why")
    add_arguments(e, outputs=True)
    e.set_defaults(fn=explain)
    bs = sub.add_parser("bisect", help="find the fusion that makes a model differ from eager")
    add_arguments(bs, outputs=False)
    bs.set_defaults(fn=bisect)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
