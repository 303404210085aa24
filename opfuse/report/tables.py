"""FusionReport: what got fused, what did not, and why."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GroupReport:
    id: int
    pattern: str  # elementwise | reduction | gemm_epilogue | conv_epilogue | library | fallback
    kernel: str  # generated kernel name, or the library/torch op it calls
    ops: list[str]  # ATen op names, in order
    nodes: list[str]  # graph value names
    modules: list[str]  # qualified names of the nn.Modules the ops came from
    sources: list[str]  # "module (file.py:line)" per op
    reason: str = ""  # fallback: why it runs with torch
    bytes_read: int = 0
    bytes_written: int = 0
    intermediates_saved: list[str] = field(default_factory=list)  # kept out of memory
    bytes_saved: int = 0  # intermediate traffic (write + read) the fusion avoids
    implementation: str = ""  # which implementation runs (epilogues) and why
    source_code: str = ""  # generated kernel source
    # copies eager makes (cat, pad, flip, nearest upsampling) the kernel computes where it
    # reads them: absorbed, never written
    reads_through: list[str] = field(default_factory=list)


@dataclass
class FoldReport:
    conv: str  # module (or node) the BatchNorm was folded into
    batchnorm: str


@dataclass
class RejectReport:
    producer: str
    consumer: str
    reason: str


@dataclass
class EdgeReport:
    """A tensor passed between groups (or from a graph input, or to the output)."""

    src: str  # "g3", "input:x", "const:weight"
    dst: str  # "g4", "output"
    shape: list[int]
    dtype: str


@dataclass
class FusionReport:
    kernels_before: int = 0
    kernels_after: int = 0
    groups: list[GroupReport] = field(default_factory=list)
    folds: list[FoldReport] = field(default_factory=list)
    rejected: list[RejectReport] = field(default_factory=list)
    bytes_before: int = 0  # intermediate memory traffic eager would have
    bytes_after: int = 0
    compile_seconds: float = 0.0
    cached: bool = False  # kernels came from the disk cache
    warnings: list[str] = field(default_factory=list)
    edges: list[EdgeReport] = field(default_factory=list)
    fusions: list[list[str]] = field(default_factory=list)  # [producer, consumer], in order
    layout: str = ""  # the activation layout chosen for convolutions, and why
    attention: list[str] = field(default_factory=list)  # attentions run as one fused call
    random: list[str] = field(default_factory=list)  # uniform draws generated in kernels
    backend: str = ""  # which backend generated the kernels, and why
    # ops whose inputs were all frozen constants: evaluated once at compile time
    constants: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)  # pools computed as window reductions
    passes: dict[str, float] = field(default_factory=dict)  # seconds per pass and stage
    # graphs with symbolic sizes: what was compiled once for every size, what runs with torch
    dynamic: list[str] = field(default_factory=list)
    # 1x1 and depthwise convolutions run as rows (rewrite/conv_rows.py)
    conv_rows: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def merge(self, other: FusionReport) -> FusionReport:
        """Combine the reports of several graphs (dynamo graph breaks, forward+backward)."""
        base = len(self.groups)
        groups = list(self.groups)
        for g in other.groups:
            groups.append(GroupReport(**{**asdict(g), "id": g.id + base}))

        def shift(name: str) -> str:
            return f"g{int(name[1:]) + base}" if name.startswith("g") else name

        edges = self.edges + [
            EdgeReport(shift(e.src), shift(e.dst), e.shape, e.dtype) for e in other.edges
        ]
        return FusionReport(
            self.kernels_before + other.kernels_before,
            self.kernels_after + other.kernels_after,
            groups,
            self.folds + other.folds,
            self.rejected + other.rejected,
            self.bytes_before + other.bytes_before,
            self.bytes_after + other.bytes_after,
            self.compile_seconds + other.compile_seconds,
            self.cached and other.cached,
            self.warnings + other.warnings,
            edges,
            self.fusions + other.fusions,
            "; ".join(x for x in (self.layout, other.layout) if x),
            self.attention + other.attention,
            self.random + other.random,
            self.backend or other.backend,
            self.constants + other.constants,
            self.pools + other.pools,
            {
                k: self.passes.get(k, 0.0) + other.passes.get(k, 0.0)
                for k in {**self.passes, **other.passes}
            },
            self.dynamic + other.dynamic,
            self.conv_rows + other.conv_rows,
        )

    def patterns(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.pattern] = out.get(g.pattern, 0) + 1
        return out

    def __str__(self) -> str:
        return format_table(self)

    def to_svg(self) -> str:
        """The model's graph, each fused group one box coloured by pattern."""
        from .picture import svg

        return svg(self)

    def to_html(self) -> str:
        """A self-contained page: picture, table, refusals, folds, generated sources."""
        from .picture import html

        return html(self)


