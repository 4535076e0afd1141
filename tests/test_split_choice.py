"""Decode steps choose between the cost model's split and copies only by measured step time (SplitChooser)."""

from __future__ import annotations

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
    chooser = SplitChooser(block_steps=2, rounds=1, settle_steps=0, margin=0.05)
    _run(chooser, 1, 4, {"auto": 10.0, "copy": 9.7})  # 3% faster: within the margin, the split stays
    assert chooser.report()[1]["route"] == "auto"
    chooser = SplitChooser(block_steps=2, rounds=1, settle_steps=0, margin=0.05)
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


def test_bad_options_are_refused():
    bad = ({"block_steps": 0}, {"rounds": 0}, {"settle_steps": -1}, {"revisit_steps": 0}, {"margin": 1.0})
    for options in (*bad, {"routes": ("auto", "disk")}):
        with pytest.raises(ConfigError):
            SplitChooser(**options)


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
