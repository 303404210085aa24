"""The op table: one row per ATen op opfuse understands.

A row says what kind of op it is (the ordered `Kind`, TVM style: fusion rules compare kinds)
and, for pointwise ops, its scalar formula in terms of the primitives of `scalar.py` (the
longer ones in `formulas.py`); for views, how an index into the output maps to an index
into the input, and for gathers which input each output element comes from
(`indexmaps.py`); for reductions, what they accumulate. Ops missing from the table are
OPAQUE: they run with torch.

Formulas take the op's schema arguments by name. Tensor arguments arrive as scalar `Expr`s
already cast to the op's compute dtype (unless listed in `keep`); other arguments arrive as
the Python values the graph holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from .combine import Combine
from .formulas import (
    add_alpha,
    arange,
    clamp,
    counter_rand,
    div_mode,
    elu,
    elu_backward,
    eq,
    exp,
    gelu,
    gelu_backward,
    lerp,
    maximum,
    minimum,
    nan_to_num,
    pow_scalar,
    round_decimals,
    softplus,
    sub_alpha,
    tanh,
    truthy,
)
from .graph import Node, bind
from .index import Ix, Var
from .indexmaps import (
    fw_identity,
    fw_permute,
    fw_reshape,
    fw_t,
    fw_transpose,
    gather_cat,
    gather_pad,
    gather_slice_scatter,
    ix_as_strided,
    ix_expand,
    ix_flip,
    ix_identity,
    ix_permute,
    ix_repeat,
    ix_roll,
    ix_select,
    ix_slice,
    ix_squeeze,
    ix_t,
    ix_transpose,
    ix_unfold,
    ix_unsqueeze,
    ix_upsample_nearest,
    ix_view,
    norm_dim,
)
from .scalar import Expr, call, cast, where


class Kind(IntEnum):
    """Ordered op kinds: a lower kind fuses into a higher one's group more freely."""

    ELEMENTWISE = 0  # same-shape pointwise
    BROADCAST = 1  # pointwise reading a broadcast operand
    INJECTIVE = 2  # views: every output element reads one input element
    REDUCTION = 3
    ANCHOR = 4  # matmul / convolution: a library call that takes an epilogue
    OPAQUE = 5  # anything else: runs with torch


@dataclass(frozen=True)
class Reduction:
    """What a reduction op accumulates.

    combine: how values fold (ir/combine.py's table)
    result: which value(s) it returns: 'value', 'mean', 'var', 'var_mean', 'value_index'
    """

    combine: Combine
    result: str = "value"


@dataclass(frozen=True)
class OpInfo:
    kind: Kind
    formula: Callable[..., Any] | None = None
    keep: tuple[str, ...] = ()  # tensor args not cast to the compute dtype
    positional: bool = False  # the formula reads its element's position (_index=)
    index: Callable[..., tuple[Ix, ...]] | None = None  # views: out index -> input index
    # views that are bijections: input index -> out index (out shape, then the op's args)
    forward: Callable[..., tuple[Ix, ...]] | None = None
    reduction: Reduction | None = None
    # cat, constant_pad_nd: (read, out index, args) -> the element, read from one of the
    # inputs (read(node, index) -> Expr) or a constant
    gather: Callable[..., Expr] | None = None
    copies: bool = False  # injective, but eager materialises it (flip, repeat, cat, pad)

    @property
    def pointwise(self) -> bool:
        return self.kind <= Kind.BROADCAST


# -- the table -----------------------------------------------------------------
E = Kind.ELEMENTWISE  # BROADCAST is decided per node, from shapes (fusion/classify.py)


def pw(formula: Callable[..., Any], keep: tuple[str, ...] = ()) -> OpInfo:
    return OpInfo(E, formula, keep)


def view(
    index: Callable[..., tuple[Ix, ...]], forward: Callable[..., tuple[Ix, ...]] | None = None
) -> OpInfo:
    return OpInfo(Kind.INJECTIVE, index=index, forward=forward)


def copy_view(index: Callable[..., tuple[Ix, ...]]) -> OpInfo:
    return OpInfo(Kind.INJECTIVE, index=index, copies=True)


