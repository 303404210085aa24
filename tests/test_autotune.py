"""How the autotuner samples candidates: on a fake clock, so the counts are exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from opfuse import autotune, decisions


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.calls: dict[str, int] = {}

    def __call__(self) -> float:
        return self.now

    def candidate(self, name: str, seconds: float) -> Callable[[], None]:
        def run() -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.now += seconds

        return run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(autotune.time, "perf_counter", c)
    return c


def test_close_candidates_get_all_samples(clock: Clock) -> None:
    got = autotune.time_candidates(
        {"a": clock.candidate("a", 0.010), "b": clock.candidate("b", 0.0105)}
    )
    assert got == pytest.approx({"a": 0.010, "b": 0.0105})
    # REPS calls each, the first one's included
    assert clock.calls == {"a": autotune.REPS, "b": autotune.REPS}


def test_clear_loser_stops_being_sampled(clock: Clock) -> None:
    got = autotune.time_candidates(
        {"slow": clock.candidate("slow", 0.030), "fast": clock.candidate("fast", 0.010)}
    )
    assert min(got, key=got.__getitem__) == "fast"
    assert clock.calls["slow"] == autotune.DROP_AFTER
    assert clock.calls["fast"] == autotune.REPS


def test_a_settled_choice_stops_sampling_early(clock: Clock) -> None:
    # 8% apart: "a" would still win 5% slower, so three samples each decide
    got = autotune.time_candidates(
        {"a": clock.candidate("a", 0.010), "b": clock.candidate("b", 0.0108)},
        done=autotune.settled,
    )
    assert autotune.pick(got) == "a"
    assert clock.calls == {"a": autotune.SETTLE_AFTER, "b": autotune.SETTLE_AFTER}
    assert autotune.SETTLE_AFTER < autotune.REPS


def test_a_choice_near_a_margin_is_not_settled(clock: Clock) -> None:
    # onednn is kept within 10% of the unfused call: 5% apart, a little noise could flip it
    assert not autotune.settled({"unfused": 0.0100, "onednn": 0.0105})
    assert autotune.settled({"unfused": 0.0100, "onednn": 0.0090})
    assert autotune.settled({"unfused": 0.0100, "onednn": 0.0120})  # unfused, clearly
    assert autotune.settled({"only": 0.01})
    autotune.time_candidates(
        {
            "unfused": clock.candidate("unfused", 0.0100),
            "onednn": clock.candidate("onednn", 0.0105),
        },
        done=autotune.settled,
    )
    assert clock.calls == {"unfused": autotune.REPS, "onednn": autotune.REPS}


def test_long_candidates_stop_at_the_budget(clock: Clock) -> None:
    got = autotune.time_candidates(
        {"a": clock.candidate("a", 0.15), "b": clock.candidate("b", 0.16)}
    )
    assert set(got) == {"a", "b"}
    assert clock.calls == {"a": autotune.MIN_SAMPLES, "b": autotune.MIN_SAMPLES}


def test_calls_longer_than_long_call_are_sampled_once(clock: Clock) -> None:
    got = autotune.time_candidates(
        {"a": clock.candidate("a", autotune.LONG_CALL), "b": clock.candidate("b", 0.6)}
    )
    assert clock.calls == {"a": 1, "b": 1} and set(got) == {"a", "b"}
    # one shorter candidate: all are sampled as usual
    clock.calls.clear()
    autotune.time_candidates({"a": clock.candidate("a", 0.6), "c": clock.candidate("c", 0.2)})
    assert clock.calls == {"a": autotune.MIN_SAMPLES, "c": autotune.MIN_SAMPLES}


def test_time_to_beat_stops_a_lone_candidate(clock: Clock) -> None:
    autotune.time_candidates({"c": clock.candidate("c", 0.02)}, beat=0.01)
    assert clock.calls["c"] == autotune.DROP_AFTER
    autotune.time_candidates({"d": clock.candidate("d", 0.0101)}, beat=0.01)
    assert clock.calls["d"] == autotune.REPS


def test_slow_first_calls_do_not_drop_a_candidate(clock: Clock) -> None:
    # "lib" faults its output's fresh pages in on its first two calls, then is the faster
    times = iter([0.030, 0.025] + [0.008] * 10)

    def lib() -> None:
        clock.calls["lib"] = clock.calls.get("lib", 0) + 1
        clock.now += next(times)

    got = autotune.time_candidates({"lib": lib, "kernel": clock.candidate("kernel", 0.010)})
    assert min(got, key=got.__getitem__) == "lib"


def test_a_candidate_that_raises_is_dropped(clock: Clock) -> None:
    def boom() -> Any:
        raise RuntimeError("library refused")

    got = autotune.time_candidates({"bad": boom, "ok": clock.candidate("ok", 0.01)})
    assert set(got) == {"ok"}


def test_slow_outliers_do_not_decide(clock: Clock) -> None:
    # "a" pays for page faults on most calls (an allocation glibc had handed back), "b"
    # never does: the candidates' own speed decides, not the allocator's state.
    times = iter([0.018, 0.010, 0.018, 0.018, 0.010, 0.018] * 3)
    calls = {"a": 0}

    def a() -> None:
        calls["a"] += 1
        clock.now += next(times)

    got = autotune.time_candidates({"a": a, "b": clock.candidate("b", 0.011)})
    assert got["a"] == pytest.approx(0.010) and got["b"] == pytest.approx(0.011)
    assert min(got, key=got.__getitem__) == "a"


def test_first_call_costs_do_not_decide(clock: Clock) -> None:
    # "a" creates its primitives on the first call (10x its run time): it still wins
    first = {"a": True}

    def a() -> None:
        clock.now += 0.100 if first["a"] else 0.010
        first["a"] = False

    got = autotune.time_candidates({"a": a, "b": clock.candidate("b", 0.012)})
    assert got == pytest.approx({"a": 0.010, "b": 0.012})


def test_decisions_of_an_older_tuner_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    key = decisions.decision_key(["group", "shapes"])
    monkeypatch.setattr(decisions, "TUNER_VERSION", decisions.TUNER_VERSION + "-next")
    assert decisions.decision_key(["group", "shapes"]) != key


def test_decisions_made_with_other_shared_kernel_code_are_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decision made with an older opfuse GEMM (the code every GEMM kernel shares, not
    part of any one kernel's text) is timed again, not taken from the cache."""
    import torch

    import opfuse
    from opfuse.backends.c import module
    from tests.conftest import Fn

    m = Fn(lambda x: torch.relu(x @ x.t() + 3) * 2).eval()
    x = torch.randn(48, 48)
    opfuse.compile(m, (x,))
    assert "cached decision" in opfuse.compile(m, (x,)).report.groups[0].implementation
    monkeypatch.setattr(module, "OWN_GEMM", module.OWN_GEMM + "\n/* another version */\n")
    assert "measured" in opfuse.compile(m, (x,)).report.groups[0].implementation


