"""Shape, stride and dtype of a new op application, from torch's own meta functions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from . import size
from .graph import Node, TensorMeta, map_args
from .size import Size, value, value_at


def _fake(m: TensorMeta, at: dict[str, int] | None = None) -> torch.Tensor:
    """An empty meta tensor laid out as m; with `at`, its Sizes at those symbol values."""
    if at is not None:
        m = m.at(at)
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def infer_meta(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], like: Any = None) -> Any:
    """Run `target` on meta tensors standing in for the Node arguments. The result lives
    on the device an argument names (a factory's `device=`, opfuse.seed's), else on the
    first tensor argument's. Where the arguments carry Sizes (a graph with symbolic
    sizes), so does the result, wherever it provably follows them (_with_sizes). `like`:
    the meta a node had before a rewrite re-infers it; kept, Sizes and all, where the
    values come out the same."""
    device = _named_device(args, kwargs)
    if device is None:
        device = "cpu"
        for a in _nodes(args, kwargs):
            if isinstance(a.meta, TensorMeta):
                device = a.meta.device
                break
    meta = _to_meta(_run(target, args, kwargs, None), device)
    known = sizes_in(args, kwargs)
    if not known:
        return meta
    if like is not None and _layout_at(like, {}, True) == _layout_at(meta, {}, True):
        meta = like  # a node re-inferred as it was: its Sizes hold, no trial runs
    else:
        meta = _with_sizes(meta, target, args, kwargs, known)
    log = size.decisions()
    if log is not None:
        # The Sizes found hold at the trial values; a compile serving other sizes
        # (runtime/sized.py) needs them there too: the op's meta run at those.
        log.test(functools.partial(_holds, meta, target, _stand_ins(args), _stand_ins(kwargs)))
    return meta


def _holds(
    meta: Any, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], at: Mapping[str, int]
) -> bool:
    """Does `target`'s meta at the symbol values `at` lay out as `meta` evaluated there?"""
    try:
        got = _to_meta(_run(target, args, kwargs, dict(at)), "meta")
    except Exception:  # the op admits no such sizes: the compile's would not either
        return False
    return _layout_at(got, at) == _layout_at(meta, at)


def _layout_at(m: Any, at: Mapping[str, int], device: bool = False) -> Any:
    """Shapes, strides, offsets and dtypes (and devices) of a meta (or tuple of them),
    plain ints with the symbols at `at` (by C name; those not named keep their values)."""
    if isinstance(m, TensorMeta):
        m = m.at(at)
        return (m.shape, m.stride, m.offset, m.dtype, m.device if device else None)
    if isinstance(m, tuple):
        return tuple(_layout_at(x, at, device) for x in m)
    return m


def _stand_ins(v: Any) -> Any:
    """Arguments with each tensor Node replaced by its meta (what trial runs read of it),
    so a recorded test keeps no graph alive."""
    if isinstance(v, Node) and isinstance(v.meta, TensorMeta):
        return v.meta
    if isinstance(v, dict):
        return {k: _stand_ins(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(_stand_ins(x) for x in v)
    return v


def _run(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], at: dict[str, int] | None
) -> Any:
    def sub(v: Any) -> Any:
        if isinstance(v, Node):
            return _fake(v.tensor, at)
        if isinstance(v, TensorMeta):  # (a stand-in: _stand_ins)
            return _fake(v, at)
        if isinstance(v, torch.device):
            return "meta"
        if at is not None and isinstance(v, Size):
            return value_at(v, at)
        if isinstance(v, (tuple, list)):
            return type(v)(sub(x) for x in v)
        return v

    margs = tuple(sub(a) for a in args)
    mkwargs = {k: "meta" if k == "device" else sub(v) for k, v in kwargs.items()}
    return target(*margs, **mkwargs)


def sizes_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Size]:
    """The Sizes the arguments carry: their tensors' sizes, strides and offsets, and the
    Sizes among the other arguments (a view's shape); one per expression."""
    found: dict[str, Size] = {}

    def visit(v: Any) -> None:
        if isinstance(v, Node):
            if isinstance(v.meta, TensorMeta):
                m = v.meta
                for x in (*m.shape, *m.stride, m.offset):
                    visit(x)
        elif isinstance(v, Size):
            found.setdefault(v.text, v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)

    for v in (*args, *kwargs.values()):
        visit(v)
    return list(found.values())


