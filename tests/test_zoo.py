"""Models no issue names, in eval (`opfuse.compile`) and training
(`torch.compile(backend="opfuse")`): outputs and gradients by the eager-oracle rule. Each
of these once failed or crawled: SDPA gradients were wrong, GRUs unrolled per time step,
mixed-layout backward kernels gathered lane by lane."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.bench.models import MobileNetV3Large
from tests.conftest import assert_matches_eager, assert_no_worse


class MBConv(nn.Module):
    """EfficientNet block: expand, depthwise, squeeze-excite, project, residual."""

    def __init__(self, c: int = 16, e: int = 4) -> None:
        super().__init__()
        h = c * e
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.SiLU())
        self.dw = nn.Sequential(
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.SiLU()
        )
        self.se_a, self.se_b = nn.Conv2d(h, h // 4, 1), nn.Conv2d(h // 4, h, 1)
        self.proj = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dw(self.expand(x))
        h = h * torch.sigmoid(self.se_b(F.silu(self.se_a(F.adaptive_avg_pool2d(h, 1)))))
        return x + self.proj(h)


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.d2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.u1 = nn.Conv2d(16, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        y = self.u1(torch.cat([a, self.up(b)], 1))
        return y + F.interpolate(b[:, :2], scale_factor=2, mode="bilinear", align_corners=False)


class DenseBlock(nn.Module):
    def __init__(self, c: int = 16, growth: int = 8, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.BatchNorm2d(c + i * growth),
                nn.ReLU(),
                nn.Conv2d(c + i * growth, growth, 3, padding=1),
            )
            for i in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return F.avg_pool2d(x, 2)


class WindowAttention(nn.Module):
    """Swin-style: shifted windows (roll), attention with a learned bias, windows merged."""

    def __init__(self, c: int = 32, w: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.w, self.heads = w, heads
        self.norm, self.qkv, self.proj = nn.LayerNorm(c), nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.bias = nn.Parameter(torch.randn(heads, w * w, w * w) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, hh, ww, c = x.shape
        w, h = self.w, self.heads
        s = torch.roll(x, (-2, -2), (1, 2))
        win = self.norm(s).view(b, hh // w, w, ww // w, w, c).permute(0, 1, 3, 2, 4, 5)
        qkv = self.qkv(win.reshape(-1, w * w, c)).reshape(-1, w * w, 3, h, c // h)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * (c // h) ** -0.5 + self.bias
        o = (a.softmax(-1) @ v).transpose(1, 2).reshape(-1, w * w, c)
        o = self.proj(o).view(b, hh // w, ww // w, w, w, c).permute(0, 1, 3, 2, 4, 5)
        return torch.roll(o.reshape(b, hh, ww, c), (2, 2), (1, 2)) + x


class Mixer(nn.Module):
    def __init__(self, tokens: int = 16, c: int = 32) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.tok = nn.Sequential(nn.Linear(tokens, 32), nn.GELU(), nn.Linear(32, tokens))
        self.ch = nn.Sequential(nn.Linear(c, 64), nn.GELU(), nn.Linear(64, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class PixelShuffleMish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(8, 32, 3, padding=1, padding_mode="reflect")
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pixel_shuffle(F.mish(self.c(x)), 2)
        return F.instance_norm(F.hardswish(self.c2(y)))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(ids))
        return self.head(out).log_softmax(-1)


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


_PAD = torch.zeros(2, 12, dtype=torch.bool)
_PAD[1, 9:] = True

ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "mbconv": (MBConv, lambda: (torch.randn(2, 16, 16, 16),)),
    # hardswish, squeeze-and-excite over 5x5 depthwise blocks, a 3-channel stem
    "mobilenet_v3": (lambda: MobileNetV3Large(10), lambda: (torch.randn(2, 3, 48, 48),)),
    "unet": (UNet, lambda: (torch.randn(2, 3, 32, 32),)),
    "dense": (DenseBlock, lambda: (torch.randn(2, 16, 16, 16),)),
    "window_attention": (WindowAttention, lambda: (torch.randn(2, 8, 8, 32),)),
    "mixer": (Mixer, lambda: (torch.randn(2, 16, 32),)),
    "pixel_shuffle_mish": (PixelShuffleMish, lambda: (torch.randn(2, 8, 8, 8),)),
    "gru_tagger": (Tagger, lambda: (torch.randint(0, 50, (3, 10)),)),
    "transformer_encoder_masked": (_encoder, lambda: (torch.randn(2, 12, 32), None, _PAD)),
}


def _floating(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_eval_matches_eager(name: str) -> None:
    make, inputs = ZOO[name]
    torch.manual_seed(0)
    m, args = make().eval(), inputs()
    with torch.no_grad():
        fast = opfuse.compile(m, args)
        assert_matches_eager(m, fast(*args), args)
        assert_matches_eager(m, fast(*args), args)  # a second call reuses the pool


def _batch(args: tuple[Any, ...], b: int) -> tuple[Any, ...]:
    """args with batch size b: new values of the same kind."""
    g = torch.Generator().manual_seed(b)
    out: list[Any] = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
        elif a.dtype == torch.bool:
            out.append(torch.zeros((b, *a.shape[1:]), dtype=torch.bool))
        elif a.is_floating_point():
            out.append(torch.randn((b, *a.shape[1:]), generator=g))
        else:
            out.append(torch.randint(0, 50, (b, *a.shape[1:]), generator=g))
    return tuple(out)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_eval_over_batch_sizes_matches_eager(name: str) -> None:
    """New batch sizes: the first exports the model with the batch symbolic, the next
    one is captured from that export; both match eager."""
    make, inputs = ZOO[name]
    torch.manual_seed(0)
    m, args = make().eval(), inputs()
    with torch.no_grad():
        fast = opfuse.compile(m, args)
        for b in (5, 7):
            x = _batch(args, b)
            assert_matches_eager(m, fast(*x), x)
    notes = [e.report.dynamic for e in fast._entries.values()]  # type: ignore[attr-defined]
    assert [bool(n) for n in notes] == [False, True, True], notes


# Known weak: summed over 2^20 values, opfuse's mish backward drifts further from float64
# than eager's (0.0138 vs 0.0040; per element no worse). Its log1pf/tanhf come from glibc's
# vector libm (up to 1.8 / 1.4 ulp, log1pf +0.036 ulp on average) where torch uses SLEEF
# (0.6 ulp); the conv bias gradient behind it lands 4.9x eager's distance.
@pytest.mark.parametrize("name", sorted(ZOO))
def test_training_gradients_match_eager(name: str) -> None:
    make, inputs = ZOO[name]
    torch.manual_seed(0)
    ref = make().train()
    ours, ref64 = copy.deepcopy(ref), copy.deepcopy(ref).double()
    args = inputs()
    args64 = tuple(a.double() if _floating(a) else a for a in args)

    def loss(out: torch.Tensor) -> torch.Tensor:
        weight = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view(out.shape)
        return (out * weight).sum()

    loss(ref(*args)).backward()
    loss(ref64(*args64)).backward()
    torch._dynamo.reset()
    loss(torch.compile(ours, backend="opfuse")(*args)).backward()
    for (n, a), b, c in zip(ref.named_parameters(), ours.parameters(), ref64.parameters()):
        if a.grad is None:
            assert b.grad is None, n
            continue
        assert b.grad is not None and c.grad is not None, n
        # Gradients are long float32 sums whose order changes with the memory format:
        # eager itself, run channels-last, lands up to 9.9x (UNet) and 8.9x (MBConv) further
        # from float64 on some weight gradients than eager in NCHW. 4x keeps real bugs out
        # (the SDPA one was 10^6x).
        assert_no_worse(b.grad, a.grad, c.grad, n, factor=4.0)
    for (n, a), b in zip(ref.named_buffers(), ours.buffers()):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)
