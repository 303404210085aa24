"""Gradients of gradients through torch.compile(backend="opfuse") (opfuse/frontend/replay.py): a
gradient penalty and the second derivative of a physics-informed loss match eager; graphs
whose eager replay would not be exact keep AOTAutograd's error."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn


def _both(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> None:
    """Parameter gradients of `loss` under eager and under opfuse agree."""
    want = torch.autograd.grad(loss(model), list(model.parameters()))
    torch._dynamo.reset()
    fast = torch.compile(model, backend="opfuse")
    got = torch.autograd.grad(loss(fast), list(model.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_gradient_penalty_matches_eager() -> None:
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    x = torch.randn(16, 8, requires_grad=True)

    def wgan_gp(m: nn.Module) -> torch.Tensor:
        out = m(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()

    _both(critic, wgan_gp)


def test_second_derivative_of_a_physics_informed_loss() -> None:
    torch.manual_seed(0)
    u = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    t = torch.linspace(0, 1, 32).unsqueeze(1).requires_grad_()

    def residual(m: nn.Module) -> torch.Tensor:  # u'' + u = 0
        y = m(t)
        (dy,) = torch.autograd.grad(y.sum(), t, create_graph=True)
        (d2y,) = torch.autograd.grad(dy.sum(), t, create_graph=True)
        return ((d2y + y) ** 2).mean()

    _both(u, residual)


def test_plain_training_and_retained_graphs_still_use_the_compiled_backward() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    fast = torch.compile(m, backend="opfuse")
    out = fast(x).square().sum()
    out.backward(retain_graph=True)
    first = [p.grad.clone() for p in m.parameters()]
    out.backward()  # the retained graph runs again: gradients double
    for p, f in zip(m.parameters(), first, strict=True):
        torch.testing.assert_close(p.grad, 2 * f)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(8), nn.Dropout(0.5)])
def test_graphs_an_eager_replay_would_change_keep_aotautograds_error(layer: nn.Module) -> None:
    # BatchNorm updates its running statistics (a replay would update them twice); dropout
    # draws its mask inside opfuse's kernels (a replay would draw another)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), layer, nn.Linear(8, 1)).train()
    x = torch.randn(16, 8, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(m, backend="opfuse")(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.square().sum().backward()