def gather(fn: Callable[..., Expr]) -> OpInfo:
    return OpInfo(Kind.INJECTIVE, gather=fn, copies=True)


def red(combine: str, result: str = "value") -> OpInfo:
    return OpInfo(Kind.REDUCTION, reduction=Reduction(Combine(combine), result))


def _u(prim: str) -> OpInfo:
    return pw(lambda self: call(prim, self))


OPAQUE = OpInfo(Kind.OPAQUE)
ANCHOR = OpInfo(Kind.ANCHOR)

# fmt: off
OPS: dict[str, OpInfo] = {
    # arithmetic
    "aten.add.Tensor": pw(add_alpha),
    "aten.add.Scalar": pw(add_alpha),
    "aten.sub.Tensor": pw(sub_alpha),
    "aten.sub.Scalar": pw(sub_alpha),
    "aten.rsub.Scalar": pw(lambda self, other, alpha=1: sub_alpha(other, self, alpha)),
    "aten.rsub.Tensor": pw(lambda self, other, alpha=1: sub_alpha(other, self, alpha)),
    "aten.mul.Tensor": pw(lambda self, other: self * other),
    "aten.mul.Scalar": pw(lambda self, other: self * other),
    "aten.div.Tensor": pw(lambda self, other: self / other),
    "aten.div.Scalar": pw(lambda self, other: self / other),
    "aten.div.Tensor_mode": pw(div_mode),
    "aten.div.Scalar_mode": pw(div_mode),
    "aten.true_divide.Tensor": pw(lambda self, other: self / other),
    "aten.floor_divide.default": pw(lambda self, other: call("floordiv", self, other)),
    "aten.floor_divide.Scalar": pw(lambda self, other: call("floordiv", self, other)),
    "aten.fmod.Tensor": pw(lambda self, other: call("fmod", self, other)),
    "aten.fmod.Scalar": pw(lambda self, other: call("fmod", self, other)),
    "aten.remainder.Tensor": pw(lambda self, other: call("remainder", self, other)),
    "aten.remainder.Scalar": pw(lambda self, other: call("remainder", self, other)),
    "aten.pow.Tensor_Scalar": pw(pow_scalar),
    "aten.pow.Tensor_Tensor": pw(lambda self, exponent: call("pow", self, exponent)),
    "aten.pow.Scalar": pw(lambda self, exponent: call("pow", self, exponent)),
    "aten.neg.default": pw(lambda self: -self),
    "aten.abs.default": _u("abs"),
    "aten.sign.default": _u("sign"),
    "aten.sgn.default": _u("sign"),
    "aten.reciprocal.default": _u("reciprocal"),
    "aten.square.default": pw(lambda self: self * self),
    "aten.maximum.default": pw(lambda self, other: maximum(self, other)),
    "aten.minimum.default": pw(lambda self, other: minimum(self, other)),
    "aten.fmax.default": pw(lambda self, other: call("fmax", self, other)),
    "aten.fmin.default": pw(lambda self, other: call("fmin", self, other)),
    "aten.atan2.default": pw(lambda self, other: call("atan2", self, other)),
    "aten.copysign.Tensor": pw(lambda self, other: call("copysign", self, other)),
    "aten.hypot.default": pw(lambda self, other: call("hypot", self, other)),
    "aten.addcmul.default": pw(lambda self, tensor1, tensor2, value=1: self + value * tensor1 * tensor2
                               if value != 1 else self + tensor1 * tensor2),
    "aten.addcdiv.default": pw(lambda self, tensor1, tensor2, value=1: self + value * tensor1 / tensor2
                               if value != 1 else self + tensor1 / tensor2),
    "aten.lerp.Scalar": pw(lerp),
    "aten.lerp.Tensor": pw(lerp),
    "aten.frac.default": pw(lambda self: self - call("trunc", self)),
    "aten.round.decimals": pw(round_decimals),
    # math
    **{f"aten.{p}.default": _u(p) for p in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos",
        "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
        "sigmoid", "erf", "erfc", "floor", "ceil", "trunc", "round", "lgamma")},
    # activations
    "aten.relu.default": pw(lambda self: maximum(self, 0)),
    "aten.gelu.default": pw(gelu),
    "aten.silu.default": pw(lambda self: self * call("sigmoid", self)),
    "aten.mish.default": pw(lambda self: self * tanh(softplus(self))),
    "aten.hardswish.default": pw(lambda self: self * clamp(self + 3, 0, 6) / 6),
    "aten.hardsigmoid.default": pw(lambda self: clamp(self + 3, 0, 6) / 6),
    "aten.hardtanh.default": pw(lambda self, min_val=-1, max_val=1: clamp(self, min_val, max_val)),
    "aten.clamp.default": pw(lambda self, min=None, max=None: clamp(self, min, max)),
    "aten.clamp.Tensor": pw(lambda self, min=None, max=None: clamp(self, min, max)),
    "aten.clamp_min.default": pw(lambda self, min: maximum(self, min)),
    "aten.clamp_max.default": pw(lambda self, max: minimum(self, max)),
    "aten.leaky_relu.default": pw(lambda self, negative_slope=0.01:
                                  where(self > 0, self, self * negative_slope)),
    "aten.elu.default": pw(elu),
    "aten.softplus.default": pw(softplus),
    "aten.nan_to_num.default": pw(nan_to_num),
    # comparisons, predicates, logic
    **{f"aten.{p}.{o}": pw(lambda self, other, _p=p: call(_p, self, other))
       for p in ("eq", "ne", "lt", "le", "gt", "ge") for o in ("Tensor", "Scalar")},
    "aten.isnan.default": _u("isnan"),
    "aten.isinf.default": _u("isinf"),
    "aten.isfinite.default": pw(lambda self: ~(call("isnan", self) | call("isinf", self))
                                if self.dtype.is_floating_point else eq(self, self)),
    "aten.signbit.default": _u("signbit"),
    "aten.logical_not.default": pw(lambda self: eq(self, 0), keep=("self",)),
    "aten.logical_and.default": pw(lambda self, other: truthy(self) & truthy(other),
                                   keep=("self", "other")),
    "aten.logical_or.default": pw(lambda self, other: truthy(self) | truthy(other),
                                  keep=("self", "other")),
    "aten.logical_xor.default": pw(lambda self, other: truthy(self) ^ truthy(other),
                                   keep=("self", "other")),
    "aten.bitwise_and.Tensor": pw(lambda self, other: self & other),
    "aten.bitwise_and.Scalar": pw(lambda self, other: self & other),
    "aten.bitwise_or.Tensor": pw(lambda self, other: self | other),
    "aten.bitwise_or.Scalar": pw(lambda self, other: self | other),
    "aten.bitwise_xor.Tensor": pw(lambda self, other: self ^ other),
    "aten.bitwise_xor.Scalar": pw(lambda self, other: self ^ other),
    "aten.bitwise_not.default": pw(lambda self: ~self),
    # selection, conversion, creation
    "aten.where.self": pw(lambda condition, self, other: where(condition, self, other),
                          keep=("condition",)),
    "aten.where.ScalarSelf": pw(lambda condition, self, other: where(condition, self, other),
                                keep=("condition",)),
    "aten.where.ScalarOther": pw(lambda condition, self, other: where(condition, self, other),
                                 keep=("condition",)),
    "aten.masked_fill.Scalar": pw(lambda self, mask, value: where(mask, value, self), keep=("mask",)),
    "aten.masked_fill.Tensor": pw(lambda self, mask, value: where(mask, value, self), keep=("mask",)),
    "aten._to_copy.default": pw(lambda self, **_: self, keep=("self",)),
    "aten.clone.default": pw(lambda self, **_: self, keep=("self",)),
    "aten.copy.default": pw(lambda self, src, non_blocking=False: src, keep=("self", "src")),
    "aten.lift_fresh_copy.default": pw(lambda self: self, keep=("self",)),
    "prims.convert_element_type.default": pw(lambda a, dtype: a, keep=("a",)),
    "prims.copy_strided.default": pw(lambda a, stride: a, keep=("a",)),  # layout change only
    "aten.scalar_tensor.default": pw(lambda s, **_: s),
    "aten.full.default": pw(lambda size, fill_value, **_: fill_value),
    "aten.full_like.default": pw(lambda self, fill_value, **_: fill_value, keep=("self",)),
    "aten.zeros_like.default": pw(lambda self, **_: 0, keep=("self",)),
    "aten.ones_like.default": pw(lambda self, **_: 1, keep=("self",)),
    "aten.fill.Scalar": pw(lambda self, value: value, keep=("self",)),
    "aten.arange.start_step": OpInfo(E, arange, positional=True),
    "aten.arange.start": OpInfo(E, arange, positional=True),
    "aten.arange.default": OpInfo(E, lambda end, _index, **kw: arange(0, end, 1, _index=_index),
                                  positional=True),
    # backward pointwise ops (AOTAutograd)
    "aten.threshold_backward.default": pw(lambda grad_output, self, threshold:
                                          where(self <= threshold, 0, grad_output)),
    "aten.sigmoid_backward.default": pw(lambda grad_output, output:
                                        grad_output * (1 - output) * output),
    "aten.tanh_backward.default": pw(lambda grad_output, output:
                                     grad_output * (1 - output * output)),
    "aten.gelu_backward.default": pw(gelu_backward),
    "aten.silu_backward.default": pw(lambda grad_output, self: grad_output * call("sigmoid", self)
                                     * (1 + self * (1 - call("sigmoid", self)))),
    # NaN inputs: the gradient eager computes in float64 (hardswish: NaN; hardtanh: 0)
    "aten.hardswish_backward.default": pw(lambda grad_output, self: where(
        self < -3, 0, where(self > 3, grad_output, grad_output * (self / 3 + 0.5)))),
    "aten.hardsigmoid_backward.default": pw(lambda grad_output, self: where(
        (self > -3) & (self < 3), grad_output / 6, 0)),
    "aten.hardtanh_backward.default": pw(lambda grad_output, self, min_val, max_val: where(
        (self > min_val) & (self < max_val), grad_output, 0)),
    "aten.leaky_relu_backward.default": pw(
        lambda grad_output, self, negative_slope, self_is_result:
        where(self > 0, grad_output, grad_output * negative_slope)),
    "aten.elu_backward.default": pw(elu_backward),
    "aten.softplus_backward.default": pw(lambda grad_output, self, beta, threshold: where(
        self * beta > threshold, grad_output,
        grad_output * exp(self * beta) / (exp(self * beta) + 1))),
    # rewrite/random.py's uniform numbers, computed where they are used
    "opfuse.rand.default": OpInfo(E, counter_rand, keep=("seed",), positional=True),
    # views: no data moves; fused groups read through their index maps
    "aten.view.default": view(ix_view, fw_reshape),
    "aten._unsafe_view.default": view(ix_view, fw_reshape),
    "aten.reshape.default": view(ix_view, fw_reshape),
    "aten.permute.default": view(ix_permute, fw_permute),
    "aten.transpose.int": view(ix_transpose, fw_transpose),
    "aten.t.default": view(ix_t, fw_t),
    "aten.expand.default": view(ix_expand),
    "aten.unsqueeze.default": view(ix_unsqueeze, fw_reshape),
    "aten.squeeze.dim": view(ix_squeeze, fw_reshape),
    "aten.squeeze.dims": view(ix_squeeze, fw_reshape),
    "aten.squeeze.default": view(ix_squeeze, fw_reshape),
    "aten.slice.Tensor": view(ix_slice),
    "aten.select.int": view(ix_select),
    "aten.alias.default": view(ix_identity, fw_identity),
    "aten.detach.default": view(ix_identity, fw_identity),
    "aten.as_strided.default": view(ix_as_strided),
    "aten.unfold.default": view(ix_unfold),
    # data movement eager copies; fused kernels read through it like a view
    "aten.flip.default": copy_view(ix_flip),
    "aten.repeat.default": copy_view(ix_repeat),
    "aten.roll.default": copy_view(ix_roll),
    "aten.upsample_nearest2d.default": copy_view(ix_upsample_nearest),
    "aten.cat.default": gather(gather_cat),
    "aten.constant_pad_nd.default": gather(gather_pad),
    "aten.slice_scatter.default": gather(gather_slice_scatter),
    "getitem": OpInfo(Kind.INJECTIVE),
    # reductions
    "aten.sum.dim_IntList": red("sum"),
    "aten.sum.default": red("sum"),
    "aten.mean.dim": red("sum", "mean"),
    "aten.mean.default": red("sum", "mean"),
    "aten.prod.dim_int": red("prod"),
    "aten.prod.default": red("prod"),
    "aten.amax.default": red("max"),
    "aten.amin.default": red("min"),
    "aten.max.default": red("max"),
    "aten.min.default": red("min"),
    "aten.max.dim": red("argmax", "value_index"),
    "aten.min.dim": red("argmin", "value_index"),
    "aten.argmax.default": red("argmax", "index"),
    "aten.argmin.default": red("argmin", "index"),
    "aten.var.correction": red("welford", "var"),
    "aten.var_mean.correction": red("welford", "var_mean"),
    "aten.any.default": red("any"),
    "aten.any.dim": red("any"),
    "aten.any.dims": red("any"),
    "aten.all.default": red("all"),
    "aten.all.dim": red("all"),
    # anchors: library calls that take a fused epilogue
    "aten.mm.default": ANCHOR,
    "aten.addmm.default": ANCHOR,
    "aten.bmm.default": ANCHOR,
    "aten.baddbmm.default": ANCHOR,
    "aten.convolution.default": ANCHOR,
    # a depthwise (or few-channel) convolution's NHWC output as rows (rewrite/conv_rows.py)
    "opfuse.depthwise_rows.default": ANCHOR,
    "opfuse.conv_rows.default": ANCHOR,
}
# fmt: on

