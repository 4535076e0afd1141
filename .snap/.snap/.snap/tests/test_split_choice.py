"""Decode steps choose between the cost model's split and copies only by measured step time (SplitChooser)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_route_adapter import _decode_calls
from test_tiers_policies import random_store

from moetier.errors import ConfigError
from moetier.tiers import tiered_dispatcher
from moetier.tiers.split_choice import SplitChooser
from moetier.tiers.tiered_dispatcher import TieredDispatcher


def _run(chooser: SplitChooser, tokens: int, steps: int, ms: dict[str, float]) -> list[str]:
    """``steps`` steps of ``tokens``, each route taking ``ms[route]``; the routes they ran with."""
    routes = []
    for _ in range(steps):
        route = chooser.route(tokens)
        chooser.observe(tokens, route, ms[route] / 1e3)
        routes.append(route)
    return routes


def test_a_trial_visits_each_route_twice_then_keeps_the_faster_until_the_revisit():
    chooser = SplitChooser(block_steps=2, rounds=2, settle_steps=1, revisit_steps=5)
    routes = _run(chooser, 1, 12, {"auto": 9.0, "copy": 6.0})
    assert routes == (["auto"] * 3 + ["copy"] * 3) * 2  # one settle step and two timed ones per visit
    assert chooser.report() == {1: {"route": "copy", "auto_ms": 9.0, "copy_ms": 6.0}}
    assert _run(chooser, 1, 5, {"auto": 9.0, "copy": 6.0}) == ["copy"] * 5
    # The revisit: load changed, the split is now faster and wins the new trial.
    assert _run(chooser, 1, 13, {"auto": 4.0, "copy": 6.0}) == (["auto"] * 3 + ["copy"] * 3) * 2 + ["auto"]
    assert chooser.report()[1]["route"] == "auto"


def test_a_batch_size_is_settled_between_its_trials_only():
    chooser = SplitChooser(block_steps=1, rounds=1, settle_steps=0, revisit_steps=3)
    assert not chooser.settled(2)
    _run(chooser, 2, 2, {"auto": 2.0, "copy": 1.0})
    assert chooser.settled(2) and not chooser.settled(1)
    _run(chooser, 2, 3, {"auto": 2.0, "copy": 1.0})
    assert not chooser.settled(2)  # the revisit is due


def test_a_batch_size_can_bring_its_own_routes():
    chooser = SplitChooser(block_steps=1, rounds=1, settle_steps=0)
    routes = []
    for _ in range(3):
        routes.append(chooser.route(1, ("auto", "copy", "mapped")))
        chooser.observe(1, routes[-1], {"auto": 3.0, "copy": 2.0, "mapped": 1.0}[routes[-1]] / 1e3)
    assert routes == ["auto", "copy", "mapped"] and chooser.report()[1]["route"] == "mapped"
    assert chooser.route(4) == "auto" and chooser.route(4, ("auto", "copy")) == "auto"  # 4: the default routes
    with pytest.raises(ConfigError):
        chooser.route(8, ("auto", "auto"))


def test_copies_only_must_beat_the_split_by_the_margin():
    # The trial alone (no playoff): the margin is its rule.
    chooser = SplitChooser(block_steps=2, rounds=1, settle_steps=0, margin=0.05, playoff_margin=0.0)
    _run(chooser, 1, 4, {"auto": 10.0, "copy": 9.7})  # 3% faster: within the margin, the split stays
    assert chooser.report()[1]["route"] == "auto"
    chooser = SplitChooser(block_steps=2, rounds=1, settle_steps=0, margin=0.05, playoff_margin=0.0)
    _run(chooser, 1, 4, {"auto": 10.0, "copy": 9.0})
    assert chooser.report()[1]["route"] == "copy"


def test_batch_sizes_choose_apart_and_medians_ignore_one_outlier():
    chooser = SplitChooser(block_steps=3, rounds=1, settle_steps=0)
    slow_then_fast = iter([50.0, 5.0, 5.0])  # one stall in the split's trial of batch 4
    for _ in range(6):
        for tokens, ms in ((1, {"auto": 9.0, "copy": 6.0}), (4, {"auto": 7.0, "copy": 8.0})):
            route = chooser.route(tokens)
            seconds = (next(slow_then_fast) if tokens == 4 and route == "auto" else ms[route]) / 1e3
            chooser.observe(tokens, route, seconds)
    assert {k: v["route"] for k, v in chooser.report().items()} == {1: "copy", 4: "auto"}


def test_a_step_timed_with_a_stale_route_is_not_counted():
    chooser = SplitChooser(block_steps=2, rounds=1, settle_steps=0)
    chooser.observe(1, "copy", 1e-3)  # the trial is on the split: a copies-only step says nothing of it
    assert _run(chooser, 1, 4, {"auto": 2.0, "copy": 3.0}) == ["auto", "auto", "copy", "copy"]
    assert chooser.report()[1] == {"route": "auto", "auto_ms": 2.0, "copy_ms": 3.0}


def _run_streaks(
    chooser: SplitChooser, tokens: int, steps: int, ms: Callable[[str, int], float], ran: list[str] | None = None
) -> list[str]:
    """Like :func:`_run`, a step taking ``ms(route, streak)``: ``streak`` counts the steps in a row of its route
    (those of ``ran`` too: the routes run before, which this extends)."""
    ran = [] if ran is None else ran
    start = len(ran)
    for _ in range(steps):
        route = chooser.route(tokens)
        streak = next((i for i, r in enumerate(reversed(ran)) if r != route), len(ran)) + 1
        chooser.observe(tokens, route, ms(route, streak) / 1e3)
        ran.append(route)
    return ran[start:]


def _inherited(early: dict[str, float], steady: dict[str, float]) -> Callable[[str, int], float]:
    """A route's first four steps in a row run in the cache the previous route left (``early``), then ``steady``."""
    return lambda route, streak: (early if streak <= 4 else steady)[route]


