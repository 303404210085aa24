"""Explaining decisions: report content for known models, why-not reasons, the CLI and
its exit codes, the HTML page in headless Chromium, fuel, bisect, logging, progress."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.bench.models import Bottleneck, GPT2Block, realistic
from opfuse.report.tables import short_name
from tests.conftest import Fn

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "cli_models.py"


def test_resnet_block_report() -> None:
    torch.manual_seed(0)
    m = realistic(Bottleneck(32, 8))
    r = opfuse.explain(m, torch.randn(1, 32, 8, 8))
    assert [f.conv for f in r.folds] == ["conv1", "conv2", "conv3"]
    assert [f.batchnorm for f in r.folds] == ["bn1", "bn2", "bn3"]
    # conv3, a 1x1 convolution over the NHWC activations, runs as a matmul
    assert [g.pattern for g in r.groups] == ["conv_epilogue"] * 2 + ["gemm_epilogue"]
    assert [g.modules[0] for g in r.groups] == ["conv1", "conv2", "conv3"]
    assert len(r.conv_rows) == 1 and "conv3" in r.conv_rows[0]
    tail = r.groups[2]
    # The block runs channels-last; the copy back to eager's NCHW rides in the last group.
    assert r.layout.startswith("channels-last")
    assert [o.split(".")[1] for o in tail.ops] == ["addmm", "add", "relu", "clone"]
    assert "models.py:" in tail.sources[0]  # the line of the model's own code
    assert r.kernels_before == 10
    json.dumps(r.to_dict())


def test_transformer_block_report() -> None:
    torch.manual_seed(0)
    r = opfuse.explain(GPT2Block(64, 4).eval(), torch.randn(2, 16, 64))
    patterns = [g.pattern for g in r.groups]
    assert patterns.count("reduction") >= 3  # two LayerNorms and the attention softmax
    assert "gemm_epilogue" in patterns
    ln = next(g for g in r.groups if g.pattern == "reduction" and "ln1" in g.modules)
    assert ln.kernel.startswith("fused_") and "var_mean" in ln.kernel
    assert ln.intermediates_saved and ln.bytes_saved > 0
    softmax = next(g for g in r.groups if "amax" in " ".join(g.ops))
    assert softmax.modules == ["attn"]
    assert r.bytes_after < r.bytes_before
    assert r.kernels_after < r.kernels_before
    assert any("matmul" in x.reason for x in r.rejected)
    for e in r.edges:
        assert e.shape and (e.src.startswith(("g", "input:")))


def reasons(m: nn.Module, *args: Any) -> list[str]:
    return [x.reason for x in opfuse.explain(m.eval(), args).rejected]


def test_why_not_reasons() -> None:
    # a diamond through an op that cannot fuse: merging would create a cycle
    cyc = Fn(lambda x: (lambda a: a * torch.cumsum(a, 0))(x.exp()) + 1)
    assert any("feeds aten.cumsum" in r for r in reasons(cyc, torch.randn(8, 8)))
    axes = Fn(lambda x: x - x.mean(0) - x.mean(1, keepdim=True))
    assert any("reduces dims" in r for r in reasons(axes, torch.randn(8, 8)))
    mm = Fn(lambda x, w: x.softmax(-1) @ w)
    assert any(
        "reduced value feeds a matmul" in r
        for r in reasons(mm, torch.randn(8, 8), torch.randn(8, 4))
    )

    class TwoUsers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.conv(x)
            return y.relu(), torch.cumsum(y, 1)

    assert any("2 users" in r for r in reasons(TwoUsers(), torch.randn(1, 3, 8, 8)))


def test_fuel_changes_the_kernel_count(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    m = Fn(lambda x: x.exp().sin().mul(2).relu()).eval()
    x = torch.randn(64)
    counts = []
    for fuel in ("0", "1", "2", ""):
        monkeypatch.setenv("OPFUSE_FUEL", fuel)
        r = opfuse.explain(m, (x,))
        counts.append(r.kernels_after)
        torch.testing.assert_close(opfuse.compile(m, (x,))(x), m(x))
    assert counts == [4, 3, 2, 1]


def test_bisect_names_a_deliberately_broken_fusion(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from opfuse.lower import lowering
    from opfuse.tools.bisect import bisect

    original = lowering._Lowering._pointwise

    def broken(self, n, idx):  # type: ignore[no-untyped-def]
        e = original(self, n, idx)
        # corrupt tanh, but only when it is fused with something else
        if n.op == "aten.tanh.default" and len(self.members) > 1:
            return e + 1.0
        return e

    monkeypatch.setattr(lowering._Lowering, "_pointwise", broken)
    m = Fn(lambda x: (x * 2).sin().tanh().exp()).eval()
    result = bisect(m, (torch.randn(32),))
    assert result.fusion is not None, result.message
    assert "tanh" in " ".join(result.fusion)
    assert f"OPFUSE_FUEL={result.fuel - 1}" in result.message  # type: ignore[operator]
    monkeypatch.undo()
    assert "nothing to bisect" in bisect(m, (torch.randn(32),)).message


def test_fusion_log(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG, logger="opfuse.fusion")
    opfuse.explain(Fn(lambda x: x.exp().relu()).eval(), (torch.randn(10),))
    assert any("fusion 1 (vertical): exp -> relu" in r.getMessage() for r in caplog.records)


def test_progress_bar_draws_on_a_terminal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from opfuse.tools.progress import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(Progress, "DELAY", 0.0)
    with Progress(3, "timing implementations") as p:
        for _ in range(3):
            p.update()
    assert "timing implementations [" in err.getvalue() and "3/3" in err.getvalue()


# -- command line ------------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run(
        [sys.executable, "-m", "opfuse", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_cli_explain_table_json_svg_html(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = f"{MODELS}:resnet_block"
    out = cli("explain", target, "--input", "1x32x8x8")
    assert out.returncode == 0, out.stderr
    assert "conv_epilogue" in out.stdout and "fold" in out.stdout
    js = cli("explain", "tests.cli_models:mlp", "--input", "4x16", "--json")
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)
    assert data["kernels_after"] < data["kernels_before"]
    html, svg = tmp_path / "r.html", tmp_path / "r.svg"
    res = cli("explain", target, "--input", "1x32x8x8", "--html", str(html), "--svg", str(svg))
    assert res.returncode == 0, res.stderr
    assert svg.read_text().lstrip().startswith("<svg")
    page = html.read_text()
    assert "<svg" in page and "conv_epilogue" in page and "fused_" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(
        "http://www.w3.org/1999/xlink", ""
    )  # opens without a network


@pytest.mark.parametrize(
    "args,message",
    [
        (["nosuchmodule:f", "--input", "1"], "cannot import nosuchmodule"),
        ([f"{MODELS}:missing", "--input", "1"], "has no 'missing'"),
        ([f"{MODELS}:broken", "--input", "1"], "broken() failed: ValueError"),
        ([f"{MODELS}:resnet_block", "--input", "1xQ"], "bad input shape"),
        ([f"{MODELS}:resnet_block", "--input", "1x2:complex7"], "unknown dtype"),
        ([f"{MODELS}:resnet_block"], "give at least one --input"),
        (["no_colon_here", "--input", "1"], "expected MODULE:FACTORY"),
        ([f"{MODELS}:mlp", "--input", "4x16", "--dynamic", "0:2"], "input 0 has 2 dims"),
        ([f"{MODELS}:mlp", "--input", "4x16", "--dynamic", "1:0"], "there are 1 inputs"),
        ([f"{MODELS}:mlp", "--input", "4x16", "--dynamic", "rows"], "expected INPUT:DIM"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], message: str) -> None:
    out = cli("explain", *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_cli_explain_dynamic_says_which_sizes_are_symbols() -> None:
    out = cli("explain", f"{MODELS}:mlp", "--input", "4x16", "--dynamic", "0:0", "--dynamic", "0:1")
    assert out.returncode == 0, out.stderr
    assert "exported once with symbolic sizes (input 0 dim 0 = s" in out.stdout
    assert "input 0 dim 1 stays 16" in out.stdout  # the Linear needs its width


def test_cli_bisect() -> None:
    out = cli("bisect", f"{MODELS}:mlp", "--input", "4x16")
    assert out.returncode == 0, out.stderr
    assert "nothing to bisect" in out.stdout


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB(A) PNG with the standard library (rows of pixels)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(x for i, x in enumerate(line) if i % 4 != 3))
        prev = line
    return w, h, rows


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_html_report_in_headless_chromium(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    r = opfuse.explain(realistic(Bottleneck(32, 8)), torch.randn(1, 32, 8, 8))
    page = tmp_path / "report.html"
    page.write_text(r.to_html())
    shot = tmp_path / "shot.png"
    res = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1000,900",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), res.stderr[-2000:]
    _, h, rows = _png_pixels(shot)
    conv_color = bytes.fromhex("fb9a99")  # conv_epilogue boxes of the picture
    hits = sum(row.count(conv_color) for row in rows[: h // 2])
    assert hits > 500, "the group boxes of the picture are not on the page"


def test_builtin_layout_without_graphviz(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from opfuse.report import picture

    r = opfuse.explain(
        Fn(lambda x, w: F.gelu(x @ w) + 1).eval(), (torch.randn(4, 8), torch.randn(8, 8))
    )
    monkeypatch.setattr(picture, "shutil", types.SimpleNamespace(which=lambda _: None))
    svg = r.to_svg()
    assert svg.startswith("<svg") and "gemm_epilogue" in svg and "4x8" in svg
    assert "gemm_epilogue: matmul + its epilogue" in svg  # the legend


def test_picture_has_a_legend_and_names_modules() -> None:
    from opfuse.report import picture

    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    r = opfuse.explain(m, (torch.randn(4, 8),))
    dot = picture.dot_source(r)
    assert "cluster_legend" in dot
    for pattern in {g.pattern for g in r.groups}:
        assert f"{pattern}: {picture.MEANING[pattern]}" in dot
    norm = next(g for g in r.groups if g.pattern == "reduction")
    assert norm.modules == ["1", "2"] and "\\n1 (+1)\\n" in dot  # the GELU, the LayerNorm


def test_report_says_what_ran_at_compile_time_on_frozen_parameters() -> None:
    class Standardised(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = torch.nn.Conv2d(4, 8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.c.weight
            w = (w - w.mean((1, 2, 3), keepdim=True)) / w.std((1, 2, 3), keepdim=True)
            return torch.nn.functional.conv2d(x, w, self.c.bias).relu()

    r = opfuse.explain(Standardised().eval(), torch.randn(1, 4, 8, 8))
    assert [short_name(op) for op in r.constants] == ["mean", "sub", "var", "sqrt", "div"]
    assert "computed at compile time" in str(r) and "computed at compile time" in r.to_html()
    assert [g.pattern for g in r.groups] == ["conv_epilogue"], str(r)


def test_cli_imports_from_the_current_directory_and_the_targets_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the installed script, not `python -m` (which puts the current directory on sys.path)
    script = Path(sys.executable).parent / "opfuse"
    if not script.exists():
        pytest.skip("no installed opfuse script")
    models = tmp_path / "models"
    models.mkdir()
    (models / "layers.py").write_text(
        "import torch.nn as nn\n"
        "def block():\n    return nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()\n"
    )
    (models / "mymodel.py").write_text(
        "from layers import block\n\ndef make():\n    return block()\n"
    )
    env = dict(os.environ, COLUMNS="120")
    env.pop("PYTHONPATH", None)
    for cwd, target in ((models, "mymodel:make"), (tmp_path, "models/mymodel.py:make")):
        out = subprocess.run(
            [str(script), "explain", target, "--input", "4x8"],
            capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "elementwise" in out.stdout or "gemm_epilogue" in out.stdout


def test_routine_refusals_are_one_counted_line_and_bytes_have_units() -> None:
    from opfuse.report.tables import FusionReport, RejectReport, format_table, human_bytes

    feeds = [RejectReport(f"relu_{i}", f"conv{i}", "value feeds a convolution") for i in range(5)]
    r = FusionReport(rejected=[*feeds, RejectReport("a", "b", "a rare reason")])
    r.bytes_before, r.bytes_after = 3 * 2**20, 1536
    text = format_table(r)
    assert "5 times: value feeds a convolution (relu_0 -> conv0, relu_1 -> conv1, " in text
    assert "a -> b: a rare reason" in text and text.count("conv") == 4  # 3 named + reason
    assert "intermediate traffic 3.0 MiB in eager -> 1.5 KiB fused" in text
    assert [human_bytes(n) for n in (512, 2048, 5 * 2**30)] == ["512 B", "2.0 KiB", "5.0 GiB"]
