"""Benchmark cases: micro patterns (the cases the pattern issues name), whole models at
batch 1 and 8, training steps, and peak-memory cases.

A case builds an eval-mode module and its inputs; micro cases also say how many bytes the
fused op must move at least (inputs read once, outputs written once), which gives its
effective bandwidth."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import models

Build = Callable[[], tuple[nn.Module, tuple[Any, ...]]]


@dataclass
class Case:
    name: str
    group: str  # elementwise | reduction | gemm | model | training | memory
    build: Build
    quick: bool = False  # part of `opfuse bench --quick`
    min_bytes: Callable[[tuple[Any, ...], Any], int] | None = None
    bare: Build | None = None  # the GEMM/conv without its epilogue, to price the epilogue
    reps: int = 15


def io_bytes(inputs: tuple[Any, ...], output: Any) -> int:
    """Bytes of distinct input storages read plus output bytes written."""
    seen: set[int] = set()
    total = 0
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    outs = output if isinstance(output, (tuple, list)) else (output,)
    return total + sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Fn(nn.Module):
    def __init__(self, fn: Callable[..., Any], **params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            self.register_buffer(k, v)

    def forward(self, *args: Any) -> Any:
        return self.fn(self, *args)


class Chain(nn.Module):
    """k elementwise ops, the kind of tail a residual block or activation stack has."""

    OPS = (
        lambda t, y: t * y,
        lambda t, y: t + 1.0,
        lambda t, y: torch.relu(t),
        lambda t, y: t * 0.5,
        lambda t, y: t - y,
        lambda t, y: torch.sigmoid(t),
        lambda t, y: t * 2.0,
        lambda t, y: torch.tanh(t),
    )

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i in range(self.k):
            x = self.OPS[i % len(self.OPS)](x, y)
        return x


EIGHT_M = 8 << 20


def _chain(k: int) -> tuple[nn.Module, tuple[Any, ...]]:
    return Chain(k).eval(), (_rand(EIGHT_M), _rand(EIGHT_M, seed=1))


def micro_cases() -> list[Case]:
    cases = [
        Case(
            f"elementwise chain {k} ops, 8M f32",
            "elementwise",
            functools.partial(_chain, k),
            quick=(k == 4),
            min_bytes=io_bytes,
        )
        for k in (2, 4, 8)
    ]
    cases.append(
        Case(
            "NCHW -> NHWC copy of RGB images 8x3x224x224",
            "elementwise",
            lambda: (
                Fn(lambda s, x: x.contiguous(memory_format=torch.channels_last)).eval(),
                (_rand(8, 3, 224, 224),),
            ),
            min_bytes=io_bytes,
        )
    )
    d = 768
    cases += [
        Case(
            "softmax over 3 classes 1048576x3",
            "reduction",
            lambda: (Fn(lambda s, x: x.softmax(-1)).eval(), (_rand(1 << 20, 3),)),
            min_bytes=io_bytes,
        ),
        Case(
            "LayerNorm(x + residual) 8192x768",
            "reduction",
            lambda: (
                Fn(
                    lambda s, x, r: F.layer_norm(x + r, (d,), s.w, s.b), w=_rand(d), b=_rand(d)
                ).eval(),
                (_rand(8192, d), _rand(8192, d, seed=1)),
            ),
            quick=True,
            min_bytes=io_bytes,
        ),
        Case(
            "attention softmax(scale*s + mask) 8x12x256x256",
            "reduction",
            lambda: (
                Fn(lambda s, x, m: (x * 0.125 + m).softmax(-1)).eval(),
                (_rand(8, 12, 256, 256), _rand(256, 256, seed=1)),
            ),
            min_bytes=io_bytes,
        ),
        Case(
            "RMSNorm 4096x4096",
            "reduction",
            lambda: (
                Fn(
                    lambda s, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * s.w,
                    w=_rand(4096),
                ).eval(),
                (_rand(4096, 4096),),
            ),
            min_bytes=io_bytes,
        ),
        Case(
            "sum(relu(x)) 8M",
            "reduction",
            lambda: (Fn(lambda s, x: x.relu().sum()).eval(), (_rand(EIGHT_M),)),
            min_bytes=io_bytes,
        ),
        Case(
            "BatchNorm training statistics 32x64x56x56",
            "reduction",
            lambda: (
                Fn(
                    lambda s, x: F.batch_norm(x, None, None, s.w, s.b, training=True),
                    w=_rand(64),
                    b=_rand(64),
                ).eval(),
                (_rand(32, 64, 56, 56),),
            ),
            min_bytes=io_bytes,
        ),
        Case(
            "max_pool2d(relu(x)) 3x3/2 8x64x112x112",
            "reduction",
            lambda: (
                Fn(lambda s, x: F.max_pool2d(x.relu(), 3, 2, 1)).eval(),
                (_rand(8, 64, 112, 112),),
            ),
            min_bytes=io_bytes,
        ),
        Case(
            "avg_pool2d(x) - x 3x3/1 NHWC 8x64x56x56",
            "reduction",
            lambda: (
                Fn(lambda s, x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False) - x).eval(),
                (_rand(8, 64, 56, 56).contiguous(memory_format=torch.channels_last),),
            ),
            min_bytes=io_bytes,
        ),
        Case(
            "linear+bias+gelu 2048x1024x4096",
            "gemm",
            lambda: _linear(True),
            bare=lambda: _linear(False),
            quick=True,
            reps=9,
        ),
        Case(
            "conv3x3+bias+relu 8x64x56x56",
            "gemm",
            lambda: _conv(True),
            bare=lambda: _conv(False),
            reps=9,
        ),
    ]
    return cases


def _linear(epilogue: bool) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    lin = nn.Linear(1024, 4096)
    m = nn.Sequential(lin, nn.GELU()) if epilogue else nn.Sequential(lin)
    return m.eval(), (_rand(2048, 1024),)


def _conv(epilogue: bool) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1)
    m = nn.Sequential(conv, nn.ReLU()) if epilogue else nn.Sequential(conv)
    return m.eval(), (_rand(8, 64, 56, 56),)


MODELS = (
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3",
    "bert_base",
    "gpt2_small",
    "convnext_t",
    "vit_b16",
    "mlp",
)


def model_cases() -> list[Case]:
    cases = []
    for name in MODELS:
        for batch in (1, 8):
            cases.append(
                Case(
                    f"{name} batch {batch}",
                    "model",
                    functools.partial(models.build, name, batch),
                    quick=(name == "mlp" and batch == 1),
                    reps=5 if batch == 8 else 9,
                )
            )
    if _cpu_has_bf16():
        for name in ("resnet50", "bert_base"):
            cases.append(
                Case(f"{name} batch 8 bfloat16", "model", functools.partial(_bf16, name), reps=5)
            )
    return cases


def _bf16(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    m, inputs = models.build(name, 8)
    m = m.to(torch.bfloat16)
    return m, tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def all_cases() -> list[Case]:
    return micro_cases() + model_cases()
