"""Every group -> the implementations it could run with (candidates), lowered.

elementwise / reduction groups: one generated kernel.
epilogue groups: "unfused" always (library call + epilogue kernel); "blocked" (GEMM tiles
with the epilogue in cache) when BLAS can run the matmul; "onednn" when the epilogue is a
post-op oneDNN fuses. A lone convolution may run as torch's call or as oneDNN with its
weight prepacked; a lone matmul with a frozen weight as torch's call, MKL's packed GEMM
("mkl"), the blocked GEMM, or oneDNN's packed GEMM (bfloat16; float32 where the user set
torch.set_float32_matmul_precision below "highest", and otherwise over K in blocks of at
most 64, "onednn-kblocks", which keeps MKL's accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..fusion.groups import Group, Partition, Pattern
from ..ir.graph import Graph, Node, bind
from ..ir.size import deciding, is_size
from ..rewrite.conv_rows import ROW_CONVS, convolution_of
from ..rewrite.layout import is_channels_last as channels_last
from .depthwise import DepthwiseKernel, implementation_of, lower_depthwise
from .dw_gemm import DwGemmKernel, pair_depthwise_gemms
from .epilogue import (
    GEMMS,
    GemmKernel,
    OneDnnPlan,
    PackedThenKernel,
    const_root,
    lower_blocked,
    lower_unfused,
    match_onednn,
    own_gemm,
)
from .gemm_tiles import own_tiles
from .kernel import Kernel
from .lowering import NotFusable, lower_group

# oneDNN's float32 GEMM accumulates K in one chain; split into equal blocks of at most this
# many, each block's product added onto the sum so far, it is as close to float64 as MKL's.
# Measured over 150 random linears (m 1-200, K 129-1500, n 1-300; max error vs float64,
# ratio to MKL's): blocks of 64: median 0.57, never above 0.84; of 96: median 0.66, above 1
# in 3; of 128: median 0.75, above 1 in 6 (up to 1.26) -- fastest, but not always as close.
K_BLOCK = 64


def k_blocks(k: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of K in equal blocks of at most K_BLOCK (a short last block would
    add its product to the sum of all the others alone)."""
    count = -(-k // K_BLOCK)
    size, extra = divmod(k, count)
    cuts, lo = [], 0
    for i in range(count):
        hi = lo + size + (1 if i < extra else 0)
        cuts.append((lo, hi))
        lo = hi
    return cuts


# None: torch
Candidate = (
    Kernel | GemmKernel | DepthwiseKernel | DwGemmKernel | OneDnnPlan | PackedThenKernel | None
)

# The names of the candidates below (Options.implementation forces one where it exists).
IMPLEMENTATIONS = (
    "unfused",
    "blocked",
    "opfuse-gemm",
    "opfuse-dw",
    "opfuse-conv",
    "opfuse-winograd",
    "opfuse-dw-gemm",
    "opfuse-expand-dw",
    "opfuse-expand-dw-gemm",
    "onednn",
    "onednn-nhwc",
    "mkl",
    "mkl-unfused",
    "onednn-unfused",
    "onednn-kblocks",
    "onednn-kblocks-unfused",
    "torch",
)


@dataclass
class Lowered:
    candidates: dict[int, dict[str, Candidate]] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)  # why a candidate is missing


def lower_groups(
    graph: Graph, part: Partition, threads: int | None = None, checked: bool = False
) -> Lowered:
    """`checked`: the backend tests integer divisors in reductions (Triton)."""
    threads = threads or torch.get_num_threads()
    out = Lowered()
    for g in part.groups:
        out.candidates[g.id], out.notes[g.id] = _candidates(graph, g, threads, checked)
        if not out.candidates[g.id] and g.pattern.generated:
            g.pattern, g.reason = Pattern.FALLBACK, "; ".join(out.notes[g.id])
    pair_depthwise_gemms(graph, part, out.candidates, threads)
    return out