# Ops whose result is a view of their input (they never launch a kernel).
VIEW_OPS = frozenset(k for k, v in OPS.items() if v.kind == Kind.INJECTIVE and not v.copies)


# The fused attention call rewrite/attention.py makes (the op: ir/attention.py): a library
# call of its own pattern.
ATTENTION = "opfuse.attention.default"
# rewrite/random.py's per-call seed: a torch call the kernels computing opfuse.rand read.
SEED = "opfuse.seed.default"


# A kernel reading through a cat evaluates every input at every position (the `where`
# keeps one): beyond this many loads per element (inputs, nested gathers adding up)
# torch's copy is cheaper (DenseNet's growing cats). Along the contiguous dimension a
# pointwise kernel cuts its vector loop at the gather's boundaries (lower/split.py) and
# each piece reads one input: such a gather costs its most expensive input.
MAX_GATHER_INPUTS = 8


def reads_through(n: Any) -> bool:
    """Is `n` a gather (cat, constant_pad_nd) that kernels compute where they read it?"""
    return _loads(n) is not None


def _loads(n: Any) -> int | None:
    """The loads a kernel reading through gather `n` makes per element; None when it is not
    read through. Nested gathers add up (a 3-d circular pad's cats of three along the outer
    dimensions: 9 per element)."""
    row = info(n.op)
    if row.gather is None or len(n.inputs()) > MAX_GATHER_INPUTS:
        return None
    m = n.meta
    inner = [d for d in range(len(m.shape)) if m.stride[d] == 1 and m.shape[d] > 1]
    if not inner:
        along: set[int] = set()
    elif n.op in ("aten.cat.default", "aten.slice_scatter.default"):
        along = {norm_dim(bind(n).get("dim", 0), len(m.shape))}
    else:
        along = {len(m.shape) - 1 - j // 2 for j, p in enumerate(bind(n)["pad"]) if p != 0}
    loads = []
    for i in n.inputs():
        while info(i.op).index is not None and isinstance(i.args[0], Node):
            i = i.args[0]  # views and index maps: the same loads as their source
        loads.append(_loads(i) or 1)
    split = inner and along == {inner[0]}
    total = max(loads) if split else sum(loads)
    return total if total <= MAX_GATHER_INPUTS else None


def computed_where_read(n: Any) -> bool:
    """Can a kernel compute copy `n` where it reads it: a gather within the load limit, or
    an index map that applies to n's arguments (nearest upsampling by 2, not by 3)?"""
    row = info(n.op)
    if row.gather is not None:
        return reads_through(n)
    if row.index is None:
        return False
    out = tuple(Ix.var(Var(f"i{d}", size)) for d, size in enumerate(n.meta.shape))
    try:
        row.index(out, *n.args, **n.kw)
    except ValueError:
        return False
    return True


# Ops torch runs whole by choice (capture keeps them from decomposing), by name prefix
# (leading underscores dropped), with what their decomposition measured: the report's
# reason for each such group.
TORCH_KERNELS = {
    "upsample": "torch's upsampling kernel (decomposed: gathers with index tensors, 2-50x slower)",
    "reflection_pad": "torch's padding kernel (decomposed: index gathers, 20-30x slower)",
    "replication_pad": "torch's padding kernel (decomposed: index gathers, 20-30x slower)",
    "im2col": "torch's unfold kernel (decomposed: index gathers, 3-4x slower)",
    "col2im": "torch's fold kernel (decomposed: index gathers, 3-4x slower)",
    "scaled_dot_product_flash_attention": "torch's flash attention kernel (decomposed: 0.73-0.91x)",
    "gru": "torch's recurrent layer (decomposed: a dozen ops per time step)",
    "rnn_": "torch's recurrent layer (decomposed: a dozen ops per time step)",
    "mkldnn_rnn_layer": "oneDNN's fused LSTM layer, as eager runs it",
}


# Torch ops outside the fused table whose result depends on their inputs alone (index
# gathers): on frozen constants their value is a constant, computed once at compile time
# (Swin's relative position bias table[index] ran as a gather on every call).
CONSTANT_FOLDABLE = frozenset(
    {
        "aten.index.Tensor",
        "aten.index_select.default",
        "aten.gather.default",
        "aten.embedding.default",
        "aten.take.default",
    }
)


def torch_kernel_reason(op: str) -> str | None:
    """Why torch runs `op` whole, if it is one of the ops kept from decomposing."""
    name = short(op).lstrip("_")
    return next((why for p, why in TORCH_KERNELS.items() if name.startswith(p)), None)


def short(op: str) -> str:
    """'aten.add.Tensor' -> 'add'; names without a namespace ('getitem', higher-order ops
    such as 'run_and_save_rng_state') as they are."""
    return op.split(".")[1] if "." in op else op


def info(op: str) -> OpInfo:
    return OPS.get(op, OPAQUE)


def is_generator(node: Any) -> bool:
    """A pointwise op that reads no tensor (full, scalar_tensor): free to recompute, so
    every kernel that reads it computes it inline instead of loading it."""
    return info(node.op).pointwise and not node.inputs()


def cast_args_for(op: str) -> Callable[[str], bool]:
    keep = info(op).keep
    return lambda name: name not in keep


__all__ = ["OPS", "VIEW_OPS", "Kind", "OpInfo", "Reduction", "cast", "info", "short"]


def reduce_dims(n: Node) -> tuple[tuple[int, ...], bool]:
    """The dims a reduction node reduces (sorted, non-negative) and its keepdim flag."""
    a = bind(n)
    src = a["self"].meta
    rank = len(src.shape)
    dim = a.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = tuple(range(rank))
    elif isinstance(dim, int):
        dims = (dim,)
    else:
        dims = tuple(dim)
    norm = tuple(sorted({d + rank if d < 0 else d for d in dims})) if rank else ()
    return norm, bool(a.get("keepdim", False))


def reduction_domain(n: Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape of the reduced input, dims it reduces): the loop nest a reduction runs."""
    return bind(n)["self"].tensor.shape, reduce_dims(n)[0]


def mismatched_reductions(reductions: Sequence[Node]) -> str | None:
    """Why these reductions (in topological order) cannot share one loop nest, or None:
    each must reduce the same dims of the same shape as the first."""
    if not reductions:
        return None
    first = reductions[0]
    shape, dims = reduction_domain(first)
    for r in reductions[1:]:
        s2, d2 = reduction_domain(r)
        if s2 != shape or d2 != dims:
            return (
                f"{r.name} reduces dims {list(d2)} of {list(s2)}, "
                f"{first.name} reduces dims {list(dims)} of {list(shape)}"
            )
    return None