# How far each symbol moves in the trial runs: apart for every symbol, so that two
# symbols equal at this size are told apart. Three runs: a window's count of positions,
# (c + a) // s + b, has enough freedom to fit two by chance (s0 + 7 for (s1 - 1) // 2 + 1
# where s1 moves twice as far as s0).
_TRIALS = (
    (3, 7, 13, 19, 29, 37, 43, 53),
    (5, 11, 17, 23, 31, 41, 47, 59),
    (62, 34, 90, 66, 78, 146, 98, 122),
)
_REFUSED = object()  # a trial run the op refused


def _with_sizes(
    meta: Any, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], known: list[Size]
) -> Any:
    """`meta` with a Size in each place where an expression of the `known` Sizes (one of
    them, for a stride the dense stride over the result's own Sizes, or the forms `pick`
    tries) gives its value at this size and at three other values of the symbols, in
    trial runs of the op; where several do, the one that also holds where they differ.
    Anything else stays an int: correct, only specific to this size. Sound by the same
    argument as ir/size.py: the printed expression gives the value every decision read."""
    names = sorted({n for k in known for n, _ in k.leaves})
    if len(names) > len(_TRIALS[0]):
        return meta
    values = dict(k for s in known for k in s.leaves)
    probes: dict[tuple[int, ...], Any] = {}

    def probe(t: dict[str, int]) -> Any:
        """The op's meta at symbol values t (_REFUSED where it admits none there)."""
        key = tuple(t[n] for n in names)
        if key not in probes:
            try:
                probes[key] = _to_meta(_run(target, args, kwargs, t), "meta")
            except Exception:
                probes[key] = _REFUSED
        return probes[key]

    trials = [{n: values[n] + d for n, d in zip(names, ds)} for ds in _TRIALS]
    outs = [probe(t) for t in trials]
    if any(o is _REFUSED for o in outs):  # no other sizes (a shape a constant fixes)
        return meta

    def pick(v0: int, vs: list[int], cands: list[int], at: Callable[[Any], int | None]) -> int:
        if all(v == v0 for v in vs):
            return v0
        groups = (cands, _scaled(known, v0), _summed(known, v0), _windowed(known, v0))

        def fits(group: Iterable[int]) -> list[int]:
            return [
                c
                for c in group
                if value(c) == v0 and all(value_at(c, t) == v for t, v in zip(trials, vs))
            ]

        for k, group in enumerate(groups):
            found = fits(group)
            if found:
                if 0 < k < len(groups) - 1:  # c // 2 may be a window's (c + 1) // 2
                    found += fits(groups[-1])
                return settle(found, at)
        return v0

    def settle(found: list[int], at: Callable[[Any], int | None]) -> int:
        """One of the expressions the trials left, tried where they differ: two forms
        may agree on every trial yet not elsewhere ((X + 1) // 2 and X // 2 + 1 on odd X,
        an X the symbols' trial moves keep odd; H // 16 and W // 16 of a square image,
        which moves of 3 and 7 leave equal), and each size would print its own."""
        alive = found
        for d in range(1, 65):
            if len({_text(c) for c in alive}) <= 1:
                break
            t = {n: values[n] + d * (1 + k) for k, n in enumerate(names)}
            if len({value_at(c, t) for c in alive}) > 1:
                got = at(probe(t))
                if got is None:
                    break
                alive = [c for c in alive if value_at(c, t) == got] or alive[:1]
        return alive[0]

    def one(m: TensorMeta, others: list[TensorMeta], get: Callable[[Any], Any]) -> TensorMeta:
        if any(o is None or o.ndim != m.ndim for o in others):
            return m

        def at(part: str, i: int) -> Callable[[Any], int | None]:
            def value(out: Any) -> int | None:
                o = get(out)
                if not isinstance(o, TensorMeta) or o.ndim != m.ndim:
                    return None
                return o.offset if part == "offset" else getattr(o, part)[i]

            return value

        shape = tuple(
            pick(v, [o.shape[i] for o in others], list(known), at("shape", i))
            for i, v in enumerate(m.shape)
        )
        dense = _dense_strides(shape, m.stride)
        stride = tuple(
            pick(v, [o.stride[i] for o in others], [dense[i], *known], at("stride", i))
            for i, v in enumerate(m.stride)
        )
        offset = pick(m.offset, [o.offset for o in others], list(known), at("offset", 0))
        return TensorMeta(shape, stride, m.dtype, m.device, offset)

    def walk(m: Any, others: list[Any], get: Callable[[Any], Any]) -> Any:
        if isinstance(m, TensorMeta):
            return one(m, others, get)
        if isinstance(m, tuple) and all(isinstance(o, tuple) and len(o) == len(m) for o in others):
            return tuple(walk(x, [o[i] for o in others], _item(get, i)) for i, x in enumerate(m))
        return m

    return walk(meta, outs, lambda out: out)


