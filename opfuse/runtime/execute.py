"""Run a compiled graph: fused kernels, library calls and torch fallbacks, in order.

Memory plan: every value lives in a slot of an environment list. Outputs of fused kernels
that never leave the graph (intermediates) and kernel scratch space are assigned to pooled
blocks by a greedy best-fit over their lifetimes; the pool is allocated on a thread's first
call and reused on every later call, so a warm call allocates nothing but the caller's fresh
outputs. Values that escape (graph outputs, anything a view of which is an output, anything
a torch op may alias) are allocated fresh on every call -- and recycled when the caller has
dropped every reference to the previous call's output.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.graph import TensorMeta, contents
from .arena import new_arena
from .finite import FiniteGuard
from .runs import Run, find_runs


# -- kernel arguments, in the kernel's argument order ---------------------------------------------
@dataclass
class In:
    slot: int
    meta: TensorMeta
    check: bool = False  # produced by torch: confirm the layout at run time


@dataclass
class Out:
    slot: int
    meta: TensorMeta
    block: int | None = None  # pooled block, or None: a fresh tensor per call
    # Write over the In at this argument position when, at run time, nothing else holds
    # it (a torch-made intermediate read here for the last time); `clear` are the slots of
    # its other, dead, aliases.
    steal: int | None = None
    clear: tuple[int, ...] = ()


@dataclass
class Const:
    value: Any  # a tensor (packed weights) or an int (a library function's address)


@dataclass
class Scratch:
    nbytes: int
    block: int | None = None


class Packed:
    """A weight the kernel reads packed (opfuse's GEMM), from a static input: packed on the
    first call and again whenever another tensor or new contents arrive (its storage or
    version counter moved), or after `forget_packs`. The packed copy keeps the tensor it
    came from alive, so no other storage can take its place unseen. Runtimes that pack one
    tensor alike (a graph compiled for several sizes) share one packed copy, while any of
    them holds it. (Packing on every call instead, which no write can get past, made
    GPT-2's decode steps 1.35x slower.)"""

    def __init__(self, slot: int, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.slot = slot
        self.pack = pack
        self._state: tuple[torch.Tensor, int, int, int, int, torch.Tensor] | None = None

    def address(self, t: torch.Tensor) -> int:
        key = (*contents(t), _epoch[0])
        state = self._state  # one read: another thread may replace it meanwhile
        if state is None or state[1:5] != key:
            state = (t, *key, _shared_pack(self.pack, t, key[:3]))
            self._state = state
        return state[5].data_ptr()


# Packed copies by (how, storage, address, version). An entry lives while a Packed holds
# it, and that Packed holds the tensor it came from: its storage cannot be freed and its
# address taken by another tensor while the entry can be found.
_packs: weakref.WeakValueDictionary[Any, torch.Tensor] = weakref.WeakValueDictionary()


def _shared_pack(
    pack: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, key: tuple[int, int, int]
) -> torch.Tensor:
    full = (pack, *key)  # packs compare as values (gemm.OwnPack)
    found = _packs.get(full)
    if found is None:
        found = _packs[full] = pack(t)
    return found


def pack_frozen(pack: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """A frozen weight packed at compile time, shared with every other compile that packs
    it alike (opfuse.compile over many input shapes: one copy, not one per shape). The
    copy keeps `t` alive, so no other tensor can take its place in the table unseen."""
    packed = _shared_pack(pack, t, contents(t))
    packed._opfuse_source = t  # type: ignore[attr-defined]
    return packed


def forget_packs() -> None:
    """Pack every weight anew from now on: after writes torch's version counters do not
    see (CompiledModule.refresh, opfuse.refresh), a packed copy found by the old key, or
    held by a Packed, would be stale."""
    _packs.clear()
    _epoch[0] += 1


_epoch = [0]  # moved by forget_packs: a Packed's copy from before it is stale


def packs_epoch() -> int:
    """Moves whenever packed and frozen copies of parameters are to be made again
    (`forget_packs`: opfuse.refresh, CompiledModule.refresh)."""
    return _epoch[0]


KernelArg = In | Out | Const | Scratch | Packed


@dataclass
class KernelStep:
    name: str
    fn: Any  # ctypes function: int fn(void **args, int nthreads)
    args: list[KernelArg]
    inplace: list[tuple[int, int]] = field(default_factory=list)  # (out arg, in arg) may share
    # fn takes the tensors themselves (a Triton launcher), not their addresses
    tensors: bool = False
    # Sets the bounds of its outputs from its inputs' (finite.transfer), in a plan with
    # guarded library calls; None: its outputs have none.
    bound: Callable[[list[Any]], None] | None = None

    @property
    def inputs(self) -> list[In]:
        return [a for a in self.args if isinstance(a, In)]

    @property
    def outputs(self) -> list[Out]:
        return [a for a in self.args if isinstance(a, Out)]


@dataclass
class TorchStep:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]  # with Slot markers
    kwargs: dict[str, Any]
    output: int
    # A library call that can write its result over one of its arguments (oneDNN's
    # conv + add): `inplace` is called instead of `fn` when the argument at position
    # `donate` is dead after this step and, at run time, nothing else holds it.
    inplace: Callable[..., Any] | None = None
    donate: int | None = None
    donor: TensorMeta | None = None  # the layout the donated tensor must have
    # A GEMM whose result the plan pools: `out_fn` (the op's out= overload) writes it into
    # block `out_block`, laid out as `out_meta`, instead of torch allocating it.
    out_fn: Callable[..., Any] | None = None
    out_block: int | None = None
    out_meta: TensorMeta | None = None
    # A pure view (view, expand, permute, slice...): computed once, at the first call,
    # when what it views is fixed memory (a pooled block, a constant).
    view: bool = False
    # A library call whose fused post-op would turn NaN into a number runs only when its
    # inputs' bounds prove no NaN can reach it (finite.py); else `guard.exact` runs.
    guard: FiniteGuard | None = None
    # A library call set up for other values of the size symbols: (fn, inplace, guard)
    # come from `at(values).call, .inplace, .guard` (plan.BuiltCall.at; runtime/sized.py).
    at: Callable[[Mapping[str, int]], Any] | None = None


@dataclass(frozen=True)
class Slot:
    index: int


Step = KernelStep | TorchStep


@dataclass
class Plan:
    n_slots: int
    input_slots: list[int]
    outputs: list[Any]  # Slot of each graph output, or its plain value
    constants: dict[int, Any]
    steps: list[Step]
    pool_sizes: list[int]  # bytes per pooled block
    # Slots dead after each step: dropping them frees torch-made intermediates as eager
    # would, instead of holding every one until the call returns.
    frees: list[tuple[int, ...]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # where the pooled blocks live (the graph's device)


class _Frame(threading.local):
    """Per-thread state: the pooled blocks and prebuilt kernel argument arrays."""

    ready: bool = False
    guarded: bool = False
    runs: dict[int, Run] | None = None


_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()


def persistent_bytes() -> int:
    """Memory live runtimes keep between calls on this thread: pooled intermediates and
    scratch, the recycled outputs they hold on to, and their arenas' cached blocks."""
    total = 0
    arenas = {id(rt.arena): rt.arena for rt in list(_LIVE) if rt.arena is not None}
    total += sum(a.stats().cached for a in arenas.values())  # (runtimes share one)
    for rt in list(_LIVE):
        f = rt._frame
        if not f.ready:
            continue
        total += sum(b.numel() for b in f.blocks)
        total += sum(t.untyped_storage().nbytes() for t in f.recycle.values())
    return total


class Runtime:
    """Executes a Plan. Calling it with the graph's inputs returns the graph's outputs."""

    def __init__(self, plan: Plan, guards: bool = True) -> None:
        """`guards=False` runs guarded library calls fused without proof (finite.py): for
        the tuner, which times a call on finite inputs and, in a model, mostly runs it on
        bounds carried from the call before, not on a measurement of its own."""
        self.plan = plan
        self.guards = guards
        self._frame = _Frame()
        # library outputs recycled between calls (arena.py); pooled blocks are not its
        self.arena = new_arena() if plan.device == "cpu" else None
        _LIVE.add(self)

    def _prepare(self) -> _Frame:
        # Normal tensors even when the first call is under inference_mode: torch refuses
        # out= writes into inference tensors outside it.
        with torch.inference_mode(False):
            return self._prepare_frame()

    def _prepare_frame(self) -> _Frame:
        f = self._frame
        plan = self.plan
        f.blocks = [
            torch.empty(max(n, 1), dtype=torch.uint8, device=plan.device) for n in plan.pool_sizes
        ]
        f.bind = [_binder(s.args) if isinstance(s, TorchStep) else None for s in plan.steps]
        # Values at fixed addresses on every call: constants, pooled results and the views
        # of those. They sit in the environment from the start; their steps never run.
        fixed: list[Any] = [None] * plan.n_slots
        for k, v in plan.constants.items():
            fixed[k] = v
        f.skip = [False] * len(plan.steps)
        # A view the caller gets back stays a new tensor per call, as eager's is.
        returned = {o.index for o in plan.outputs if type(o) is Slot}
        f.arrays = []
        f.dynamic = []  # per step: [(arg position, arg)] filled on every call
        for si, step in enumerate(plan.steps):
            if not isinstance(step, KernelStep):
                if step.out_block is not None:
                    assert step.out_meta is not None
                    fixed[step.output] = _typed(f.blocks[step.out_block], step.out_meta)
                elif (
                    step.view
                    and step.output not in returned
                    and all(
                        fixed[i] is not None
                        for i in _slots((step.args, tuple(step.kwargs.values())))
                    )
                ):
                    fixed[step.output] = step.fn(*f.bind[si](fixed), **_kwargs(step, fixed))
                    f.skip[si] = True
                f.arrays.append(None)
                f.dynamic.append(None)
                continue
            arr: Any = (
                [None] * len(step.args) if step.tensors else (ctypes.c_void_p * len(step.args))()
            )
            ref = _same if step.tensors else _address
            dyn: list[tuple[int, In | Out | Packed]] = []
            for ai, a in enumerate(step.args):
                if isinstance(a, Const):
                    arr[ai] = a.value if isinstance(a.value, int) else ref(a.value)
                elif isinstance(a, Scratch):
                    if a.block is None:
                        raise AssertionError("scratch without a block")
                    arr[ai] = ref(f.blocks[a.block])
                elif isinstance(a, Out) and a.block is not None:
                    t = _typed(f.blocks[a.block], a.meta)
                    fixed[a.slot] = t
                    arr[ai] = ref(t)
                elif (
                    isinstance(a, In)
                    and fixed[a.slot] is not None
                    and _has_layout(fixed[a.slot], a.meta)
                ):
                    arr[ai] = ref(fixed[a.slot])
                else:
                    dyn.append((ai, a))
            f.arrays.append(arr)
            f.dynamic.append(dyn)
        f.fixed = fixed
        f.recycle = {}
        # per guarded step: the slots of the arguments its guard bounds
        f.bounded = [
            tuple(a.index for a in s.args[:2])
            if isinstance(s, TorchStep) and s.guard is not None
            else ()
            for s in plan.steps
        ]
        f.guarded = any(f.bounded)
        # Kernels whose arguments are all fixed, back to back, run from one C call; not
        # those that carry bounds where a later library call is guarded by them.
        carry = f.guarded and self.guards
        f.runs = {
            r.first: r
            for r in find_runs(
                [
                    (s.fn, f.arrays[si])
                    if type(s) is KernelStep
                    and not s.tensors
                    and not f.dynamic[si]
                    and not (carry and s.bound is not None)
                    else None
                    for si, s in enumerate(plan.steps)
                ]
            )
        }
        f.ready = True
        return f

    def __call__(self, inputs: list[Any]) -> list[Any]:
        f = self._frame if self._frame.ready else self._prepare()
        if self.arena is None:
            return self._run(f, inputs)
        token = self.arena.enter()
        try:
            return self._run(f, inputs)
        finally:
            self.arena.exit(token)

    def _run(self, f: _Frame, inputs: list[Any]) -> list[Any]:
        plan = self.plan
        env: list[Any] = f.fixed.copy()
        for s, v in zip(plan.input_slots, inputs):
            env[s] = v
        nthreads = torch.get_num_threads()
        frees = plan.frees or [()] * len(plan.steps)
        skip = f.skip
        # value bounds of this call, by slot (finite.py), where a step is guarded
        guarded = f.guarded and self.guards
        bounds: list[float | None] | None = [None] * plan.n_slots if guarded else None
        runs = f.runs
        until = 0  # steps before it ran in C, with the run they belong to
        for si, step in enumerate(plan.steps):
            if si < until:
                continue
            run = runs.get(si) if runs else None
            if run is not None:
                if run.call(nthreads):
                    raise RuntimeError("ZeroDivisionError")
                until = si + run.n
                for sj in range(si, until):
                    for s in frees[sj]:
                        env[s] = None
                continue
            if skip[si]:  # a view made once, at the first call: its base's elements
                if bounds is not None and type(step.args[0]) is Slot:
                    bounds[step.output] = bounds[step.args[0].index]
            elif type(step) is KernelStep:
                arr = f.arrays[si]
                tensors = step.tensors
                for ai, a in f.dynamic[si]:
                    if type(a) is Packed:
                        arr[ai] = a.address(env[a.slot])
                    elif type(a) is In:
                        t = env[a.slot]
                        if a.check:
                            t = env[a.slot] = _conform(t, a.meta)
                        arr[ai] = t if tensors else t.data_ptr()
                    else:  # a fresh output
                        t = None  # no stray reference to what _take may reuse
                        if a.steal is not None:
                            t = _take(env, a, step.args[a.steal])
                        if t is None:
                            t = _fresh(f.recycle, (si, ai), a.meta)
                        arr[ai] = t if tensors else t.data_ptr()
                        env[a.slot] = t
                if step.fn(arr, nthreads):
                    # torch raises this very error for integer division by zero
                    raise RuntimeError("ZeroDivisionError")
                if bounds is not None and step.bound is not None:
                    step.bound(bounds)
            else:
                assert isinstance(step, TorchStep)
                args = f.bind[si](env)
                kwargs = _kwargs(step, env) if step.kwargs else _NO_KWARGS
                fused = True
                if bounds is not None:
                    if step.guard is not None:
                        fused, bounds[step.output] = step.guard.choose(args, f.bounded[si], bounds)
                    elif step.view and type(step.args[0]) is Slot:  # its base's elements
                        bounds[step.output] = bounds[step.args[0].index]
                if not fused:
                    assert step.guard is not None and step.guard.exact is not None
                    env[step.output] = step.guard.exact(*args, **kwargs)
                elif step.donate is not None and _donate(env, step, args):
                    assert step.inplace is not None
                    env[step.output] = step.inplace(*args, **kwargs)
                elif step.out_block is not None:
                    assert step.out_fn is not None
                    env[step.output] = step.out_fn(*args, **kwargs, out=f.fixed[step.output])
                else:
                    env[step.output] = step.fn(*args, **kwargs)
                args = kwargs = None  # type: ignore[assignment]
            t = None
            for s in frees[si]:
                env[s] = None
        return [env[s.index] if type(s) is Slot else s for s in plan.outputs]


_storage_use_count = torch._C._storage_Use_Count


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _address(t: torch.Tensor) -> int:
    return t.data_ptr()


def _unshared(t: Any, holders: int) -> bool:
    """Is `t` a plain tensor held by no more than `holders` references (the caller's) and
    sharing its storage with no other tensor? A caller's tensor or a live view of it would
    show in the counts."""
    return (
        type(t) is torch.Tensor
        and sys.getrefcount(t) <= holders + 2  # + this function's argument, getrefcount's
        and _storage_use_count(t.untyped_storage()._cdata) <= 2
    )


def _fresh(
    cache: dict[tuple[int, int], torch.Tensor], key: tuple[int, int], m: TensorMeta
) -> torch.Tensor:
    """A new output tensor. The one returned by the previous call is reused when the caller
    has dropped it and every view of it (a caching allocator: large fresh allocations cost
    page faults on every call)."""
    t = cache.get(key)
    if (
        t is not None
        and _unshared(t, 2)  # the cache entry, t
        # an inference tensor only where the caller is in inference_mode, as torch would
        and t.is_inference() == torch.is_inference_mode_enabled()
    ):
        return t
    t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
    cache[key] = t
    return t


def _take(env: list[Any], a: Out, src: KernelArg) -> torch.Tensor | None:
    """The input tensor itself as the output, if nobody but env holds it or its storage."""
    assert isinstance(src, In)
    for s in a.clear:  # never src.slot: the kernel about to run reads it
        env[s] = None
    t = env[src.slot]
    if (
        _unshared(t, 2)  # env, t
        and t.dtype == a.meta.dtype
        and t.numel() == a.meta.numel
    ):
        if _has_layout(t, a.meta):
            return t
        if t.is_contiguous() and a.meta.is_contiguous():
            return t.view(a.meta.shape)
    return None


def _donate(env: list[Any], step: TorchStep, args: list[Any]) -> bool:
    """May the step's in-place variant write over args[step.donate]? Only if env and args
    are its only holders (a caller's tensor or a live view would show in the counts) and
    it has the layout the plan expected."""
    assert step.donate is not None and step.donor is not None
    t = args[step.donate]
    m = step.donor
    if (
        _unshared(t, 3)  # env, args, t
        and _has_layout(t, m)
    ):
        slot = step.args[step.donate]
        assert type(slot) is Slot
        env[slot.index] = None
        return True
    return False


def _has_layout(t: torch.Tensor, m: TensorMeta) -> bool:
    """Does t have exactly m's dtype, shape and strides?"""
    return t.dtype == m.dtype and tuple(t.shape) == m.shape and tuple(t.stride()) == m.stride


def _typed(block: torch.Tensor, m: TensorMeta) -> torch.Tensor:
    n = (block.numel() // m.dtype.itemsize) * m.dtype.itemsize
    return block[:n].view(m.dtype).as_strided(m.shape, m.stride)


def _binder(args: tuple[Any, ...]) -> Callable[[list[Any]], Any]:
    """env -> the step's arguments. Most steps read values only at the top level (a view:
    a tensor and a shape): those copy a template and fill its slots, instead of rebuilding
    every nested argument on every call (2 ms a call of BERT-base's 130 views)."""
    if any(type(a) in (list, tuple) and _has_slot(a) for a in args):
        return lambda env: _resolve(args, env)
    template = list(args)
    slots = [(i, a.index) for i, a in enumerate(args) if type(a) is Slot]

    def bind(env: list[Any]) -> list[Any]:
        out = template.copy()
        for i, s in slots:
            out[i] = env[s]
        return out

    return bind


def _slots(v: Any) -> Iterator[int]:
    """The slot indices a (nested) argument reads."""
    if type(v) is Slot:
        yield v.index
    elif type(v) in (list, tuple):
        for x in v:
            yield from _slots(x)


def _has_slot(v: Any) -> bool:
    return next(_slots(v), None) is not None


_NO_KWARGS: dict[str, Any] = {}  # shared by the steps without keyword arguments: never written


def _kwargs(step: TorchStep, env: list[Any]) -> dict[str, Any]:
    return {k: _resolve(v, env) for k, v in step.kwargs.items()}


def _resolve(v: Any, env: list[Any]) -> Any:
    if type(v) is Slot:
        return env[v.index]
    if type(v) in (list, tuple):
        return type(v)(_resolve(x, env) for x in v)
    return v


def _conform(t: torch.Tensor, m: TensorMeta) -> torch.Tensor:
    """Kernels are generated for exact strides; a tensor torch produced with other strides
    (rare: meta functions predict them) is copied into the expected layout."""
    if _has_layout(t, m):
        return t
    out = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=t.device)
    out.copy_(t)
    return out
