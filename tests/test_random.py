"""Random numbers drawn inside kernels (rewrite/random.py): the kernel computes exactly
what opfuse.rand's torch implementation does, the numbers are uniform, fresh per call and
repeatable under torch.manual_seed, and dropout trains with masks its backward agrees with."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import opfuse
from opfuse.pipeline import Options
from opfuse.rewrite.random import rand as torch_rand


class Noisy(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand_like(x), torch.rand_like(x) * 2 + x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_kernels_draw_what_the_torch_implementation_draws(dtype: torch.dtype) -> None:
    x = torch.randn(3, 1000, 7).to(dtype)
    c = opfuse.compile(Noisy().eval(), (x,))
    report = c.report  # type: ignore[attr-defined]
    rand_groups = [g for g in report.groups if "opfuse.rand.default" in g.ops]
    # each draw is computed in a generated kernel, the second inside its consumers'
    assert [g.pattern for g in rand_groups] == ["elementwise", "elementwise"]
    assert rand_groups[1].ops == ["opfuse.rand.default", "aten.mul.Tensor", "aten.add.Tensor"]
    assert any("2 uniform draws generated inside the kernels" in r for r in report.random)
    torch.manual_seed(5)
    u, v = c(x)
    torch.manual_seed(5)
    seed = torch.ops.opfuse.seed.default(torch.device("cpu"))
    assert torch.equal(u, torch_rand(seed, [3, 1000, 7], dtype, 0))
    # the second draw takes the next counters: independent of the first
    second = torch_rand(seed, [3, 1000, 7], dtype, x.numel())
    torch.testing.assert_close(v, second * 2 + x)
    assert u.dtype == dtype and float(u.min()) >= 0 and float(u.max()) < 1


def test_numbers_are_uniform_fresh_per_call_and_repeatable() -> None:
    x = torch.zeros(1 << 20)
    c = opfuse.compile(Noisy().eval(), (x,))
    torch.manual_seed(0)
    a, _ = c(x)
    b, _ = c(x)
    torch.manual_seed(0)
    a2, _ = c(x)
    assert torch.equal(a, a2) and not torch.equal(a, b)
    n = a.numel()
    # mean 1/2 and variance 1/12 within 6 standard errors; every decile about as full
    assert abs(float(a.double().mean()) - 0.5) < 6 * (1 / 12 / n) ** 0.5
    assert abs(float(a.double().var()) - 1 / 12) < 6 * (1 / 180 / n) ** 0.5
    counts = torch.histc(a, bins=10, min=0, max=1)
    assert float((counts - n / 10).abs().max()) < 6 * (n * 0.09) ** 0.5
    # neighbours are not correlated (counter-based: consecutive counters, one stream)
    corr = torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1]
    assert abs(float(corr)) < 6 / n**0.5


def test_torch_generator_kept_on_request() -> None:
    x = torch.randn(64, 64)
    c = opfuse.compile(Noisy().eval(), (x,), options=Options(random="torch"))
    assert not c.report.random  # type: ignore[attr-defined]
    torch.manual_seed(3)
    u, _ = c(x)
    torch.manual_seed(3)
    assert torch.equal(u, torch.rand_like(x))
    with pytest.raises(ValueError, match="random"):
        opfuse.compile(Noisy().eval(), (x,), options=Options(random="philox"))


class DropBlock(nn.Module):
    def __init__(self, p: float, checkpointed: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(48, 48)
        self.p = p
        self.checkpointed = checkpointed

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), self.p, self.training) + x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_dropout_trains_with_the_mask_its_forward_drew(checkpointed: bool) -> None:
    torch.manual_seed(0)
    p = 0.3
    m = DropBlock(p, checkpointed).train()
    x = torch.randn(256, 48, requires_grad=True)
    w = torch.randn(256, 48)
    y = torch.compile(m, backend="opfuse")(x)
    (y * w).sum().backward()
    h = m.lin(x).detach()
    kept = (y.detach() - x.detach()) != 0
    assert abs(float(kept.float().mean()) - (1 - p)) < 0.02
    # where kept, y = h / (1 - p) + x
    torch.testing.assert_close((y - x)[kept].detach(), h[kept] / (1 - p))
    # the gradient through the dropout uses that same mask
    grad_h = w * kept / (1 - p)
    torch.testing.assert_close(m.lin.bias.grad, grad_h.sum(0), rtol=1e-5, atol=1e-5)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w + grad_h @ m.lin.weight.detach(), rtol=1e-5, atol=1e-5)
