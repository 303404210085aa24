"""Training through torch.compile(backend="opfuse"): losses and gradients match eager,
single process and under DistributedDataParallel (gloo, 2 processes)."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

import opfuse
from tests.conftest import assert_no_worse


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.LayerNorm(64),
        nn.SiLU(),
        nn.Dropout(0.0),
        nn.Linear(64, 8),
    )


def train(model: nn.Module, steps: int, compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    fwd = torch.compile(model, backend="opfuse") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        t = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(fwd(x).softmax(-1) * 3, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()]


def test_mlp_training_matches_eager() -> None:
    m1, m2 = make_mlp(), make_mlp()
    l1, g1 = train(m1, 5, compiled=True)
    l2, g2 = train(m2, 5, compiled=False)
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_opfuse_compile_in_training_mode_trains() -> None:
    m1, m2 = make_mlp(), make_mlp()
    fast = opfuse.compile(m1.train(), torch.randn(4, 16))
    x = torch.randn(8, 16)
    fast(x).square().mean().backward()
    m2(x).square().mean().backward()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


class Positions(nn.Module):
    """Token + position embeddings: arange inside forward is a constant the compiler folds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos, self.out = nn.Embedding(32, 16), nn.Embedding(8, 16), nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])
        return self.out(torch.tanh(self.tok(ids) + self.pos(pos)))


def test_constants_computed_in_forward_are_real_tensors() -> None:
    # AOTAutograd calls the compiler with its fake-tensor mode active; a folded constant
    # (the arange) must still be a real tensor when the graph runs.
    m1, m2 = Positions(), Positions()
    ids = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(2))
    out = torch.compile(m1, backend="opfuse")(ids)
    ref = m2(ids)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_batchnorm_training_updates_running_stats_like_eager() -> None:
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    m2 = copy.deepcopy(m1)
    m64 = copy.deepcopy(m1).double()
    fast = torch.compile(m1, backend="opfuse")
    x = torch.randn(4, 3, 12, 12)
    for _ in range(2):
        fast(x).square().sum().backward()
        m2(x).square().sum().backward()
        m64(x.double()).square().sum().backward()
    bn1, bn2, bn64 = m1[1], m2[1], m64[1]
    assert_no_worse(bn1.running_mean, bn2.running_mean, bn64.running_mean, "running_mean")
    assert_no_worse(bn1.running_var, bn2.running_var, bn64.running_var, "running_var")
    assert int(bn1.num_batches_tracked) == int(bn2.num_batches_tracked) == 2
    # The conv's weight gradient sums over every pixel of the gradient the decomposed
    # BatchNorm backward produces; last-bit differences there are amplified by the sum
    # (the conv bias gradient is pure rounding noise: its exact value is 0). Gradients may
    # be up to twice as far from float64 as eager's.
    for p1, p2, p64 in zip(m1.parameters(), m2.parameters(), m64.parameters()):
        assert_no_worse(p1.grad, p2.grad, p64.grad, "grad", factor=2.0)


DDP_WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    sys.path.insert(0, os.environ["OPFUSE_TEST_ROOT"])
    from tests.test_training import make_mlp
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = make_mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    fwd = torch.compile(ddp, backend="opfuse")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(4):
        x = torch.randn(2 * 16, 16, generator=g)
        t = torch.randn(2 * 16, 8, generator=g)
        xs, ts = x[rank * 16:(rank + 1) * 16], t[rank * 16:(rank + 1) * 16]
        loss = nn.functional.mse_loss(fwd(xs).softmax(-1) * 3, ts)
        opt.zero_grad(); loss.backward(); opt.step()
        full = loss.detach().clone(); dist.all_reduce(full); losses.append(full.item() / world)
    if rank == 0:
        torch.save({"losses": losses, "params": [p.detach() for p in model.parameters()]},
                   sys.argv[3])
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ddp_two_processes_matches_single_process_eager(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "worker.py"
    script.write_text(DDP_WORKER)
    out = tmp_path / "result.pt"
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OPFUSE_TEST_ROOT=os.path.dirname(os.path.dirname(__file__)),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    result = torch.load(out)
    # single-process eager on the full batch is what data parallelism must reproduce
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(32, 16, generator=g)
        t = torch.randn(32, 8, generator=g)
        halves = [
            nn.functional.mse_loss(
                model(x[i * 16 : (i + 1) * 16]).softmax(-1) * 3, t[i * 16 : (i + 1) * 16]
            )
            for i in range(2)
        ]
        loss = (halves[0] + halves[1]) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6
    )
    for a, b in zip(result["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-6)
