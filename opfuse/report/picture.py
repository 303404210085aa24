"""The report as a picture (SVG) and as a self-contained HTML page.

Each fused group is one box, coloured by pattern; edges carry tensor shapes. Graphviz
lays the graph out when its `dot` program is installed; otherwise a simple layered
layout drawn here does, so the picture never needs more than the standard library.
"""

from __future__ import annotations

import html as _html
import shutil
import subprocess
from collections.abc import Sequence

from .tables import FusionReport, GroupReport, human_bytes, notes, short_name

COLORS = {
    "elementwise": "#a6cee3",
    "reduction": "#b2df8a",
    "gemm_epilogue": "#fdbf6f",
    "conv_epilogue": "#fb9a99",
    "library": "#cab2d6",
    "attention": "#ffff99",
    "fallback": "#dddddd",
}
IO_COLOR = "#ffffff"
# What each colour means, for the picture's legend.
MEANING = {
    "elementwise": "pointwise ops, one kernel",
    "reduction": "a reduction and the ops around it, one kernel",
    "gemm_epilogue": "matmul + its epilogue",
    "conv_epilogue": "convolution + its epilogue",
    "library": "a library call (matmul, convolution) alone",
    "attention": "one fused attention call",
    "fallback": "runs with torch",
}


def _label_lines(g: GroupReport) -> list[str]:
    """Title, the module the ops came from, then the ops (at most 4 lines of 34)."""
    ops = list(dict.fromkeys(short_name(o) for o in g.ops))
    body = ", ".join(ops)
    lines = [f"#{g.id} {g.pattern}"]
    where = _where(g.modules)
    if where:
        lines.append(where if len(where) <= 34 else "..." + where[-31:])
    while body:
        lines.append(body[:34])
        body = body[34:]
        if len(lines) >= 4 and body:
            lines[-1] = lines[-1][:31] + "..."
            break
    return lines


def _where(modules: Sequence[str]) -> str:
    """The module a group's ops came from: its first op's (an epilogue group's matmul or
    convolution), and how many more there are."""
    if not modules:
        return ""
    more = f" (+{len(modules) - 1})" if len(modules) > 1 else ""
    return modules[0] + more


def _patterns(r: FusionReport) -> list[str]:
    present = {g.pattern for g in r.groups}
    return [p for p in COLORS if p in present]


def _nodes(r: FusionReport) -> list[str]:
    names = [f"g{g.id}" for g in r.groups]
    extra = [n for e in r.edges for n in (e.src, e.dst) if not n.startswith("g")]
    return list(dict.fromkeys([*(n for n in extra if n.startswith("input:")), *names, "output"]))


def dot_source(r: FusionReport) -> str:
    out = [
        "digraph opfuse {",
        '  graph [rankdir=TB, fontname="Helvetica", nodesep=0.3, ranksep=0.35];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8, color="#666666"];',
    ]
    for g in r.groups:
        label = "\\n".join(s.replace('"', "'") for s in _label_lines(g))
        out.append(f'  g{g.id} [label="{label}", fillcolor="{COLORS.get(g.pattern, "#eeeeee")}"];')
    for n in _nodes(r):
        if not n.startswith("g"):
            out.append(f'  "{n}" [shape=ellipse, fillcolor="{IO_COLOR}", label="{n}"];')
    for e in r.edges:
        shape = "x".join(str(s) for s in e.shape) or "scalar"
        out.append(f'  "{e.src}" -> "{e.dst}" [label="{shape}"];')
    out.append('  subgraph cluster_legend { label="legend"; fontsize=10; style=dashed;')
    for p in _patterns(r):
        out.append(
            f'    "legend:{p}" [label="{p}: {MEANING[p]}", fillcolor="{COLORS[p]}", fontsize=9];'
        )
    out.append("  }")
    out.append("}")
    return "\n".join(out)


def svg(r: FusionReport) -> str:
    dot = shutil.which("dot")
    if dot:
        try:
            res = subprocess.run(
                [dot, "-Tsvg"], input=dot_source(r), capture_output=True, text=True, timeout=60
            )
            if res.returncode == 0 and "<svg" in res.stdout:
                return res.stdout[res.stdout.index("<svg") :]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return _layered_svg(r)


