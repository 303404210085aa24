"""Bench results and how they are shown: the markdown tables, the terminal, the plots."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .timing import Timing, paired_ratio


@dataclass
class Result:
    case: str
    group: str
    timings: dict[str, Timing] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)  # name -> seconds
    bytes: int = 0
    copy: Timing | None = None
    bare: dict[str, Timing] = field(default_factory=dict)  # GEMM/conv without epilogue
    kernels_before: int = 0
    kernels_after: int = 0
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # working/process
    samples_per_second: dict[str, float] = field(default_factory=dict)
    # training: eager step / (its library calls + optimizer update), the most any fusion of
    # the rest can give
    ceiling: float | None = None
    error: str = ""
    wall_seconds: float = 0.0  # what the case took in all: compiles, checks, timing
    left_out: dict[str, str] = field(default_factory=dict)  # candidate -> why not timed
    compiles: dict[str, int] = field(default_factory=dict)  # dynamic rows: graphs compiled

    def speedup(self, base: str) -> float | None:
        """base's time over opfuse's: the median of the per-round ratios."""
        if "opfuse" not in self.timings or base not in self.timings:
            return None
        return paired_ratio(self.timings[base], self.timings["opfuse"])

    def bandwidth_pct(self) -> float | None:
        if not self.bytes or self.copy is None or "opfuse" not in self.timings:
            return None
        return 100.0 * self.copy.median / self.timings["opfuse"].median

    def epilogue_cost(self) -> float | None:
        """Fused op time over the bare library call's time, minus one: the median of the
        per-round ratios (the two run back to back in each round)."""
        if "torch" not in self.bare or "opfuse" not in self.timings:
            return None
        return paired_ratio(self.timings["opfuse"], self.bare["torch"]) - 1.0


# -- reporting ---------------------------------------------------------------------------------
def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else ""


def _ms(t: dict[str, Timing], k: str) -> str:
    return f"{t[k].median * 1e3:.2f}" if k in t else ""


def markdown(results: list[Result], title: str) -> str:
    out = [f"### {title}", ""]
    micro = [r for r in results if r.group in ("elementwise", "reduction", "gemm")]
    if micro:
        out += [
            "| pattern | eager ms | inductor ms | opfuse ms | vs eager | vs inductor "
            "| % of copy bw | "
            "epilogue cost | kernels |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in micro:
            if r.error:
                out.append(f"| {r.case} | | | | | | | | **{r.error}** |")
                continue
            pct = r.bandwidth_pct()
            cost = r.epilogue_cost()
            out.append(
                f"| {r.case} | {_ms(r.timings, 'eager')} | {_ms(r.timings, 'inductor')} | "
                f"{_ms(r.timings, 'opfuse')} | {_x(r.speedup('eager'))} | "
                f"{_x(r.speedup('inductor'))} | {f'{pct:.0f}%' if pct is not None else ''} | "
                f"{f'{cost * 100:+.1f}%' if cost is not None else ''} | "
                f"{r.kernels_before} → {r.kernels_after} |"
            )
        out.append("")
    models = [r for r in results if r.group == "model"]
    if models:
        out += [
            "| model | eager ms | inductor ms | inductor+freezing ms | opfuse ms | vs eager | "
            "vs inductor+freezing | compile s, empty caches / cached (opfuse, inductor) "
            "| kernels |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in models:
            if r.error:
                out.append(f"| {r.case} | | | | | | | | **{r.error}** |")
                continue
            c = r.compile_seconds
            comp = (
                f"{c.get('opfuse cold', 0):.1f} / {c.get('opfuse warm', 0):.1f}, "
                f"{c.get('inductor cold', 0):.1f} / {c.get('inductor warm', 0):.1f}"
            )
            out.append(
                f"| {r.case} | {_ms(r.timings, 'eager')} | {_ms(r.timings, 'inductor')} | "
                f"{_ms(r.timings, 'inductor-freezing')} | {_ms(r.timings, 'opfuse')} | "
                f"{_x(r.speedup('eager'))} | {_x(r.speedup('inductor-freezing'))} | {comp} | "
                f"{r.kernels_before} → {r.kernels_after} |"
            )
        out.append("")
        out += _engines_table(models)
    out += _dynamic_table([r for r in results if r.group == "dynamic"])
    train = [r for r in results if r.group == "training"]
    if train:
        out += [
            "| training step | eager samples/s | inductor samples/s | opfuse samples/s "
            "| vs eager | "
            "vs inductor | ceiling vs eager |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in train:
            if r.error:
                out.append(f"| {r.case} | | | | **{r.error}** | | |")
                continue
            s = r.samples_per_second
            out.append(
                f"| {r.case} | {s.get('eager', 0):.2f} | {s.get('inductor', 0):.2f} | "
                f"{s.get('opfuse', 0):.2f} | {_x(r.speedup('eager'))} | "
                f"{_x(r.speedup('inductor'))} | {_x(r.ceiling)} |"
            )
        out += [
            "",
            "ceiling: eager's step time over the time its GEMM/convolution calls and the "
            "optimizer's update take (torch profiler), the speedup a compiler would reach "
            "if everything else cost nothing.",
        ]
        out.append("")
    mem = [r for r in results if r.group == "memory"]
    if mem:
        out += [
            "| peak memory, fresh process per candidate | measure | eager MiB | inductor MiB "
            "| inductor+freezing MiB | opfuse MiB | opfuse vs eager |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in mem:
            if r.error:
                out.append(f"| {r.case} | | | | | **{r.error}** |")
                continue
            for what, p in r.memory.items():
                drop = 1 - p["opfuse"] / p["eager"] if p.get("eager") else 0
                frozen = p.get("inductor-freezing")
                out.append(
                    f"| {r.case} | {what} | {p['eager'] / 2**20:.0f} | "
                    f"{p['inductor'] / 2**20:.0f} | "
                    f"{'' if frozen is None else f'{frozen / 2**20:.0f}'} | "
                    f"{p['opfuse'] / 2**20:.0f} | {-drop * 100:+.0f}% |"
                )
        out.append("")
        out += _fresh_compile_table(mem)
    if micro or models or train:
        out += [
            "vs columns and epilogue cost: the median over timing rounds of the two calls' "
            "ratio (each round runs every candidate once), so drift between rounds cancels; "
            "they can differ from the ratio of the ms columns (medians).",
            "",
        ]
    if micro:
        out += [
            "% of copy bw: the time torch's copy takes to read and write as many bytes as the "
            "case must, over opfuse's time: a reference, not a ceiling. Over 100% means "
            "opfuse moved its bytes faster than that copy did: its data stayed in a cache "
            "level between calls where the copy's source and destination did not, or the "
            "copy itself ran below the memory's bandwidth.",
            "",
        ]
    out += _time_spent(results)
    return "\n".join(out)


_PARTS = {"elementwise": "patterns", "reduction": "patterns", "gemm": "patterns", "model": "models"}


OTHERS = ("inductor-freezing", "onnxruntime", "openvino")


def _engines_table(models: list[Result]) -> list[str]:
    """opfuse against every CPU inference engine measured in the same rounds; the ratio is
    to the fastest of them (the target of issue 30: at least as fast as the best)."""
    rows = [r for r in models if not r.error and ({"onnxruntime", "openvino"} & set(r.timings))]
    if not rows:
        left = sorted({f"{k}: {v}" for r in models for k, v in r.left_out.items()})
        return [f"not timed: {'; '.join(left)}", ""] if left else []
    out = [
        "| model | opfuse ms | inductor+freezing ms | onnxruntime ms | openvino ms | "
        "opfuse vs the fastest other |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        timed = [k for k in OTHERS if k in r.timings]
        best = min(timed, key=lambda k: r.timings[k].median)
        cells = " | ".join(_ms(r.timings, k) or r.left_out.get(k, "")[:40] for k in OTHERS)
        out.append(
            f"| {r.case} | {_ms(r.timings, 'opfuse')} | {cells} | {_x(r.speedup(best))} ({best}) |"
        )
    out.append("")
    return out


def _time_spent(results: list[Result]) -> list[str]:
    """Where the run's time went, per part of the suite (the whole run has a budget)."""
    spent: dict[str, float] = {}
    for r in results:
        part = _PARTS.get(r.group, r.group)
        spent[part] = spent.get(part, 0.0) + r.wall_seconds
    if not any(spent.values()):
        return []
    parts = ", ".join(f"{k} {v / 60:.1f} min" for k, v in spent.items())
    return [f"time spent: {parts}", ""]