def _blocked(
    cands: dict[str, Candidate],
    notes: list[str],
    graph: Graph,
    anchor: Node,
    members: list[Node],
    threads: int,
) -> None:
    """The blocked GEMM candidates: tiles by the library ("blocked") and by opfuse's own
    GEMM ("opfuse-gemm"), each epilogue applied to the tile in cache."""
    try:
        k = lower_blocked(graph, anchor, members, threads)
    except NotFusable as e:
        notes.append(f"blocked GEMM: {e}")
        return
    cands["blocked"] = k
    try:
        own = own_gemm(k)
        # opfuse's GEMM takes tiles of its own (gemm_tiles.own_tiles: columns in its panels
        # of 32, rows split where few rows would share wide columns; expressions of a
        # symbolic row count), with the decisions they took
        with deciding() as decided:
            tile = own_tiles(k.spec, threads, any(m is not anchor for m in members))
        if any(map(is_size, tile)) or tile != (k.tile_m, k.tile_n):
            own = own_gemm(lower_blocked(graph, anchor, members, threads, tile, decided))
        else:
            own = replace(own, decided=decided)
        cands["opfuse-gemm"] = own
    except NotFusable as e:
        notes.append(f"opfuse-gemm: {e}")


def _candidates(
    graph: Graph, g: Group, threads: int, checked: bool
) -> tuple[dict[str, Candidate], list[str]]:
    notes: list[str] = []
    if g.pattern.generated:
        try:
            return {"kernel": lower_group(graph, g.nodes, checked)}, notes
        except NotFusable as e:  # the partitioner checked this; keep going regardless
            return {}, [f"could not be lowered: {e}"]
    if g.anchor is not None and g.anchor.op in ROW_CONVS:
        return _depthwise(graph, g, threads)
    if g.pattern.epilogue:
        assert g.anchor is not None
        unfused = lower_unfused(graph, g.anchor, g.nodes)
        cands: dict[str, Candidate] = {"unfused": unfused}
        if g.anchor.op in ("aten.addmm.default", "aten.mm.default") and _constant_weights(
            graph, g.anchor
        ):
            if g.anchor.tensor.dtype == torch.float32:
                cands["mkl-unfused"] = PackedThenKernel(g.anchor, unfused)
            if _onednn_gemm_allowed(g.anchor):
                cands["onednn-unfused"] = PackedThenKernel(g.anchor, unfused, "onednn")
            elif _k_blocks_pay(g.anchor):
                cands["onednn-kblocks-unfused"] = PackedThenKernel(
                    g.anchor, unfused, "onednn-kblocks"
                )
        if g.pattern is Pattern.GEMM_EPILOGUE:
            _blocked(cands, notes, graph, g.anchor, g.nodes, threads)
        conv = convolution_of(graph, g.anchor)  # a 1x1 convolution's matmul: or oneDNN's
        plan = match_onednn(graph, g.anchor, g.nodes, conv[0] if conv is not None else None)
        if (
            plan is not None
            and conv is None
            and g.pattern is Pattern.GEMM_EPILOGUE
            and not _onednn_gemm_allowed(g.anchor)
        ):
            notes.append(
                "oneDNN: its float32 GEMM is further from float64 than MKL's (allowed "
                "below torch's 'highest' float32 matmul precision)"
            )
            plan = None
        elif plan is not None and not _constant_weights(graph, g.anchor):
            notes.append("oneDNN: the weights are not frozen constants")
            plan = None
        elif plan is not None:
            cands["onednn"] = plan
            if g.pattern is Pattern.CONV_EPILOGUE and not channels_last(g.anchor.tensor):
                cands["onednn-nhwc"] = plan
        elif not any("oneDNN" in n for n in notes):
            notes.append("oneDNN: the epilogue is not a post-op it fuses")
        return cands, notes
    a = g.anchor
    if g.pattern is Pattern.LIBRARY and a is not None and a.op in GEMMS:
        cands = {"torch": None}
        if a.op != "aten.bmm.default" and _constant_weights(graph, a):
            cands["mkl"] = OneDnnPlan(a, a)  # packed MKL GEMM, as inductor's freezing runs it
            if _onednn_gemm_allowed(a):
                # oneDNN's packed GEMM runs bfloat16 on AMX (BERT-base linears 15-35%
                # faster than torch's addmm; MKL's packed GEMM is float32 only)
                cands["onednn"] = OneDnnPlan(a, a)
            elif _k_blocks_pay(a):
                cands["onednn-kblocks"] = OneDnnPlan(a, a)
        conv = convolution_of(graph, a)
        if conv is not None:  # the 1x1 convolution itself, its result handed on as rows
            cands["onednn"] = OneDnnPlan(conv[0], a)
        _blocked(cands, notes, graph, a, [a], threads)
        return cands, notes
    if (
        g.pattern is Pattern.LIBRARY
        and a is not None
        and a.op == "aten.convolution.default"
        and a.tensor.dtype in (torch.float32, torch.bfloat16)
    ):
        plan = OneDnnPlan(a, a)
        if channels_last(a.tensor):  # the graph already runs NHWC
            return {"torch": None, "onednn": plan}, notes
        return {"torch": None, "onednn": plan, "onednn-nhwc": plan}, notes
    return {}, notes