def test_a_playoff_of_steps_in_a_row_overturns_a_close_trial():
    # As measured on the H200: in the trial's 4-step visits mapped ran 5.70 ms, copies only 6.00; in the steady
    # state mapped ran 6.0 and copies only 5.43.
    chooser = SplitChooser(routes=("auto", "copy", "mapped"))
    ms = _inherited({"auto": 9.0, "copy": 6.0, "mapped": 5.7}, {"auto": 9.0, "copy": 5.43, "mapped": 6.0})
    trial = _run_streaks(chooser, 1, 24, ms)
    assert trial == (["auto"] * 4 + ["copy"] * 4 + ["mapped"] * 4) * 2
    assert not chooser.settled(1) and chooser.report() == {} and chooser.route(1) == "mapped"
    chooser.observe(1, "copy", 1.0)  # routed before the playoff began on mapped: not counted
    playoff, settled = [], []
    for _ in range(48):
        playoff += _run_streaks(chooser, 1, 1, ms, trial)  # streaks go on from the trial's
        settled.append(chooser.settled(1))
    assert playoff == ["mapped"] * 24 + ["copy"] * 24  # the trial's pick first
    assert settled == [False] * 47 + [True]
    assert chooser.report() == {
        1: {
            "route": "copy",
            **{"auto_ms": 9.0, "copy_ms": 6.0, "mapped_ms": 5.7},
            **{"playoff_mapped_ms": 6.0, "playoff_copy_ms": 5.43},
        }
    }
    assert _run(chooser, 1, 5, {"auto": 9.0, "copy": 5.43, "mapped": 6.0}) == ["copy"] * 5


def test_every_close_rival_plays_closest_first():
    # As measured on the H200 at 4 streams: the trial's medians (ms) split 15.70, copies only 16.79, mapped 16.84;
    # in the steady state mapped (with its fed CPU share) ran 12.4 and the split 13.06.
    chooser = SplitChooser(routes=("auto", "copy", "mapped"))
    trial = {"auto": 15.70, "copy": 16.79, "mapped": 16.84}
    ms = _inherited(trial, {"auto": 13.06, "copy": 15.88, "mapped": 12.4})
    ran = _run_streaks(chooser, 4, 24, lambda route, streak: trial[route])
    playoff = _run_streaks(chooser, 4, 72, ms, ran)
    assert playoff == ["auto"] * 24 + ["copy"] * 24 + ["mapped"] * 24
    assert chooser.settled(4) and chooser.report()[4]["route"] == "mapped"
    assert chooser.report()[4]["playoff_mapped_ms"] == 12.4


def test_no_playoff_where_the_rival_is_clearly_slower():
    chooser = SplitChooser()  # a playoff where the rival's median is within 15% of the pick's
    assert _run(chooser, 1, 16, {"auto": 9.5, "copy": 8.0}) == (["auto"] * 4 + ["copy"] * 4) * 2
    assert chooser.settled(1) and chooser.report() == {1: {"route": "copy", "auto_ms": 9.5, "copy_ms": 8.0}}
    chooser = SplitChooser()
    _run(chooser, 1, 16, {"auto": 9.0, "copy": 8.0})  # 12.5% slower: close, the playoff follows
    assert not chooser.settled(1) and chooser.route(1) == "copy"