def _layered_svg(r: FusionReport) -> str:
    """Longest-path layering, boxes in rows, straight edges."""
    nodes = _nodes(r)
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    for e in r.edges:
        if e.dst in preds and e.src in preds:
            preds[e.dst].append(e.src)
    level: dict[str, int] = {}

    def depth(n: str, seen: frozenset[str] = frozenset()) -> int:
        if n in level:
            return level[n]
        if n in seen:
            return 0
        d = 1 + max((depth(p, seen | {n}) for p in preds[n]), default=-1)
        level[n] = d
        return d

    for n in nodes:
        depth(n)
    rows: dict[int, list[str]] = {}
    for n in nodes:
        rows.setdefault(level[n], []).append(n)
    by_id = {f"g{g.id}": g for g in r.groups}
    w, h, gap_x, gap_y = 230, 74, 24, 46
    legend = _patterns(r)
    top = 16 * len(legend) + 16  # the legend's rows above the graph
    width = max(max(len(v) for v in rows.values()) * (w + gap_x) + gap_x, 420)
    pos: dict[str, tuple[float, float]] = {}
    for lv, members in rows.items():
        row_w = len(members) * (w + gap_x) - gap_x
        x0 = (width - row_w) / 2
        for i, n in enumerate(members):
            pos[n] = (x0 + i * (w + gap_x), top + gap_y + lv * (h + gap_y))
    height = top + gap_y + (max(rows) + 1) * (h + gap_y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#666"/></marker>'
        "</defs>",
    ]
    for k, p in enumerate(legend):
        ly = 10 + 16 * k
        parts.append(
            f'<rect x="10" y="{ly}" width="12" height="12" rx="2" fill="{COLORS[p]}" '
            'stroke="#333"/>'
        )
        parts.append(
            f'<text x="28" y="{ly + 10}" font-size="11">{p}: {_html.escape(MEANING[p])}</text>'
        )
    for e in r.edges:
        if e.src not in pos or e.dst not in pos:
            continue
        (x1, y1), (x2, y2) = pos[e.src], pos[e.dst]
        ax, ay, bx, by = x1 + w / 2, y1 + h, x2 + w / 2, y2
        shape = "x".join(str(s) for s in e.shape) or "scalar"
        parts.append(
            f'<line x1="{ax:.0f}" y1="{ay:.0f}" x2="{bx:.0f}" y2="{by:.0f}" stroke="#666" '
            'marker-end="url(#arrow)"/>'
        )
        parts.append(
            f'<text x="{(ax + bx) / 2 + 4:.0f}" y="{(ay + by) / 2:.0f}" font-size="9" '
            f'fill="#444">{_html.escape(shape)}</text>'
        )
    for n, (x, y) in pos.items():
        g = by_id.get(n)
        lines = _label_lines(g) if g else [n]
        fill = COLORS.get(g.pattern, "#eee") if g else IO_COLOR
        parts.append(
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{w}" height="{h}" rx="8" fill="{fill}" '
            'stroke="#333"/>'
        )
        for i, line in enumerate(lines):
            weight = ' font-weight="bold"' if i == 0 else ""
            parts.append(
                f'<text x="{x + 8:.0f}" y="{y + 16 + 14 * i:.0f}" font-size="11"{weight}>'
                f"{_html.escape(line)}</text>"
            )
    parts.append("</svg>")
    return "\n".join(parts)


_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
.badge { padding: 1px 6px; border-radius: 4px; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
.picture { overflow: auto; border: 1px solid #ddd; margin: 1em 0; }
"""


def _rows(groups: Sequence[GroupReport]) -> str:
    out = []
    for g in groups:
        color = COLORS.get(g.pattern, "#eee")
        ops = ", ".join(short_name(o) for o in g.ops)
        if g.reads_through:
            ops += " (reads through " + ", ".join(short_name(o) for o in g.reads_through) + ")"
        mods = ", ".join(g.modules)
        out.append(
            "<tr>"
            f"<td>{g.id}</td>"
            f'<td><span class="badge" style="background:{color}">{g.pattern}</span></td>'
            f"<td><code>{_html.escape(g.kernel)}</code></td>"
            f"<td>{_html.escape(ops)}</td>"
            f"<td>{_html.escape(mods)}</td>"
            f"<td>{human_bytes(g.bytes_saved) if g.bytes_saved else ''}</td>"
            f"<td>{_html.escape(g.implementation or g.reason)}</td>"
            "</tr>"
        )
    return "\n".join(out)


def html(r: FusionReport) -> str:
    rejected = "".join(
        f"<li><code>{_html.escape(x.producer)}</code> &rarr; <code>{_html.escape(x.consumer)}"
        f"</code>: {_html.escape(x.reason)}</li>"
        for x in r.rejected
    )
    layout = "".join(
        f"<br>{label.capitalize()}: {_html.escape(text)}."
        for label, text in notes(r)
        if label in ("layout", "constants", "attention", "backend")
    )
    folds = "".join(
        f"<li>{_html.escape(f.batchnorm)} folded into {_html.escape(f.conv)}</li>" for f in r.folds
    )
    sources = "".join(
        f"<details><summary><code>{_html.escape(g.kernel)}</code> ({g.pattern})</summary>"
        f"<pre>{_html.escape(g.source_code)}</pre></details>"
        for g in r.groups
        if g.source_code
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>opfuse fusion report</title>
<style>{_CSS}</style></head>
<body>
<h1>opfuse fusion report</h1>
<p>{r.kernels_before} kernels in eager &rarr; {r.kernels_after} with opfuse;
intermediate memory traffic {human_bytes(r.bytes_before)} &rarr; {human_bytes(r.bytes_after)};
{len(r.folds)} BatchNorm folds; {len(r.rejected)} fusions refused;
compiled in {r.compile_seconds:.2f} s.{layout}</p>
<div class="picture">{svg(r)}</div>
<h2>Groups</h2>
<table><tr><th>#</th><th>pattern</th><th>kernel</th><th>ops</th><th>modules</th>
<th>bytes kept out of memory</th><th>implementation / why</th></tr>
{_rows(r.groups)}
</table>
<h2>Not fused, and why</h2><ul>{rejected or "<li>none</li>"}</ul>
<h2>BatchNorm folds</h2><ul>{folds or "<li>none</li>"}</ul>
<h2>Generated kernels</h2>{sources or "<p>none</p>"}
</body></html>
"""
