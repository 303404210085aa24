"""The graph opfuse compiles: immutable nodes of ATen ops in topological order.

A `Node` is one ATen op application (or a graph input, or a frozen constant). Its `args`
hold other Nodes where the op takes tensors and plain Python values elsewhere, so a pass
can read the whole program without torch.fx. Nodes compare by identity; a pass that
changes the program builds a new Graph with `GraphBuilder` and leaves the old one intact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .size import Size, value_at


@dataclass(frozen=True)
class TensorMeta:
    """Shape, layout and dtype of one tensor value, all static."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"
    offset: int = 0  # storage offset, in elements; only meaningful relative to a base

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def device_type(self) -> str:
        return device_type(self.device)

    @property
    def span(self) -> int:
        """Elements of storage the strided tensor spans: its largest offset + 1 (0 if
        empty). More than numel with gaps, less with overlaps (an expanded stride 0)."""
        if self.numel == 0:
            return 0
        return 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))

    def is_contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.shape) or self.numel <= 1

    @property
    def symbolic(self) -> bool:
        """Is a size, stride or the offset a Size (an expression of size symbols)?"""
        return any(isinstance(v, Size) for v in (*self.shape, *self.stride, self.offset))

    def at(self, values: Mapping[str, int]) -> TensorMeta:
        """This meta in plain ints where the size symbols take `values` (by C name; a
        symbol not named keeps its value): a compile's layout at the sizes it serves."""
        if not self.symbolic:
            return self
        return TensorMeta(
            tuple(value_at(v, values) for v in self.shape),
            tuple(value_at(v, values) for v in self.stride),
            self.dtype,
            self.device,
            value_at(self.offset, values),
        )

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            tuple(int(s) for s in t.shape),
            tuple(int(s) for s in t.stride()),
            t.dtype,
            str(t.device),
            int(t.storage_offset()),
        )


def version(t: torch.Tensor) -> int:
    """t's version counter; 0 for an inference tensor (made under torch.inference_mode),
    which has none: it can change in place only inside that mode, untracked."""
    return 0 if t.is_inference() else t._version


def contents(t: torch.Tensor) -> tuple[int, int, int]:
    """Which elements a tensor holds, now: its storage, address and version counter (a
    key for copies made from it: packed weights, folded BatchNorms)."""
    return (t.untyped_storage()._cdata, t.data_ptr(), version(t))


def device_type(device: str) -> str:
    """'cuda:1' -> 'cuda'."""
    return device.split(":")[0]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Source:
    """Where an op came from in the user's model: nn.Module path and source line."""

    module: str = ""  # qualified name, e.g. "layers.0.attn"
    module_type: str = ""  # class name, e.g. "Linear"
    location: str = ""  # "file.py:42"
    code: str = ""  # the source line itself

    def __str__(self) -> str:
        where = self.module or "<model>"
        return f"{where} ({self.location})" if self.location else where


# Values a Node may hold in args besides other Nodes.
Arg = Any

INPUT = "input"
# An input node's kwarg: the caller passes the same tensor on every call (a parameter or
# buffer dynamo hands a graph), changed only in place, which moves its version counter.
STATIC = "static"
CONSTANT = "constant"
GETITEM = "getitem"


@dataclass(frozen=True, eq=False)
class Node:
    """One op application. `meta` is a TensorMeta, a tuple of them (multi-output ops),
    or None for values that are not tensors."""

    name: str
    op: str
    args: tuple[Arg, ...] = ()
    kwargs: tuple[tuple[str, Arg], ...] = ()
    meta: Any = None
    source: Source | None = None
    target: Any = None  # the torch callable that computes this op (OpOverload)

    def __repr__(self) -> str:
        return f"%{self.name}"

    @property
    def tensor(self) -> TensorMeta:
        assert isinstance(self.meta, TensorMeta), f"{self.name} is not a single tensor"
        return self.meta

    @property
    def kw(self) -> dict[str, Arg]:
        return dict(self.kwargs)

    def inputs(self) -> list[Node]:
        """The Nodes this node reads, in argument order, without duplicates."""
        seen: dict[int, Node] = {}
        for a in _walk(self.args, self.kwargs):
            seen.setdefault(id(a), a)
        return list(seen.values())


def _walk(*values: Any) -> Iterator[Node]:
    for v in values:
        if isinstance(v, Node):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _walk(*v)


def map_args(value: Arg, fn: Any) -> Arg:
    """Rebuild a (possibly nested) argument with every Node replaced by fn(node)."""
    if isinstance(value, Node):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_args(v, fn) for v in value)
    if isinstance(value, list):
        return [map_args(v, fn) for v in value]
    return value


@dataclass(frozen=True, eq=False)
class Graph:
    """A whole program: inputs, nodes in topological order, outputs, frozen constants."""

    inputs: tuple[Node, ...]
    nodes: tuple[Node, ...]  # includes inputs and constants, topologically sorted
    outputs: tuple[Any, ...]  # Nodes, or plain values (None, ints AOTAutograd saves)
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # Values the capture took from symbolic sizes as plain numbers (s0 / 3, a SymBool):
    # each a test of the symbols' values (by C name), true where it comes out the same
    fixed: tuple[Callable[[Mapping[str, int]], bool], ...] = ()

    @functools.cached_property
    def users(self) -> dict[Node, list[Node]]:
        users: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs():
                users[i].append(n)
        return users

    @functools.cached_property
    def output_set(self) -> frozenset[Node]:
        return frozenset(o for o in self.outputs if isinstance(o, Node))

    @functools.cached_property
    def index(self) -> dict[Node, int]:
        return {n: i for i, n in enumerate(self.nodes)}

    def compute_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.op not in (INPUT, CONSTANT)]

    @functools.cached_property
    def devices(self) -> frozenset[str]:
        """The devices of the graph's single-tensor values ("cpu", "cuda:0", ...)."""
        return frozenset(n.meta.device for n in self.nodes if isinstance(n.meta, TensorMeta))

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