def _item(get: Callable[[Any], Any], i: int) -> Callable[[Any], Any]:
    def item(out: Any) -> Any:
        o = get(out)
        return o[i] if isinstance(o, tuple) and i < len(o) else None

    return item


def _text(c: int) -> str:
    return c.text if isinstance(c, Size) else str(c)


def _scaled(known: list[Size], v0: int) -> list[int]:
    """Known Sizes times or divided by the int that gives v0 (a view flattening the batch
    into rows: s0 * 1024; an unflatten: (s0 * 1024) // 1024 stays s0's expression)."""
    out: list[int] = []
    for c in known:
        k = value(c)
        if k and v0 % k == 0:
            out.append(c * (v0 // k))
        if v0 and k and k % v0 == 0:  # (a Size that is 0 here: an offset)
            out.append(c // (k // v0))
    return out


def _summed(known: list[Size], v0: int) -> Iterator[int]:
    """c1 + c2 + b for two known Sizes (a padded dim: the size plus a pad that is itself an
    expression, as a pool's right-hand pad is), offsets up to 16."""
    for i, c1 in enumerate(known):
        for c2 in known[i + 1 :]:
            b = v0 - value(c1) - value(c2)
            if abs(b) <= 16:
                yield c1 + c2 + b


def _windowed(known: list[Size], v0: int) -> Iterator[int]:
    """(c + a) // s + b for a known Size c: a window's count of positions along a dim (a
    convolution's or pool's output height, (H + 2p - k) // s + 1), strides up to 8 and
    offsets up to 16. Tried last, lazily: only sizes no simpler expression gives."""
    for c in known:
        k = value(c)
        for s in range(1, 9):
            for a in range(s):
                b = v0 - (k + a) // s
                if abs(b) <= 16:
                    yield (c + a) // s + b if s > 1 else c + b


def _dense_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> list[int]:
    """The strides of a dense tensor of `shape` with its dims in the order `stride` puts
    them (outermost first; equal strides in dim order), as Size arithmetic."""
    order = sorted(range(len(shape)), key=lambda i: (-value(stride[i]), i))
    out = [1] * len(shape)
    acc: int = 1
    for i in reversed(order):
        out[i] = acc
        acc = acc * shape[i]
    return out


def _named_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.device):
            return device_name(v)
    d = kwargs.get("device")
    return device_name(torch.device(d)) if isinstance(d, str) else None


def device_name(d: torch.device) -> str:
    """A device as tensors on it print theirs: 'cuda' names the current CUDA device,
    'cuda:0', as a tensor made there says."""
    if d.index is None and d.type != "cpu" and d.type != "meta":
        mod = getattr(torch, d.type, None)
        if mod is not None and hasattr(mod, "current_device") and mod.is_available():
            return f"{d.type}:{mod.current_device()}"
    return str(d)


def _to_meta(v: Any, device: str) -> Any:
    if isinstance(v, torch.Tensor):
        return TensorMeta(
            tuple(int(s) for s in v.shape),
            tuple(int(s) for s in v.stride()),
            v.dtype,
            device,
            int(v.storage_offset()),
        )
    if isinstance(v, (tuple, list)):
        return tuple(_to_meta(x, device) for x in v)
    return None


def _nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Node]:
    out: list[Node] = []

    def visit(v: Any) -> Any:
        out.append(v)
        return v

    map_args(args, visit)
    for v in kwargs.values():
        map_args(v, visit)
    return out