def test_an_unfused_candidate_must_win_by_a_margin() -> None:
    # Timed alone an unfused call keeps its intermediate in cache; in a model it does not.
    close = {"unfused": 0.0100, "onednn": 0.0105, "torch": 0.0090}
    assert autotune.pick(close) == "torch"  # no intermediate either way: fastest wins
    close = {"unfused": 0.0100, "onednn": 0.0105, "blocked": 0.0120}
    assert autotune.pick(close) == "onednn"
    d = autotune.Decision(autotune.pick(close), close)
    assert "fused kept: within 10% of the unfused call" in d.describe()
    far = {"unfused": 0.0100, "onednn": 0.0115}
    assert autotune.pick(far) == "unfused"
    assert "fused kept" not in autotune.Decision("unfused", far).describe()
    assert autotune.pick({"mkl-unfused": 0.01}) == "mkl-unfused"
    # every library-call-then-epilogue candidate is held to the margin, the K-blocked too
    k_blocks = {"onednn-kblocks-unfused": 0.0100, "blocked": 0.0105}
    assert autotune.pick(k_blocks) == "blocked"


def test_a_convolution_reordering_its_weight_per_call_must_win_by_a_margin() -> None:
    close = {"torch": 0.0100, "onednn": 0.0105}
    assert autotune.pick(close) == "torch"  # a GEMM: no reorder, fastest wins
    penalised = autotune.MATERIALISING | autotune.REORDERING
    assert autotune.pick(close, penalised) == "onednn"
    assert "prepacked weight kept" in autotune.Decision("onednn", close).describe()
    assert autotune.pick({"torch": 0.0100, "onednn": 0.0120}, penalised) == "torch"