class GraphBuilder:
    """Builds a new Graph, usually by copying an old one node by node.

    `copy(node)` re-creates an old node with its arguments remapped to the new graph;
    `add(...)` appends a fresh node; `replace(old, new)` makes later copies read `new`
    wherever they read `old`.
    """

    def __init__(self, constants: Mapping[str, torch.Tensor] | None = None) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[Node] = []
        self.constants: dict[str, torch.Tensor] = dict(constants or {})
        self.remap: dict[Node, Node] = {}
        self._names: set[str] = set()
        self.fixed: list[Callable[[Mapping[str, int]], bool]] = []  # (Graph.fixed)

    def _unique(self, name: str) -> str:
        base, i = name, 1
        while name in self._names:
            name = f"{base}_{i}"
            i += 1
        self._names.add(name)
        return name

    def add(
        self,
        op: str,
        args: Sequence[Arg] = (),
        kwargs: Mapping[str, Arg] | None = None,
        *,
        meta: Any,
        name: str | None = None,
        source: Source | None = None,
        target: Any = None,
    ) -> Node:
        node = Node(
            self._unique(name or default_name(op)),
            op,
            tuple(args),
            tuple((kwargs or {}).items()),
            meta,
            source,
            target,
        )
        self.nodes.append(node)
        if op == INPUT:
            self.inputs.append(node)
        return node

    def call(
        self, target: Any, *args: Arg, source: Source | None = None, like: Any = None, **kwargs: Arg
    ) -> Node:
        """Append an application of ATen op `target`, its meta inferred by torch. `like`: a
        meta the caller knows the result has, with the Sizes of a graph with symbolic sizes
        (kept where torch's lays out the same: ir/meta.infer_meta)."""
        from .meta import infer_meta

        return self.add(
            str(target),
            args,
            kwargs,
            meta=infer_meta(target, args, kwargs, like=like),
            source=source,
            target=target,
        )

    def constant(
        self,
        tensor: torch.Tensor,
        name: str,
        source: Source | None = None,
        meta: TensorMeta | None = None,
    ) -> Node:
        """A frozen tensor. `meta`: the node's meta where it says the same as the tensor's
        own, with the Sizes of a graph with symbolic sizes (a constant folded from an op
        sized by a symbol: position embeddings gathered for the sequence length)."""
        name = self._unique(name)
        self.constants[name] = tensor
        own = TensorMeta.of(tensor)
        node = Node(name, CONSTANT, (), (), meta if meta == own else own, source, None)
        self._names.add(name)
        self.nodes.append(node)
        return node

    def get(self, old: Node) -> Node:
        return self.remap.get(old, old)

    def replace(self, old: Node, new: Node) -> None:
        self.remap[old] = new

    def copy(self, old: Node) -> Node:
        if old.op == CONSTANT:
            new = self.constant(
                self._old_constants[old.name],
                old.name,
                old.source,
                old.meta if isinstance(old.meta, TensorMeta) else None,
            )
        else:
            new = self.add(
                old.op,
                map_args(old.args, self.get),
                {k: map_args(v, self.get) for k, v in old.kwargs},
                meta=old.meta,
                name=old.name,
                source=old.source,
                target=old.target,
            )
        self.remap[old] = new
        return new

    _old_constants: Mapping[str, torch.Tensor] = {}

    def copy_from(self, graph: Graph) -> GraphBuilder:
        """Prepare to copy nodes out of `graph` (its constants become available)."""
        self._old_constants = graph.constants
        self.fixed.extend(graph.fixed)
        return self

    def build(self, outputs: Sequence[Any]) -> Graph:
        outs = tuple(self.get(o) if isinstance(o, Node) else o for o in outputs)
        live = _live_nodes(self.nodes, outs)
        nodes = tuple(n for n in self.nodes if n in live or n.op == INPUT)
        used_consts = {n.name for n in nodes if n.op == CONSTANT}
        consts = {k: v for k, v in self.constants.items() if k in used_consts}
        return Graph(tuple(self.inputs), nodes, outs, consts, tuple(self.fixed))


def default_name(op: str) -> str:
    """'aten.add.Tensor' -> 'add'."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


def _live_nodes(nodes: Sequence[Node], outputs: Sequence[Any]) -> set[Node]:
    """Nodes that an output depends on (dead code is dropped by `build`)."""
    live: set[Node] = set()
    stack = [o for o in outputs if isinstance(o, Node)]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        stack.extend(n.inputs())
    return live


def bind(node: Node) -> dict[str, Arg]:
    """The node's arguments by schema name, defaults filled in."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {f"arg{i}": a for i, a in enumerate(node.args)} | dict(node.kwargs)
    out: dict[str, Arg] = {}
    kw = dict(node.kwargs)
    positional = list(node.args)
    for i, a in enumerate(schema.arguments):
        if i < len(positional) and not a.kwarg_only:
            out[a.name] = positional[i]
        elif a.name in kw:
            out[a.name] = kw[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def size_symbols(graphs: Sequence[Graph]) -> tuple[tuple[str, int], ...]:
    """The size symbols, with their values, that the graphs' inputs are sized by (graphs
    with symbolic sizes: ir/size.py)."""
    found: set[tuple[str, int]] = set()
    for g in graphs:
        for n in g.inputs:
            metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
            for m in metas:
                if isinstance(m, TensorMeta):
                    for v in (*m.shape, *m.stride, m.offset):
                        if isinstance(v, Size):
                            found.update(v.leaves)
    return tuple(sorted(found))
