"""Random numbers inside kernels: `rand_like` / `rand` (what dropout decomposes to) become
a counter-based generator the fused kernel evaluates per element, so the uniform tensor is
never written and read back, and it is drawn on every thread instead of torch's one.

Element i of a call's tensor is SplitMix64's output for the call's seed and counter i
(seed + (i + 1) * golden ratio, then the 64-bit finaliser: the sequence passes BigCrush),
its top bits scaled to [0, 1) with as many bits as the dtype's significand holds, so the
conversion is exact. The seed is drawn from torch's default generator on every call:
`torch.manual_seed` makes runs repeatable, but the numbers differ from eager's (as
inductor's do). `Options.random = "torch"` (OPFUSE_RANDOM=torch) keeps torch's own calls.
"""

from __future__ import annotations

import math

import torch

from ..ir.formulas import RANDOM_BITS
from ..ir.graph import Graph, GraphBuilder, Node, TensorMeta

RANDOM_OPS = ("aten.rand_like.default", "aten.rand.default")
# Ops that save or replay the generator's state (activation checkpointing under
# AOTAutograd): their graphs keep torch's generator so a replay draws the same numbers.
_RNG_STATE = ("run_and_save_rng_state", "run_with_rng_state", "get_rng_state", "set_rng_state")

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


@torch.library.custom_op("opfuse::seed", mutates_args=())
def seed(device: torch.device) -> torch.Tensor:
    """A fresh 62-bit seed from torch's default generator, as a 0-d int64 tensor."""
    return torch.randint(0, 1 << 62, (), dtype=torch.int64, device=device)


@seed.register_fake
def _seed_fake(device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=device)


@torch.library.custom_op("opfuse::rand", mutates_args=())
def rand(seed: torch.Tensor, size: list[int], dtype: torch.dtype, offset: int) -> torch.Tensor:
    """Uniform [0, 1) numbers of `size`, element i from `seed` and counter offset + i
    alone: what the generated kernels compute (backends/c/prelude.py: op_mix64), here in
    torch for a group that runs unfused."""
    n = math.prod(size)
    bits = RANDOM_BITS[dtype]
    counter = torch.arange(offset, offset + n, dtype=torch.int64, device=seed.device)
    z = seed.to(torch.int64) + (counter + 1) * _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    z = z ^ _shr(z, 31)
    u = _shr(z, 64 - bits).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return (u * 2.0**-bits).to(dtype).view(size)


@rand.register_fake
def _rand_fake(
    seed: torch.Tensor, size: list[int], dtype: torch.dtype, offset: int
) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=seed.device)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def random_in_kernels(graph: Graph, devices: tuple[str, ...] = ("cpu",)) -> tuple[Graph, list[str]]:
    """Rewrite torch's uniform draws on one of `devices` (the backend's) into seed +
    counter-based `opfuse.rand` calls; also returns a line for the report."""
    if any(any(s in n.op for s in _RNG_STATE) for n in graph.nodes):
        return graph, ["random numbers: torch's generator kept (the graph replays its state)"]
    targets = [n for n in graph.nodes if _rewritable(n, devices)]
    on = {n.tensor.device for n in targets}
    if len(on) > 1:  # one seed, on one device, per graph
        targets = [n for n in targets if n.tensor.device == min(on)]
    if not targets:
        return graph, []
    b = GraphBuilder().copy_from(graph)
    chosen = set(targets)
    # One seed per call of the graph; each draw takes its own range of counters.
    device = torch.device(targets[0].tensor.device)
    s = b.call(torch.ops.opfuse.seed.default, device, source=targets[0].source)
    offset = 0
    for n in graph.nodes:
        b.copy(n)
        if n in chosen:
            m = n.tensor
            r = b.call(
                torch.ops.opfuse.rand.default, s, list(m.shape), m.dtype, offset, source=n.source
            )
            offset += m.numel
            b.replace(n, r)
    note = (
        f"random numbers: {len(targets)} uniform draw{'s' if len(targets) > 1 else ''} "
        "generated inside the kernels that use them (counter-based, seeded from torch's "
        "generator on every call)"
    )
    return b.build(graph.outputs), [note]


def _rewritable(n: Node, devices: tuple[str, ...]) -> bool:
    if n.op not in RANDOM_OPS or not isinstance(n.meta, TensorMeta):
        return False
    kw = dict(n.kwargs)
    return (
        n.meta.dtype in RANDOM_BITS
        and kw.get("generator") is None  # a caller's generator is theirs to advance
        and n.meta.device_type in devices
    )
