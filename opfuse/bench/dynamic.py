"""The bench's "dynamic" rows: models called with a new size every call, compiled once.

- GPT-2 generation: a prompt, then one token at a time on a growing key/value cache. Dynamo
  hands each compiler a graph per prompt, per first step and then one with the cache length
  symbolic; the row counts the graphs each compiler compiled, the first generation's time
  (compiles included) and the warm generation's. opfuse.compile runs the same generation
  (the second step exports with the cache length symbolic; that graph is mostly static
  and compiles once for every later step).
- An encoder over several sequence lengths: compiled once with `dynamic=True`, and with
  opfuse.compile at the first length (which exports it again with the length symbolic at
  the second), each length timed against eager and against opfuse compiled for that length
  alone (static).
- A convolution network over batch sizes, the same way (serving sees every batch size),
  and over image sizes (detection and segmentation take images as they come).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends.c.build import compiler_runs
from ..frontend.dynamo import compiles
from . import models
from .tables import Result
from .timing import time_interleaved

LENGTHS = (16, 32, 64, 96, 128, 192, 256, 512)
BATCHES = (1, 2, 3, 4, 6, 8)
IMAGES = (160, 176, 192, 208, 224)


class _Counter:
    """Counts the graphs a torch.compile backend is handed (each one compile)."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.graphs = backend, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        return self.backend(gm, example_inputs)


def _backend(name: str) -> Any:
    if name == "opfuse":
        from ..frontend.dynamo import opfuse_backend

        return opfuse_backend
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("inductor")


def run_generate(reps: int, new_tokens: int = 64, prompt_len: int = 16, layers: int = 12) -> Result:
    """GPT-2-small greedy generation of `new_tokens` from a `prompt_len`-token prompt."""
    res = Result(f"gpt2_small generate {new_tokens} tokens", "dynamic")
    torch.manual_seed(0)
    model = models.realistic(models.GPT2Decoder(layers=layers))
    prompt = torch.randint(0, 50257, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = models.generate(model, prompt, new_tokens)
        runs: dict[str, Callable[[], Any]] = {
            "eager": lambda: models.generate(model, prompt, new_tokens)
        }
        for name, dynamic in (("inductor", True), ("opfuse", None)):
            torch._dynamo.reset()
            counter = _Counter(_backend(name))
            step = torch.compile(model, backend=counter, dynamic=dynamic)
            before, built = compiles(), compiler_runs()
            t0 = time.perf_counter()
            got = models.generate(step, prompt, new_tokens)
            res.compile_seconds[f"{name} first"] = time.perf_counter() - t0
            res.compiles[name] = counter.graphs
            if name == "opfuse":
                res.compiles["opfuse compiles"] = compiles() - before
                res.compiles["opfuse builds"] = compiler_runs() - built
            if not torch.equal(got, expected):
                res.error = f"{name}: generated tokens differ from eager's"
                return res
            runs[name] = functools.partial(models.generate, step, prompt, new_tokens)
        import opfuse

        built, t0 = compiler_runs(), time.perf_counter()
        once = opfuse.compile(model, (prompt,))
        got = models.generate(once, prompt, new_tokens)
        res.compile_seconds["compile() first"] = time.perf_counter() - t0
        res.compiles["compile() builds"] = compiler_runs() - built
        if not torch.equal(got, expected):
            res.error = "opfuse.compile: generated tokens differ from eager's"
            return res
        runs["opfuse.compile"] = functools.partial(models.generate, once, prompt, new_tokens)
        res.timings = time_interleaved(runs, reps=reps, warmup=1)
    torch._dynamo.reset()
    return res


def run_lengths(reps: int, lengths: tuple[int, ...] = LENGTHS, layers: int = 12) -> list[Result]:
    """BERT-base over `lengths`: one dynamic compile against a static compile per length."""
    torch.manual_seed(0)
    model = models.realistic(models.BertEncoder(layers=layers))

    def inputs(s: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(s)
        return (torch.randint(0, 30522, (1, s), generator=g), torch.ones(1, s, dtype=torch.long))

    return _over_sizes(model, inputs, lengths, "bert_base length {}", reps)


def run_batches(
    reps: int, batches: tuple[int, ...] = BATCHES, name: str = "mobilenet_v2"
) -> list[Result]:
    """A convolution network over batch sizes (serving): the same rows as `run_lengths`, the
    batch the symbolic size (BatchNorm folded, channels-last, convolutions as rows)."""
    model, (x,) = models.build(name, 1)

    def inputs(b: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(b, *x.shape[1:], generator=torch.Generator().manual_seed(b)),)

    return _over_sizes(model, inputs, batches, f"{name} batch {{}}", reps)


def run_images(
    reps: int, sizes: tuple[int, ...] = IMAGES, name: str = "mobilenet_v2"
) -> list[Result]:
    """A convolution network over square image sizes at batch 1: the height and width the
    symbolic sizes (strided windows' output sizes expressions of them)."""
    model, (x,) = models.build(name, 1)

    def inputs(s: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(s)
        return (torch.randn(1, x.shape[1], s, s, generator=g),)

    return _over_sizes(model, inputs, sizes, f"{name} {{}} px", reps)


def _over_sizes(
    model: torch.nn.Module,
    inputs: Callable[[int], tuple[torch.Tensor, ...]],
    sizes: tuple[int, ...],
    label: str,
    reps: int,
) -> list[Result]:
    """`model` called at each of `sizes` in turn: under torch.compile(dynamic=True), compiled
    with opfuse.compile at the first size, and compiled for that size alone (static)."""
    import opfuse

    torch._dynamo.reset()
    counter = _Counter(_backend("opfuse"))
    dyn = torch.compile(model, backend=counter, dynamic=True)
    before, builds, exported_builds = compiles(), 0, 0
    with torch.no_grad():
        built = compiler_runs()
        once = opfuse.compile(model, inputs(sizes[0]))
        exported_builds += compiler_runs() - built
    out: list[Result] = []
    for s in sizes:
        res = Result(label.format(s), "dynamic")
        x = inputs(s)
        with torch.no_grad():
            expected = model(*x)
            t0, built = time.perf_counter(), compiler_runs()
            got = dyn(*x)
            res.compile_seconds["opfuse first"] = time.perf_counter() - t0
            builds += compiler_runs() - built  # the static compiles below build too
            res.compiles["opfuse"] = counter.graphs
            res.compiles["opfuse compiles"] = compiles() - before
            res.compiles["opfuse builds"] = builds
            t0, built = time.perf_counter(), compiler_runs()
            got_once = once(*x)
            res.compile_seconds["compile() first"] = time.perf_counter() - t0
            exported_builds += compiler_runs() - built
            res.compiles["compile() builds"] = exported_builds
            static = opfuse.compile(model, x)
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
            res.error = f"{res.case}: dynamic compile differs from eager"
            out.append(res)
            continue
        if not torch.allclose(got_once, expected, rtol=1e-3, atol=1e-3):
            res.error = f"{res.case}: opfuse.compile differs from eager"
            out.append(res)
            continue
        res.timings = time_interleaved(
            {
                "eager": functools.partial(model, *x),
                "opfuse": functools.partial(dyn, *x),
                "opfuse.compile": functools.partial(once, *x),
                "opfuse static": functools.partial(static, *x),
            },
            reps=reps,
            warmup=1,
            settle=1,
        )
        out.append(res)
    torch._dynamo.reset()
    return out