def test_an_intermediate_larger_than_the_cache_gets_no_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Timed alone, an intermediate that does not fit in cache makes its round trip to
    # memory anyway: the fastest candidate wins.
    monkeypatch.setattr(autotune, "last_level_bytes", lambda: 32 << 20)
    seconds = {"unfused": 0.0100, "blocked": 0.0105}
    small = autotune.penalised("aten.addmm.default", 4 << 20)
    assert autotune.pick(seconds, small) == "blocked"
    large = autotune.penalised("aten.addmm.default", 32 << 20)
    assert autotune.pick(seconds, large) == "unfused"
    conv = autotune.penalised("aten.convolution.default", 32 << 20)
    assert "torch" in conv and "unfused" not in conv


def test_candidates_timed_one_at_a_time_get_a_second_round(clock: Clock) -> None:
    # A burst of load during "a"'s first turn (3x slower) must not decide on its own.
    turns: dict[str, int] = {}

    def runner(name: str) -> Callable[[], None]:
        turns[name] = turns.get(name, 0) + 1
        cost = {"a": 0.030 if turns["a"] == 1 else 0.010, "b": 0.012}[name]
        return clock.candidate(name, cost)

    got = autotune.time_one_at_a_time(["a", "b"], runner, budget=0.4)
    assert turns == {"a": 2, "b": 1}  # b led the first round: its time can only be high
    assert got == pytest.approx({"a": 0.010, "b": 0.012})
    assert autotune.pick(got) == "a"


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "[1, 2, 3]",
        "not json {",
        '{"k": 5}',
        '{"k": {"choice": 3, "seconds": {}}}',
        '{"k": {"choice": "unfused", "seconds": {"unfused": "fast"}}}',
        '{"k": {"choice": "unfused"}}',
    ],
)
def test_a_damaged_decision_cache_is_ignored_with_one_warning_and_rewritten(
    content: str, fresh_cache: Any
) -> None:
    import json

    import torch

    import opfuse
    from tests.conftest import Fn, assert_matches_eager

    fresh_cache.mkdir(parents=True)
    store = fresh_cache / "decisions.json"
    store.write_text(content)
    decisions._store_warned.clear()
    m = Fn(lambda x: torch.relu(x @ x.t() + 1) * 2).eval()  # a GEMM group: tuned
    x = torch.randn(64, 64)
    with pytest.warns(RuntimeWarning, match="decision cache .* ignored") as seen:
        fast = opfuse.compile(m, (x,))
    assert sum("decision cache" in str(w.message) for w in seen) == 1
    assert [g.pattern for g in fast.report.groups] == ["gemm_epilogue"]  # not torch
    assert_matches_eager(m, fast(x), (x,))
    data = json.loads(store.read_text())
    assert isinstance(data, dict) and all(decisions._valid_entry(v) for v in data.values())
    assert len(data) >= 1
    again = opfuse.compile(m, (x,))  # the rewritten file serves the next compile, quietly
    assert "cached decision" in again.report.groups[0].implementation


def test_the_decision_file_is_parsed_once_until_it_changes(
    fresh_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile looks up a decision per tuned group: the file is read and checked once,
    and again only when it changed (another process saved, or this one did)."""
    fresh_cache.mkdir(parents=True)
    store = fresh_cache / "decisions.json"
    store.write_text('{"a": {"choice": "blocked", "seconds": {"blocked": 1.0}}}')
    parsed: list[int] = []
    real = decisions._parse_store
    monkeypatch.setattr(decisions, "_parse_store", lambda p: parsed.append(1) or real(p))
    for _ in range(5):
        d = decisions.load_decision("a")
        assert d is not None and d.choice == "blocked"
    assert decisions.load_decision("b") is None
    assert len(parsed) == 1
    decisions.save_decision("b", decisions.Decision("unfused", {"unfused": 2.0}))
    assert decisions.load_decision("b") is not None and decisions.load_decision("a") is not None
    store.write_text('{"c": {"choice": "onednn", "seconds": {"onednn": 3.0}}}')  # elsewhere
    assert decisions.load_decision("a") is None
    assert decisions.load_decision("c") is not None
