"""Lower a fused group (a set of graph nodes) to one `Kernel`.

Every value the group produces is evaluated at a multi-index over the group's domain:

    value(node, index) =
        load(node, index)                       node is produced outside the group
        value(input, view_map(index))           node is a view (permute, expand, reshape...)
        formula(value(arg, broadcast(index))..) node is a pointwise member
        accumulator result                      node is a reduction member; the index must
                                                be the one the reduction was computed at

Loads through views are composed into one strided (or, after reshapes, div/mod) offset, so a
kernel reads a transposed, sliced or expanded tensor where it lies, without a copy. After
the values are built, adjacent loop dimensions that every access walks contiguously are
merged, so the common case becomes one flat vectorised loop.

`NotFusable` says, in words, why a set of nodes cannot become one kernel; the partitioner
uses it as its last word on a proposed fusion.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..ir.combine import COMBINES, Combine, Family
from ..ir.graph import CONSTANT, GETITEM, Graph, Node, TensorMeta, bind
from ..ir.index import Ix, Var, address, delinearize, linearize
from ..ir.ops import (
    Kind,
    info,
    is_generator,
    mismatched_reductions,
    reads_through,
    reduction_domain,
    short,
)
from ..ir.scalar import Expr, cast, const, opmath, position, substitute, walk
from ..ir.size import Size
from ..ir.uses import used_outside
from .constants import formula as constant_formula
from .kernel import Accumulate, Buffer, Kernel, Pass, Schedule, Store
from .precision import SUM_BLOCK, RowPrecision, short_sum, sum_in_runs


class NotFusable(Exception):
    """The nodes cannot be lowered to one kernel; str(e) says why."""


# Ops whose whole point is a dtype conversion: their rounding is kept (see _pointwise).
_CONVERSIONS = frozenset({"aten._to_copy.default", "prims.convert_element_type.default"})
# Fewest elements a thread should reduce before a row is split across threads.
SPLIT_MIN_INNER = 1 << 16
MAX_RECOMPUTED = 8


def acc_dtype(combine: Combine, dtype: torch.dtype, terms: int) -> torch.dtype:
    """Accumulator dtype for a reduction of `terms` elements: sums and variances of floats
    accumulate in float64, so long reductions stay at least as accurate as torch's cascaded
    float32 sums; a float32 sum of a few terms (a pooling window) in float32."""
    if COMBINES[combine].logical:
        return torch.bool
    if short_sum(combine, opmath(dtype), terms):
        return torch.float32
    if combine in (Combine.SUM, Combine.WELFORD):
        if dtype.is_floating_point:
            return torch.float64
        return torch.int64
    if combine is Combine.PROD and not dtype.is_floating_point:
        return torch.int64
    return opmath(dtype)


# a stored value: (buffer, index in it, value, store only where this is 0)
_Root = tuple[Buffer, tuple[Ix, ...], Expr, "Ix | None"]


class _Lowering:
    def __init__(
        self,
        graph: Graph,
        members: Iterable[Node],
        domain: tuple[int, ...] | None = None,
        overrides: dict[Node, Any] | None = None,
        checked: bool = False,
    ) -> None:
        self.g = graph
        # the backend tests integer divisors in reductions too (Triton's launcher flag)
        self.checked = checked
        self.members = set(members)
        # A fixed loop domain (a GEMM epilogue runs over the GEMM's [M, N]) and values
        # computed another way (the GEMM result, read from its block buffer).
        self.fixed_domain = domain
        self.overrides = overrides or {}
        index = graph.index
        self.order = sorted((m for m in self.members if m in index), key=index.__getitem__)
        self.memo: dict[tuple[Node, tuple[Ix, ...]], Expr] = {}
        self.in_buffers: dict[Node, Buffer] = {}
        self.accumulates: dict[Node, Accumulate] = {}
        self.acc_results: dict[Node, tuple[Expr, ...]] = {}
        self.checks: list[Expr] = []
        self.recomputed: set[Node] = set()
        self.rows = RowPrecision()  # per-row arithmetic in the sums' float64
        self.out_buffers: list[Buffer] = []
        # the domain, set by run(): full shape, reduced dims, loop variables and index
        self.full_shape: tuple[int, ...] = ()
        self.dims: tuple[int, ...] = ()
        self.full_vars: tuple[Var, ...] = ()
        self.full_index: tuple[Ix, ...] = ()
        self.inner_vars: frozenset[Var] = frozenset()  # the reduced dims' loop variables
        self.reduction_size = 1

    # -- group structure --------------------------------------------------------------
    def _used_outside(self, n: Node) -> bool:
        return used_outside(self.g, n, self.members)

    def outputs(self) -> list[Node]:
        outs: list[Node] = []
        for m in self.order:
            if isinstance(m.meta, tuple):
                outs.extend(u for u in self.g.users[m] if u.op == GETITEM and self._used_outside(u))
            elif self._used_outside(m):
                outs.append(m)
        return outs

    # -- values ------------------------------------------------------------------------
    def value(self, n: Node, idx: tuple[Ix, ...]) -> Expr:
        key = (n, idx)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        e = self._value(n, idx)
        self.memo[key] = e
        return e

    def _value(self, n: Node, idx: tuple[Ix, ...]) -> Expr:
        if n in self.overrides:
            return self.overrides[n](self, idx)
        if n.op == GETITEM and n.args[0] in self.members:
            return self._reduced(n.args[0], n.args[1], idx)
        if n not in self.members and is_generator(n):
            return self._pointwise(n, idx)
        if n not in self.members:
            row = info(n.op)
            if reads_through(n):
                assert row.gather is not None
                e = row.gather(self.value, idx, **bind(n))
                return cast(e, opmath(n.tensor.dtype))
            if row.kind == Kind.INJECTIVE and row.index is not None and n.op != GETITEM:
                try:
                    src_idx = row.index(idx, *n.args, **n.kw)
                except ValueError as e:
                    if n.args[0] in self.members:
                        raise NotFusable(f"{n.name}: {e}") from None
                    return self._load(n, idx)  # a view torch materialises; read it as is
                return self.value(n.args[0], src_idx)
            return self._load(n, idx)
        row = info(n.op)
        if row.pointwise:
            return self._pointwise(n, idx)
        if row.kind == Kind.REDUCTION:
            return self._reduced(n, 0, idx)
        raise NotFusable(f"{n.op} cannot be part of a generated kernel")

    def _load(self, n: Node, idx: tuple[Ix, ...]) -> Expr:
        m = n.meta
        if not isinstance(m, TensorMeta):
            raise NotFusable(f"{n.name} is not a tensor")
        if n.op == CONSTANT:
            computed = constant_formula(self.g.constants[n.name], idx)
            if computed is not None:
                return computed
        buf = self.in_buffers.get(n)
        if buf is None:
            buf = Buffer(f"in{len(self.in_buffers)}", m.dtype, "in", n.name, m.shape, m.stride)
            self.in_buffers[n] = buf
        return Expr("load", (), m.dtype, (buf.name, address(idx, m.stride)))

    def _pointwise(self, n: Node, idx: tuple[Ix, ...]) -> Expr:
        row = info(n.op)
        out = n.tensor
        compute = _compute_dtype(n)
        args: dict[str, Any] = {}
        for name, v in bind(n).items():
            if isinstance(v, Node):
                vm = v.tensor
                args[name] = self.value(v, _broadcast(idx, out.shape, vm.shape))
                if vm.numel < out.numel and v in self.members:
                    self.recomputed.add(v)
            else:
                args[name] = v
        widened = self.rows.widen(n, args, self.inner_vars)
        if widened:
            compute = torch.float64
        for name, e in args.items():
            if isinstance(e, Expr) and name not in row.keep:
                args[name] = cast(e, compute)
        assert row.formula is not None
        if row.positional:
            args["_index"] = idx
        res = row.formula(**args)
        if not isinstance(res, Expr):
            res = const(res, compute)
        if n.op in _CONVERSIONS:
            # An explicit conversion rounds to its dtype, as eager does; then computing
            # continues in opmath precision.
            res = cast(res, out.dtype)
        if self._check_division(res):
            pass
        if widened:
            return self.rows.rounded(res)
        return cast(res, opmath(out.dtype))

    def _check_division(self, e: Expr) -> bool:
        from ..ir.scalar import RAISES_ON_ZERO

        found = False
        for sub in walk([e]):
            if sub.op in RAISES_ON_ZERO and not sub.dtype.is_floating_point:
                d = sub.args[1]
                if d.op == "const" and d.value != 0:
                    continue  # a nonzero constant divisor: nothing to check at run time
                cond = Expr("eq", (sub.args[1], const(0, sub.args[1].dtype)), torch.bool)
                if cond not in self.checks:
                    self.checks.append(cond)
                found = True
        return found

    # -- reductions ----------------------------------------------------------------------
    def _reduced(self, r: Node, part: int, idx: tuple[Ix, ...]) -> Expr:
        results = self._accumulate(r)
        metas = r.meta if isinstance(r.meta, tuple) else (r.meta,)
        want = self._kept_index(metas[part].shape)
        if tuple(idx) != want:
            raise NotFusable(
                f"the result of {r.name} is read at another position than it is computed at"
            )
        return results[part]

    def _kept_index(self, shape: tuple[int, ...]) -> tuple[Ix, ...]:
        full = self.full_index
        if len(shape) == len(full):
            return tuple(Ix() if d in self.dims else full[d] for d in range(len(full)))
        return tuple(full[d] for d in range(len(full)) if d not in self.dims)

    def _accumulate(self, r: Node) -> tuple[Expr, ...]:
        hit = self.acc_results.get(r)
        if hit is not None:
            return hit
        red = info(r.op).reduction
        assert red is not None
        a = bind(r)
        src = a["self"]
        x = self.value(src, self.full_index)
        in_dtype = src.tensor.dtype
        adt = acc_dtype(red.combine, in_dtype, self.reduction_size)
        name = f"acc{len(self.accumulates)}"
        row = COMBINES[red.combine]
        value = cast(x, opmath(in_dtype)) if row.exact else cast(x, adt)
        metas = r.meta if isinstance(r.meta, tuple) else (r.meta,)
        out_t = [opmath(m.dtype) for m in metas]
        block = 0
        narrow = opmath(in_dtype) == torch.float32 == out_t[0]
        if red.combine is Combine.SUM and adt == torch.float64 and narrow and sum_in_runs(x):
            value, block = cast(x, torch.float32), SUM_BLOCK
        position: Ix | None = None
        if row.family is Family.ARGSELECT:
            position = Ix()
            for d in self.dims:
                position = position * self.full_shape[d] + self.full_index[d]
        self.accumulates[r] = Accumulate(name, red.combine, value, adt, position, block=block)
        count = self.reduction_size

        def acc(part: str, dtype: torch.dtype) -> Expr:
            return Expr("acc", (), dtype, (name, part))

        vdt = value.dtype
        if red.result == "value":
            results: tuple[Expr, ...] = (cast(acc("value", adt), out_t[0]),)
        elif red.result == "mean":
            results = (cast(acc("value", adt) / _count(count, adt), out_t[0]),)
        elif red.result == "index":
            results = (acc("index", torch.int64),)
        elif red.result == "value_index":
            results = (cast(acc("value", vdt), out_t[0]), acc("index", torch.int64))
        else:  # welford: var, or (var, mean)
            corr = a.get("correction")
            corr = 1 if corr is None else corr
            denom = max(count - corr, 0)
            var = cast(acc("m2", adt) / _count(denom, adt), out_t[0])
            if red.result == "var":
                results = (var,)
            else:
                results = (var, cast(acc("mean", adt), out_t[1]))
        self.rows.results(results)
        self.acc_results[r] = results
        return results

    # -- the whole kernel ------------------------------------------------------------------
    def check(self) -> None:
        self._roots()

    def _roots(self) -> tuple[list[_Root], list[Buffer]]:
        """The domain and every stored value: all that can refuse the group (NotFusable)."""
        if not self.order:
            raise NotFusable("empty group")
        outs = self.outputs()
        if not outs:
            raise NotFusable("the group produces nothing that is used")
        reductions = [m for m in self.order if info(m.op).kind == Kind.REDUCTION]
        if reductions:
            self._reduction_domain(reductions)
        elif self.fixed_domain is not None:
            self._set_domain(self.fixed_domain)
        else:
            self._pointwise_domain(outs)
        self.reduction_size = math.prod(self.full_shape[d] for d in self.dims)

        out_buffers: list[Buffer] = []
        roots: list[_Root] = []
        carried = self._carried() if self.fixed_domain is not None else {}
        for k, o in enumerate(outs):
            m = o.tensor
            guard = None
            if o in carried:
                idx = carried[o]
            elif m.shape == self.full_shape:
                idx = self.full_index
            elif reductions and m.shape in (self._kept_shape(True), self._kept_shape(False)):
                idx = self._kept_index(m.shape)
            elif _broadcasts_to(m.shape, self.full_shape, same_rank=bool(reductions)):
                # A smaller output the domain broadcasts: store it where the broadcast
                # dimensions are 0.
                idx = _broadcast(self.full_index, self.full_shape, m.shape)
                guard = _broadcast_guard(self.full_index, self.full_shape, m.shape)
            elif (reductions or self.fixed_domain) and m.numel == math.prod(self.full_shape):
                # Same elements, another shape (GroupNorm's [N, C, H, W] output of an
                # [N, G, C/G*H*W] reduction): walk the domain, store at the row-major match.
                idx = delinearize(linearize(self.full_index, self.full_shape), m.shape)
            else:
                raise NotFusable(
                    f"output {o.name} has shape {list(m.shape)}, the group computes "
                    f"{list(self.full_shape)}"
                )
            buf = Buffer(f"out{k}", m.dtype, "out", o.name, m.shape, m.stride)
            out_buffers.append(buf)
            self.out_buffers.append(buf)
            roots.append((buf, idx, cast(self.value(o, idx), m.dtype), guard))
        domain = math.prod(self.full_shape)
        extra = sum(domain - n.tensor.numel for n in self.recomputed)
        if extra > MAX_RECOMPUTED * domain:
            raise NotFusable(
                f"{len(self.recomputed)} broadcast values would be recomputed for every element"
            )
        return roots, out_buffers

    def _carried(self) -> dict[Node, tuple[Ix, ...]]:
        """Where each point of the fixed domain lands in the values computed from it: from
        the values computed another way (the GEMM result, over the domain) through members
        of the same shape and views that are bijections. An epilogue that stores each
        result there reads only its own tile's results, where storing in the output's
        row-major order would read a transpose of them (ConvNeXt's linear, scaled, then
        permuted back to NCHW for the residual add)."""
        at = {
            n: self.full_index
            for n in self.overrides
            if isinstance(n.meta, TensorMeta) and n.meta.shape == self.full_shape
        }
        users = self.g.users
        todo = list(at)
        while todo:
            n = todo.pop()
            for u in users.get(n, ()):
                if u in at or not isinstance(u.meta, TensorMeta):
                    continue
                row = info(u.op)
                if u in self.members and row.pointwise and u.meta.shape == n.tensor.shape:
                    at[u] = at[n]
                elif row.forward is not None and u.args[0] is n:
                    at[u] = row.forward(at[n], u.meta.shape, *u.args, **u.kw)
                else:
                    continue
                todo.append(u)
        return at

    def run(self) -> Kernel:
        roots, out_buffers = self._roots()
        passes = self._passes(roots)
        if self.checks and (self.fixed_domain is not None or (self.dims and not self.checked)):
            # A tile epilogue tests no divisor, nor does a C reduction (the C backend tests
            # them in pointwise kernels only; Triton's reductions raise a flag): they would
            # divide by zero without a word where torch raises. Such a group runs with torch.
            raise NotFusable(
                "an integer division whose divisor may be 0 in a reduction or epilogue"
            )
        kernel = Kernel(
            name=kernel_name(self.order),
            ops=tuple(m.op for m in self.order),
            buffers=tuple(self.in_buffers.values()) + tuple(out_buffers),
            outer=tuple(v for d, v in enumerate(self.full_vars) if d not in self.dims),
            inner=tuple(v for d, v in enumerate(self.full_vars) if d in self.dims),
            passes=passes,
            schedule=Schedule.POINTWISE if not self.dims else Schedule.ROWS,
            reduction_size=self.reduction_size,
            checks=tuple(self.checks),
        )
        return kernel if self.fixed_domain is not None else schedule(kernel)

    def _pointwise_domain(self, outs: list[Node]) -> None:
        """The loop domain of a pointwise group: the broadcast of its output shapes."""
        try:
            shape = tuple(torch.broadcast_shapes(*(o.tensor.shape for o in outs)))
        except RuntimeError:
            shapes = sorted({o.tensor.shape for o in outs})
            raise NotFusable(f"outputs have shapes {shapes} that do not broadcast") from None
        if not any(o.tensor.shape == shape for o in outs):
            raise NotFusable(f"no output covers the domain {list(shape)}")
        self._set_domain(shape)

    def _set_domain(self, shape: tuple[int, ...], dims: tuple[int, ...] = ()) -> None:
        self.full_shape = shape
        self.dims = dims
        self.full_vars = tuple(Var(f"i{d}", s) for d, s in enumerate(shape))
        self.full_index = tuple(Ix.var(v) for v in self.full_vars)
        self.inner_vars = frozenset(self.full_vars[d] for d in dims)

    def _kept_shape(self, keepdim: bool) -> tuple[int, ...]:
        if keepdim:
            return tuple(1 if d in self.dims else s for d, s in enumerate(self.full_shape))
        return tuple(s for d, s in enumerate(self.full_shape) if d not in self.dims)

    def _reduction_domain(self, reductions: list[Node]) -> None:
        why = mismatched_reductions(reductions)
        if why:
            raise NotFusable(why)
        self._set_domain(*reduction_domain(reductions[0]))

    def _passes(self, roots: list[_Root]) -> tuple[Pass, ...]:
        """Pass p accumulates the reductions whose inputs read only results of passes
        before p; a full-size output is stored in the first pass after the reductions it
        reads; a reduced-size output right after the last pass it reads."""
        stage: dict[str, int] = {}
        by_name = {a.name: a for a in self.accumulates.values()}

        def deps(e: Expr) -> int:
            """The pass after which every accumulator `e` reads is complete (-1: none)."""
            best = -1
            for sub in walk([e]):
                if sub.op == "acc":
                    best = max(best, stage_of(sub.value[0]))
            return best

        def stage_of(name: str) -> int:
            if name not in stage:
                stage[name] = deps(by_name[name].value) + 1
            return stage[name]

        for a in self.accumulates.values():
            stage_of(a.name)
        inner: dict[int, list[Store]] = {}
        after: dict[int, list[Store]] = {}
        for buf, idx, e, guard in roots:
            st = Store(buf.name, address(idx, buf.stride), e, guard)
            d = deps(e)
            if not self.dims or st.index.variables() & self.inner_vars:
                inner.setdefault(d + 1, []).append(st)
            else:
                after.setdefault(max(d, 0), []).append(st)
        n_passes = 1 + max([*stage.values(), *inner, *after, 0])
        passes = [
            Pass(
                tuple(a for a in self.accumulates.values() if stage[a.name] == p),
                tuple(inner.get(p, ())),
                tuple(after.get(p, ())),
            )
            for p in range(n_passes)
        ]
        return tuple(_reuse_across_passes(passes, {b.name: b for b in self.out_buffers}))


# Ops worth storing once rather than computing again in a later pass.
_COSTLY = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "log2",
        "log10",
        "tanh",
        "sigmoid",
        "erf",
        "erfc",
        "pow",
        "sin",
        "cos",
        "tan",
        "atan",
        "sinh",
        "cosh",
        "div",
    }
)


def _reuse_across_passes(passes: list[Pass], outs: dict[str, Buffer]) -> list[Pass]:
    """softmax's exp(x - max) is computed for the sum in one pass and again for the output
    in the next. Store it in the output during the first (same dtype: no rounding), and
    read it back in the second: the costly part runs once.

    Every use of it in the second pass reads it back, not only the output it was kept in:
    a recomputation can round differently (glibc's vector and scalar sinf differ in the
    last bit, and the two passes' loops vectorise differently), and amax's backward,
    which compares the maximum with == to the values it came from, then matched nothing."""
    for q in range(1, len(passes)):
        prev, cur = passes[q - 1], passes[q]
        if not prev.accumulates:
            continue
        shared = set(walk([a.value for a in prev.accumulates]))
        early: list[Store] = []
        subs: dict[Expr, Expr] = {}
        for st in cur.stores:
            buf = outs.get(st.buffer)
            pick = None
            if buf is not None and st.guard is None:
                for e in walk([substitute(st.value, subs)]):
                    if (
                        e in shared
                        and e.dtype == buf.dtype
                        and any(x.op in _COSTLY for x in walk([e]))
                    ):
                        pick = e  # walk is bottom-up: the last match is the largest
            if pick is None or buf is None:
                continue
            early.append(Store(st.buffer, st.index, pick))
            subs[pick] = Expr("load", (), buf.dtype, (st.buffer, st.index))
        if early:
            stores = tuple(
                Store(st.buffer, st.index, substitute(st.value, subs), st.guard)
                for st in cur.stores
            )
            accs = tuple(
                dataclasses.replace(a, value=substitute(a.value, subs)) for a in cur.accumulates
            )
            passes[q - 1] = Pass(prev.accumulates, (*prev.stores, *early), prev.after)
            passes[q] = Pass(accs, stores, cur.after)
    return passes


def _broadcasts_to(shape: Sequence[int], domain: Sequence[int], same_rank: bool) -> bool:
    if len(shape) > len(domain) or (same_rank and len(shape) != len(domain)):
        return False
    lead = len(domain) - len(shape)
    return all(s in (1, domain[k + lead]) for k, s in enumerate(shape))


def _broadcast_guard(idx: tuple[Ix, ...], domain: Sequence[int], shape: Sequence[int]) -> Ix | None:
    """Sum of the domain indices a broadcast output does not vary along (0 where it is
    stored), or None when there are none."""
    lead = len(domain) - len(shape)
    guard = Ix()
    for d in range(len(domain)):
        k = d - lead
        if domain[d] > 1 and (k < 0 or shape[k] == 1):
            guard = guard + idx[d]
    return guard if guard.terms else None


def _broadcast(idx: tuple[Ix, ...], out: Sequence[int], arg: Sequence[int]) -> tuple[Ix, ...]:
    lead = len(out) - len(arg)
    return tuple(Ix() if arg[k] == 1 else idx[k + lead] for k in range(len(arg)))


def _compute_dtype(n: Node) -> torch.dtype:
    """Pointwise ops compute in opmath of their result; predicates (bool results) in the
    promoted type of their operands, with torch's scalar and 0-d tensor rules."""
    out = n.tensor.dtype
    if out != torch.bool:
        return opmath(out)
    operands: list[Any] = []
    for name, v in bind(n).items():
        if name in info(n.op).keep:
            continue
        if isinstance(v, Node):
            operands.append(torch.empty(v.tensor.shape, dtype=v.tensor.dtype, device="meta"))
        elif isinstance(v, (bool, int, float)):
            operands.append(v)
    if not any(isinstance(o, torch.Tensor) for o in operands):
        return torch.bool
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    compute, _ = elementwise_dtypes(
        *operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )
    return opmath(compute)


def kernel_name(nodes: Sequence[Node], limit: int = 5) -> str:
    """Named after its contents, TVM style: fused_add_mul_relu."""
    names: list[str] = []
    for n in nodes:
        name = short(n.op).strip("_")
        if name not in names:
            names.append(name)
    extra = len(names) - limit
    return "fused_" + "_".join(names[:limit]) + (f"_and_{extra}_more" if extra > 0 else "")


def _count(n: int, dtype: torch.dtype) -> Expr:
    """A number of elements as a value of `dtype`: a Size stays its expression (a mean's
    divisor over symbolic sizes then prints alike for every size), an int a constant."""
    if isinstance(n, Size):
        return cast(position(Ix.of(n)), dtype)
    return const(n, dtype)


def lower_group(graph: Graph, members: Iterable[Node], checked: bool = False) -> Kernel:
    """Lower one fused group; raises NotFusable with the reason when it cannot be.
    `checked`: the backend tests integer divisors in reductions (else a reduction that
    divides by a value that may be 0 is refused)."""
    return _Lowering(graph, members, checked=checked).run()


def why_not_lowered(graph: Graph, members: Iterable[Node]) -> str | None:
    """Why `members` cannot be one kernel, or None: the fusion rules' question to the
    lowering (fusion/rules.Lowerable). Values and the domain are built, as only the lowering
    can; passes and the schedule, which never refuse, are not."""
    try:
        _Lowering(graph, members).check()
    except NotFusable as e:
        return str(e)
    return None


def lower_on_domain(
    graph: Graph,
    members: Iterable[Node],
    domain: tuple[int, ...],
    overrides: dict[Node, Any],
) -> tuple[Kernel, _Lowering]:
    """Lower pointwise `members` over a fixed `domain` (loop variables i0, i1, ... kept as
    they are: no merging, no reordering), computing `overrides` nodes with the given
    functions (lowering, index) -> Expr. Used for GEMM epilogues."""
    low = _Lowering(graph, members, domain, overrides)
    return low.run(), low


def schedule(kernel: Kernel) -> Kernel:
    from .schedule import finalize

    return finalize(kernel)
