"""The rewrites in the order they run, each `pass(graph, ctx) -> Graph` recording what it
did in ctx (context.py). Each wraps one rewrite module; the order matters where a comment
says why."""

from __future__ import annotations

from ..context import Context
from ..ir.graph import Graph
from . import attention, batchnorm, cleanup, conv_rows, layout, pooling, random


def fold_batchnorm(graph: Graph, ctx: Context) -> Graph:
    """Inference BatchNorm into the convolution or linear before it (never in training)."""
    if not ctx.options.fold_batchnorm:
        return graph
    graph, folds, refusals = batchnorm.fold_batchnorm(graph)
    ctx.folds += folds
    ctx.refusals += refusals
    return graph


def split_to_views(graph: Graph, ctx: Context) -> Graph:
    return cleanup.split_to_views(graph)


def fold_constants(graph: Graph, ctx: Context) -> Graph:
    """Ops on frozen constants alone, evaluated once now."""
    found: list[str] = []
    return _noted(ctx, "fold_constants", (cleanup.fold_constants(graph, found), found))


def lower_batchnorm(graph: Graph, ctx: Context) -> Graph:
    """The BatchNorms left, as their statistics and pointwise ops."""
    return batchnorm.lower_batchnorm(graph)


def fuse_attention(graph: Graph, ctx: Context) -> Graph:
    if not ctx.options.fuse_attention:
        return graph
    return _noted(ctx, "fuse_attention", attention.fuse_attention(graph))


def channels_last(graph: Graph, ctx: Context) -> Graph:
    if ctx.options.layout != "channels-last":
        return graph
    relaid = layout.channels_last(graph)
    ctx.layout = relaid.note
    return relaid.graph


def convs_as_rows(graph: Graph, ctx: Context) -> Graph:
    # after the layout pass: only a channels-last input is a matrix of rows
    if not ctx.options.conv_rows:
        return graph
    result = conv_rows.convs_as_rows(graph, ctx.devices, ctx.options.winograd)
    return _noted(ctx, "convs_as_rows", result)


def pools_in_kernels(graph: Graph, ctx: Context) -> Graph:
    # after the layout pass: a pool over channels-last input reduces with lanes along C
    return _noted(ctx, "pools_in_kernels", pooling.pools_in_kernels(graph, ctx.devices))


def random_in_kernels(graph: Graph, ctx: Context) -> Graph:
    if ctx.options.random != "kernel":
        return graph
    return _noted(ctx, "random_in_kernels", random.random_in_kernels(graph, ctx.devices))


def copies_in_kernels(graph: Graph, ctx: Context) -> Graph:
    return cleanup.copies_in_kernels(graph)


def _noted(ctx: Context, name: str, result: tuple[Graph, list[str]]) -> Graph:
    """The rewritten graph; what the rewrite said goes into ctx's notes under `name`."""
    graph, notes = result
    for text in notes:
        ctx.note(name, text)
    return graph


REWRITES = (
    fold_batchnorm,
    split_to_views,
    fold_constants,
    lower_batchnorm,
    fold_constants,  # again: lowering BatchNorm leaves ops on its frozen statistics
    fuse_attention,
    channels_last,
    convs_as_rows,
    pools_in_kernels,
    random_in_kernels,
    copies_in_kernels,
)