def _fresh_compile_table(mem: list[Result]) -> list[str]:
    rows = [r for r in mem if not r.error and r.compile_seconds]
    if not rows:
        return []
    out = [
        "| cold compile: fresh process, empty caches (training: first step) | inductor s "
        "| inductor+freezing s | opfuse s | opfuse / inductor |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = {k.removesuffix(" fresh process"): v for k, v in r.compile_seconds.items()}
        frozen = c.get("inductor-freezing")
        ratio = c["opfuse"] / c["inductor"] if c.get("inductor") else None
        out.append(
            f"| {r.case} | {c.get('inductor', 0):.1f} | "
            f"{'' if frozen is None else f'{frozen:.1f}'} | {c.get('opfuse', 0):.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    out.append("")
    return out


def print_table(text: str) -> None:
    """Rich tables on a terminal; the markdown itself when piped (logs, CI)."""
    import sys

    if not sys.stdout.isatty():
        print(text)
        return
    try:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
    except ImportError:
        print(text)


def plots(results: list[Result], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    models = [r for r in results if r.group == "model" and not r.error]
    if models:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        names = [r.case for r in models]
        xs = range(len(models))
        for i, (cand, color) in enumerate(
            [("inductor", "#999999"), ("inductor-freezing", "#555555"), ("opfuse", "#d95f02")]
        ):
            vals = [
                paired_ratio(r.timings["eager"], r.timings[cand]) if cand in r.timings else 0
                for r in models
            ]
            ax.bar([x + (i - 1) * 0.27 for x in xs], vals, width=0.27, label=cand, color=color)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup over eager")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)
        made.append("speedup.png")
    micro = [r for r in results if r.bandwidth_pct() is not None and not r.error]
    if micro:
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.barh([r.case for r in micro], [r.bandwidth_pct() or 0 for r in micro], color="#1b9e77")
        ax.axvline(80, color="black", linestyle="--", linewidth=0.8)
        ax.set_xlabel("effective bandwidth, % of copy at the same size")
        fig.tight_layout()
        fig.savefig(out / "bandwidth.png", dpi=120)
        plt.close(fig)
        made.append("bandwidth.png")
    return made


def _dynamic_table(rows: list[Result]) -> list[str]:
    """Models called with a new size every call (bench/dynamic.py)."""
    if not rows:
        return []
    out = [
        "| new size every call | eager ms | inductor ms | opfuse ms | opfuse.compile ms "
        "| opfuse static ms | vs eager | vs inductor | vs opfuse static "
        "| graphs (opfuse, inductor) | opfuse compiles | C builds (opfuse, opfuse.compile) "
        "| first call s (opfuse, opfuse.compile, inductor) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in rows:
        if r.error:
            out.append(f"| {r.case} | | | | | | | | | | | | **{r.error}** |")
            continue
        t, c, n = r.timings, r.compile_seconds, r.compiles
        first = [f"{c[k]:.1f}" if k in c else "" for k in ("opfuse first", "compile() first")]
        first.append(f"{c.get('inductor first', 0):.1f}")
        out.append(
            f"| {r.case} | {_ms(t, 'eager')} | {_ms(t, 'inductor')} | {_ms(t, 'opfuse')} | "
            f"{_ms(t, 'opfuse.compile')} | "
            f"{_ms(t, 'opfuse static')} | {_x(r.speedup('eager'))} | "
            f"{_x(r.speedup('inductor'))} | "
            f"{_x(r.speedup('opfuse static'))} | "
            f"{n.get('opfuse', '')}, {n.get('inductor', '')} | "
            f"{n.get('opfuse compiles', '')} | "
            f"{n.get('opfuse builds', '')}, {n.get('compile() builds', '')} | "
            f"{', '.join(first)} |"
        )
    out += [
        "",
        "graphs: graphs dynamo handed each backend over the whole row (none for a new size "
        "once one with symbolic sizes is compiled); opfuse compiles: opfuse's compiles in "
        "the row (a static graph, the static regions of a symbolic one together, a size "
        "of one that no earlier compile serves: runtime/sized.py); C builds: libraries the "
        "C compiler built for them (sizes whose kernels render the same source share one, "
        "ir/size.py). opfuse.compile: the model compiled with opfuse.compile at the first "
        "size and called with each (the second size exports it with that size symbolic, "
        "later ones are served by a compile from that export or captured from it, "
        "frontend/symbolic.py). vs opfuse static: the time of opfuse compiled for that "
        "length alone over torch.compile's.",
        "",
    ]
    return out