def _depthwise(graph: Graph, g: Group, threads: int) -> tuple[dict[str, Candidate], list[str]]:
    """A depthwise (or few-channel) convolution's rows (rewrite/conv_rows.py): torch's call
    (then the epilogue kernel), oneDNN's convolution with its post-ops, opfuse's direct
    kernel ("opfuse-dw", "opfuse-conv", "opfuse-winograd")."""
    a = g.anchor
    assert a is not None
    notes: list[str] = []
    cands: dict[str, Candidate] = {}
    if g.pattern.epilogue:
        cands["unfused"] = lower_unfused(graph, a, g.nodes)
    else:
        cands["torch"] = None
    conv = convolution_of(graph, a)
    if conv is not None:
        plan = match_onednn(graph, a, g.nodes, conv[0]) if g.pattern.epilogue else None
        if plan is not None:
            cands["onednn"] = plan
        elif not g.pattern.epilogue:  # the convolution alone, its result handed on as rows
            cands["onednn"] = OneDnnPlan(conv[0], a)
        else:
            notes.append("oneDNN: the epilogue is not a post-op it fuses")
    try:
        k = lower_depthwise(graph, a, g.nodes, threads)
        cands[k.implementation] = k
    except NotFusable as e:
        notes.append(f"{implementation_of(a)}: {e}")
    return cands, notes


def _onednn_gemm_allowed(anchor: Node) -> bool:
    """May this matmul run as oneDNN's GEMM? Any dtype but float32; float32 only where the
    user allowed less than full float32 matmul precision (torch.set_float32_matmul_precision
    "high" or "medium"). Measured on AVX-512, BERT/GPT-2 linears (1024 x 768 x 3072 and
    50257): oneDNN 22.0 ms, torch's addmm 27.1, MKL's packed GEMM 26.9 -- but oneDNN's error
    against float64 is 2-3x MKL's at the maximum and 1.4-2.1x on average (GPT-2 b8 logits
    4.3e-4 where eager's are 1.8e-4), over what "highest" promises. (Convolutions run
    oneDNN in eager too.)"""
    return anchor.tensor.dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest"


def _k_blocks_pay(anchor: Node) -> bool:
    """May this float32 matmul run as oneDNN's GEMM over K in blocks (each block one call,
    the next adding onto its result: backends/c/module.chunked_linear_call)? Where oneDNN's
    one-call float32 GEMM is not allowed, this is: its error stays within MKL's (K_BLOCK).
    Speed, measured here against MKL's 156-164 GF/s on 2 threads: 255 GF/s at 128 x 768 x
    3072, 146 at 128 x 3072 x 768 (48 calls), so the tuner decides. One block is oneDNN's
    one call, and must not pass for this candidate."""
    if anchor.tensor.dtype != torch.float32 or anchor.op not in (
        "aten.addmm.default",
        "aten.mm.default",
    ):
        return False
    a = bind(anchor)
    x = a["mat1"] if anchor.op == "aten.addmm.default" else a["self"]
    return isinstance(x, Node) and x.tensor.shape[-1] > K_BLOCK


def _constant_weights(graph: Graph, anchor: Node) -> bool:
    a = bind(anchor)
    w = a.get("weight", a.get("mat2"))
    return isinstance(w, Node) and const_root(w) is not None