def test_in_the_playoff_the_split_too_must_be_beaten_by_the_margin():
    options = {"block_steps": 1, "rounds": 1, "settle_steps": 0, "playoff_steps": 6, "playoff_settle": 4}
    # Copies only 1% faster in the trial: the split stays its pick and plays first.
    chooser = SplitChooser(**options)
    routes = _run_streaks(chooser, 1, 14, _inherited({"auto": 10.0, "copy": 9.9}, {"auto": 10.0, "copy": 9.8}))
    assert routes == ["auto", "copy"] + ["auto"] * 6 + ["copy"] * 6
    assert chooser.report()[1]["route"] == "auto"  # 2% faster in the playoff: within the margin
    chooser = SplitChooser(**options)
    _run_streaks(chooser, 1, 14, _inherited({"auto": 10.0, "copy": 9.9}, {"auto": 10.0, "copy": 9.0}))
    assert chooser.report()[1]["route"] == "copy"
    # Copies only 10% faster in the trial plays first; then 2% faster: the split, second, wins.
    chooser = SplitChooser(**options)
    routes = _run_streaks(chooser, 1, 14, _inherited({"auto": 10.0, "copy": 9.0}, {"auto": 10.0, "copy": 9.8}))
    assert routes == ["auto", "copy"] + ["copy"] * 6 + ["auto"] * 6
    assert chooser.report()[1] == {
        "route": "auto",
        **{"auto_ms": 10.0, "copy_ms": 9.0, "playoff_copy_ms": 9.8, "playoff_auto_ms": 10.0},
    }


def test_the_revisit_runs_the_trial_and_the_playoff_again():
    options = {"block_steps": 1, "rounds": 1, "settle_steps": 0, "playoff_steps": 2, "playoff_settle": 0}
    chooser = SplitChooser(revisit_steps=3, **options)
    routes = _run(chooser, 1, 9, {"auto": 10.0, "copy": 9.0})
    assert routes == ["auto", "copy"] + ["copy"] * 2 + ["auto"] * 2 + ["copy"] * 3  # trial, playoff, winner
    first = {"route": "copy", "auto_ms": 10.0, "copy_ms": 9.0, "playoff_copy_ms": 9.0, "playoff_auto_ms": 10.0}
    assert chooser.report() == {1: first}
    routes = _run(chooser, 1, 4, {"auto": 9.0, "copy": 10.0})
    assert routes == ["auto", "copy", "auto", "auto"] and not chooser.settled(1)
    assert chooser.report() == {1: first}  # the last finished trial's, until the playoff ends
    assert _run(chooser, 1, 3, {"auto": 9.0, "copy": 10.0}) == ["copy", "copy", "auto"] and chooser.settled(1)
    assert chooser.report()[1] == {
        "route": "auto",
        **{"auto_ms": 9.0, "copy_ms": 10.0, "playoff_auto_ms": 9.0, "playoff_copy_ms": 10.0},
    }


def test_bad_options_are_refused():
    bad = ({"block_steps": 0}, {"rounds": 0}, {"settle_steps": -1}, {"revisit_steps": 0}, {"margin": 1.0})
    bad_playoffs = (
        {"playoff_margin": 1.0},
        {"playoff_margin": -0.1},
        {"playoff_steps": 0},
        {"playoff_settle": -1},
        {"playoff_steps": 8, "playoff_settle": 8},
    )
    for options in (*bad, *bad_playoffs, {"routes": ("auto", "disk")}):
        with pytest.raises(ConfigError):
            SplitChooser(**options)
    with pytest.raises(ConfigError, match="playoff_margin.*1.5"):
        SplitChooser(playoff_margin=1.5)
    with pytest.raises(ConfigError, match="playoff_settle < playoff_steps: 8, 8"):
        SplitChooser(playoff_steps=8, playoff_settle=8)


class _Clock:
    """perf_counter for the dispatcher: each decode step lasts what its route costs (copies only: less)."""

    def __init__(self, dispatcher: TieredDispatcher, ms: dict[str, float]) -> None:
        self.dispatcher, self.ms, self.now = dispatcher, ms, 100.0

    def perf_counter(self) -> float:
        self.now += self.ms[self.dispatcher._step_route] / 1e3 / 8  # a few reads per step
        return self.now