def format_table(r: FusionReport, width: int = 100) -> str:
    """A plain-text table (the CLI renders a richer one with colours)."""
    lines = [
        f"opfuse: {r.kernels_before} kernels before -> {r.kernels_after} after "
        f"({len(r.folds)} BatchNorm folds, {len(r.rejected)} fusions refused)",
        f"{'#':>3}  {'pattern':<14} {'kernel':<34} ops",
    ]
    for g in r.groups:
        ops = ", ".join(short_name(o) for o in g.ops)
        text = f"{g.id:>3}  {g.pattern:<14} {g.kernel[:34]:<34} {ops}"
        if len(text) > width:
            text = text[: width - 3] + "..."
        lines.append(text)
        if g.reads_through:
            through = ", ".join(short_name(o) for o in g.reads_through)
            lines.append(f"{'':>5}{'':<14} reads through: {through}")
        if g.reason:
            lines.append(f"{'':>5}{'':<14} why: {g.reason}")
    lines.extend(f"{label}: {text}" if label else text for label, text in notes(r))
    return "\n".join(lines)


def notes(r: FusionReport) -> list[tuple[str, str]]:
    """(label, text) lines under the table: symbolic sizes, folds, refusals, attention,
    random draws, pools, compile-time constants, layout, backend. Shared by the plain and
    the CLI's table."""
    out = [("dynamic", d) for d in r.dynamic]
    out += [("fold", f"{f.batchnorm} -> {f.conv}") for f in r.folds]
    out += [("not fused", text) for text in _refusals(r.rejected)]
    out += [("attention", a) for a in r.attention]
    out += [("", a) for a in r.random]
    out += [("pool", p) for p in r.pools]
    if r.conv_rows:
        pw = sum("1x1" in t for t in r.conv_rows)
        dw = sum("depthwise" in t for t in r.conv_rows)
        wg = sum("Winograd" in t for t in r.conv_rows)
        # the rest: over a few input channels (rewrite/conv_rows.py)
        few = len(r.conv_rows) - pw - dw - wg
        kinds = [f"{pw} 1x1 as matmuls"] if pw else []
        kinds += [f"{dw} depthwise"] if dw else []
        kinds += [f"{wg} 3x3 for Winograd"] if wg else []
        kinds += [f"{few} over a few input channels"] if few else []
        out.append(
            (
                "conv rows",
                f"convolutions over channels-last rows: {', '.join(kinds)} "
                "(each also timed as oneDNN's convolution)",
            )
        )
    if r.constants:
        counts: dict[str, int] = {}
        for op in r.constants:
            counts[short_name(op)] = counts.get(short_name(op), 0) + 1
        ops = ", ".join(f"{k} x{c}" if c > 1 else k for k, c in counts.items())
        out.append(
            (
                "constants",
                f"{len(r.constants)} ops on frozen parameters computed at compile time ({ops})",
            )
        )
    if r.bytes_before:
        out.append(
            (
                "memory",
                f"intermediate traffic {human_bytes(r.bytes_before)} in eager -> "
                f"{human_bytes(r.bytes_after)} fused",
            )
        )
    if r.layout:
        out.append(("layout", r.layout))
    if r.backend and not r.backend.startswith("c "):
        out.append(("backend", r.backend))  # (the C backend is the default: not repeated)
    return out


# A reason given this many times or more is one line with a count (ResNet-18: 25 values
# that feed a convolution, a routine boundary, were 25 lines).
ROUTINE = 3


def _refusals(rejected: list[RejectReport]) -> list[str]:
    """One line per refusal, and one counted line per reason given ROUTINE times or more
    (the first examples named); in the order the reasons first appear."""
    by_reason: dict[str, list[RejectReport]] = {}
    for x in rejected:
        by_reason.setdefault(x.reason, []).append(x)
    out = []
    for reason, xs in by_reason.items():
        if len(xs) < ROUTINE:
            out += [f"{x.producer} -> {x.consumer}: {reason}" for x in xs]
            continue
        shown = ", ".join(f"{x.producer} -> {x.consumer}" for x in xs[:3])
        out.append(f"{len(xs)} times: {reason} ({shown}{', ...' if len(xs) > 3 else ''})")
    return out


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def short_name(op: str) -> str:
    """'aten.add.Tensor' -> 'add' (ir.ops.short, without importing torch here)."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op
