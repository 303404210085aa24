"""The benchmark's own correctness: what each candidate column really runs."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from opfuse.bench.run import _inductor


def _gemm_ops(fn, x: torch.Tensor) -> set[str]:  # type: ignore[no-untyped-def]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as p:
        fn(x)
    return {e.name for e in p.events() if "mm" in e.name or "linear" in e.name}


@pytest.mark.skipif(not torch._C.has_mkl, reason="freezing packs linears for MKL only")
def test_inductor_and_inductor_freezing_run_their_own_code() -> None:
    # Both compile the same module: dynamo must not serve one candidate the other's code
    # (the default column used to run the frozen graph's packed linear).
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU()).eval()
    x = torch.randn(16, 64)
    _, _ = _inductor(m, (x,), freezing=False)
    default, _ = _inductor(m, (x,), freezing=False)
    frozen, _ = _inductor(m, (x,), freezing=True, reset=False)
    for _ in range(2):
        assert "aten::addmm" in _gemm_ops(default, x)
        assert "mkl::_mkl_linear" in _gemm_ops(frozen, x)
    torch._dynamo.reset()


def test_settled_timing_runs_each_candidate_right_before_its_timed_call() -> None:
    from opfuse.bench.timing import time_interleaved

    calls: list[str] = []
    t = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        reps=3,
        warmup=1,
        settle=1,
    )
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert t["a"].reps == t["b"].reps == 3


def test_a_gap_idles_before_each_candidates_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # the engines' thread pools spin after a call and slowed whichever candidate came next
    from opfuse.bench import timing

    events: list[str] = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(f"sleep {s}"))
    timing.time_interleaved(
        {"a": lambda: events.append("a"), "b": lambda: events.append("b")},
        reps=2,
        warmup=1,
        settle=1,
        gap=0.02,
    )
    assert events == ["a", "b"] + ["sleep 0.02", "a", "a", "sleep 0.02", "b", "b"] * 2


def test_the_table_says_where_the_time_went_and_under_which_matmul_precision() -> None:
    from opfuse.bench.run import Result, _title, markdown

    rows = [
        Result("sum(relu(x)) 8M", "reduction", wall_seconds=30.0),
        Result("mlp batch 1", "model", wall_seconds=60.0),
        Result("mlp batch 8", "model", wall_seconds=60.0),
    ]
    assert "time spent: patterns 0.5 min, models 2.0 min" in markdown(rows, "t")
    before = torch.get_float32_matmul_precision()
    try:
        assert "precision" not in _title(60.0)
        torch.set_float32_matmul_precision("high")
        assert "float32 matmul precision 'high'" in _title(60.0)
    finally:
        torch.set_float32_matmul_precision(before)


def test_epilogue_cost_is_the_median_of_per_round_ratios() -> None:
    # Drift that slows both calls of a round cancels; so does a burst that hits one call
    # (round 2's bare call): the ratio of the two medians reads -47% here.
    from opfuse.bench.run import Result
    from opfuse.bench.timing import of, paired_ratio

    fused = of([2.10, 1.05, 1.05])
    bare = of([2.00, 2.00, 1.00])
    assert fused.median / bare.median == pytest.approx(0.525)
    assert paired_ratio(fused, bare) == pytest.approx(1.05)
    r = Result("linear+bias+gelu", "gemm", timings={"opfuse": fused}, bare={"torch": bare})
    assert r.epilogue_cost() == pytest.approx(0.05)
    # candidates timed apart (no shared rounds) fall back to the ratio of medians
    assert paired_ratio(of([3.0]), of([1.0, 2.0])) == pytest.approx(2.0)


def test_the_bare_library_call_runs_right_after_the_fused_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opfuse.bench import run
    from opfuse.bench.cases import Case

    orders: list[list[str]] = []
    real = run.time_interleaved

    def spy(candidates, **kw):  # type: ignore[no-untyped-def]
        orders.append(list(candidates))
        return real(candidates, **kw)

    monkeypatch.setattr(run, "time_interleaved", spy)

    def lin(epilogue: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), *([torch.nn.ReLU()] if epilogue else []))
        return m.eval(), (torch.randn(16, 32),)

    case = Case("tiny linear+relu", "gemm", lambda: lin(True), bare=lambda: lin(False), reps=3)
    r = run.run_inference(case, reps=3, inductor=False)
    assert not r.error
    assert orders == [["eager", "opfuse", "bare torch", "bare opfuse"]]
    assert set(r.bare) == {"torch", "opfuse"} and r.epilogue_cost() is not None
    assert len(r.timings["opfuse"].samples) == len(r.bare["torch"].samples) == 3


def test_other_engines_are_compared_with_the_fastest_of_them() -> None:
    from opfuse.bench.tables import Result, markdown
    from opfuse.bench.timing import of

    r = Result(
        "resnet50 batch 1",
        "model",
        timings={
            "eager": of([40.0, 40.0]),
            "opfuse": of([20.0, 22.0]),
            "inductor-freezing": of([25.0, 25.0]),
            "onnxruntime": of([30.0, 30.0]),
            "openvino": of([18.0, 20.0]),
        },
    )
    text = markdown([r], "t")
    assert "opfuse vs the fastest other" in text
    assert "0.90x (openvino)" in text
    gone = Result("mlp batch 1", "model", timings={"eager": of([1.0]), "opfuse": of([1.0])})
    gone.left_out = {"openvino": "output 0 differs from eager by 1.00e-01"}
    assert "not timed: openvino: output 0 differs" in markdown([gone], "t")


def test_an_engine_that_does_not_match_eager_is_left_out() -> None:
    from opfuse.bench.engines import _mismatch

    want = [torch.ones(2, 3)]
    assert _mismatch([torch.ones(2, 3).numpy()], want) == ""
    assert "differs from eager" in _mismatch([(torch.ones(2, 3) * 1.01).numpy()], want)
    assert "shape" in _mismatch([torch.ones(3, 2).numpy()], want)
    assert "2 outputs" in _mismatch([torch.ones(2, 3).numpy()] * 2, want)


def test_engines_run_a_model_when_installed() -> None:
    from opfuse.bench import engines

    if not engines.available():
        pytest.skip("neither onnxruntime nor openvino is installed (pip install opfuse[engines])")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
    x = torch.randn(4, 16)
    with torch.no_grad():
        runners, why = engines.prepare(m.eval(), (x,), m(x))
    assert not why, why
    assert set(runners) == set(engines.available())
    for run in runners.values():
        assert engines._mismatch(run(), [m(x).detach()]) == ""


def test_engines_leave_out_inputs_numpy_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 inputs have no numpy form: the engines are left out of that row with the
    reason, the row itself runs (it raised TypeError before)."""
    from opfuse.bench import engines

    monkeypatch.setattr(engines, "available", lambda: ["onnxruntime", "openvino"])
    monkeypatch.setattr(engines, "_export", lambda model, inputs, path: None)
    m = torch.nn.Linear(4, 2).to(torch.bfloat16)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    runners, why = engines.prepare(m.eval(), (x,), m(x))
    assert runners == {}
    assert set(why) == {"onnxruntime", "openvino"}
    assert all("no numpy form" in w for w in why.values()), why


def test_the_dynamic_table_counts_compiles_and_builds() -> None:
    """A row of lengths says how many sizes compiled and how few C builds they took."""
    from opfuse.bench.run import Result, markdown

    row = Result("bert_base length 96", "dynamic")
    row.compiles = {"opfuse": 2, "opfuse compiles": 4, "opfuse builds": 2, "compile() builds": 1}
    row.compile_seconds = {"opfuse first": 0.4, "compile() first": 0.6}
    table = markdown([row], "t")
    assert "| C builds (opfuse, opfuse.compile) |" in table
    assert "| 2,  | 4 | 2, 1 | 0.4, 0.6, 0.0 |" in table, table