def test_the_dispatcher_copies_every_miss_once_copies_only_measured_faster(monkeypatch):
    store = random_store()  # 16 experts per layer, top-2, fp32, on the CPU
    options = {"cache_slots": 0, "calibrate": False, "adapt_costs": True, "cpu_share": None}
    dispatcher = TieredDispatcher(store, **options)
    dispatcher.prepare("cpu")
    dispatcher.chooser = SplitChooser(block_steps=3, rounds=1, settle_steps=1)
    dispatcher.metrics.split_choices = dispatcher.chooser.report
    clock = _Clock(dispatcher, {"auto": 9.0, "copy": 3.0})
    monkeypatch.setattr(tiered_dispatcher, "time", clock)
    read_rows, read = [], tiered_dispatcher.read_host_inputs

    def reading(*args):
        read_rows.append(args[-1])
        return read(*args)

    monkeypatch.setattr(tiered_dispatcher, "read_host_inputs", reading)
    # Calls of the first MoE layer are steps; the first step is not timed (no previous one).
    trial = _decode_calls(dispatcher, 9)
    assert sum(trial[:4]) > 0 and trial[4:] == [0] * 5  # the split's steps gave the CPU tier misses
    assert read_rows == [True] * 4 + [False] * 5  # a copies-only step reads no rows for the CPU tier
    assert dispatcher.chooser.report()[1]["route"] == "copy"
    observed, observe = [], dispatcher.adapter.observe
    monkeypatch.setattr(dispatcher.adapter, "observe", lambda route, *a: observed.append(route) or observe(route, *a))
    after = _decode_calls(dispatcher, 6, seed=1)
    assert after == [0] * 6 and dispatcher._step_route == "copy"
    assert observed == []  # copies-only steps' copies do not price the split's (no CPU tier beside them)
    # A prefill-sized (streaming) call is not a decode step: it is not timed and uses the configured route.
    hidden = torch.randn(64, store.layout.hidden_size)
    ids = torch.randint(0, store.layout.num_experts, (64, store.layout.top_k))
    dispatcher.dispatch(0, hidden, ids, torch.rand(64, store.layout.top_k))
    assert dispatcher._step_route == "auto" and not dispatcher._timer.timing


def test_the_chooser_is_off_where_nothing_is_chosen_and_when_asked():
    store = random_store()
    for options in (
        {"miss_route": "copy", "adapt_costs": True},
        {"cpu_share": 0.5, "adapt_costs": True},
        {"adapt_costs": True, "choose_split": False},
        {},  # costs adapt on CUDA only: CPU runs split reproducibly
    ):
        dispatcher = TieredDispatcher(store, cache_slots=0, calibrate=False, **options)
        dispatcher.prepare("cpu")
        _decode_calls(dispatcher, 10)
        assert dispatcher.chooser.report() == {} and not dispatcher._timer.timing, options


def test_metrics_export_the_choice():
    from moetier.server.metrics import ServerMetrics

    dispatcher = TieredDispatcher(random_store(), cache_slots=0, calibrate=False, adapt_costs=True)
    dispatcher.prepare("cpu")
    server = ServerMetrics(lambda: None, lambda: "tiny", lambda: dispatcher.metrics)
    assert "tier_split_copies_only" not in server.render().decode()
    dispatcher.chooser = SplitChooser(block_steps=1, rounds=1, settle_steps=0)
    dispatcher.metrics.split_choices = dispatcher.chooser.report
    for route in ("auto", "copy"):
        dispatcher.chooser.observe(1, route, {"auto": 2e-3, "copy": 1e-3}[route])
    lines = server.render().decode().splitlines()
    line = next(x for x in lines if x.startswith("moetier:tier_split_copies_only{"))
    assert line.endswith(" 1.0") and 'tokens="1"' in line
    line = next(x for x in lines if x.startswith("moetier:tier_decode_route{"))
    assert line.endswith(" 1.0") and 'route="copy"' in line and 'tokens="1"' in line


def test_the_mapped_route_plays_off_even_when_its_trial_was_far_slower():
    """Its short trial visits measure its worst steps: on the H200 7.63 ms against copies' 5.80, then 4.17 alone."""
    routes = ("auto", "copy", "mapped")
    options = {"block_steps": 1, "rounds": 1, "settle_steps": 0, "playoff_steps": 4, "playoff_settle": 1}
    chooser = SplitChooser(**options)
    trial = {"auto": 7.3, "copy": 5.8, "mapped": 7.6}
    for _ in range(3):
        route = chooser.route(1, routes)
        chooser.observe(1, route, trial[route] / 1e3)
    playoff = []
    for _ in range(8):  # the pick, then mapped (auto, 26% slower, does not play)
        playoff.append(chooser.route(1))
        chooser.observe(1, playoff[-1], {"copy": 5.8, "mapped": 4.2}[playoff[-1]] / 1e3)
    assert playoff == ["copy"] * 4 + ["mapped"] * 4 and chooser.report()[1]["route"] == "mapped"
    # Without it, a rival that far behind never plays.
    chooser = SplitChooser(**options, playoff_always=())
    for _ in range(3):
        route = chooser.route(1, routes)
        chooser.observe(1, route, trial[route] / 1e3)
    assert chooser.settled(1) and chooser.report()[1]["route"] == "copy"
    with pytest.raises(ConfigError, match="playoff_always"):
        SplitChooser(playoff_always=("warp",))
