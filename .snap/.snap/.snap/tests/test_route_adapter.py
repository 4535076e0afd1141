"""The miss split follows what each route has cost while serving, not only the start-up calibration."""

import time

import pytest
import torch
from test_tiers_policies import random_store

from moetier.tiers import cpu_tier
from moetier.tiers.route_costs import RouteAdapter, RouteCosts, split_misses
from moetier.tiers.tiered_dispatcher import TieredDispatcher


def test_adapter_waits_for_both_routes_then_rescales_each():
    base = RouteCosts(cpu_fixed=1.0, cpu_per_token=0.5, copy_fixed=2.0, copy_per_token=0.1)
    adapter = RouteAdapter(weight=0.5)
    adapter.observe("cpu", predicted=1.0, seconds=3.0)
    assert adapter.costs(base) is base  # the copy route is not measured yet: no half-measured comparison
    adapter.observe("copy", predicted=2.0, seconds=1.0)
    costs = adapter.costs(base)
    assert (costs.cpu_fixed, costs.cpu_per_token) == (3.0, 1.5)
    assert (costs.copy_fixed, costs.copy_per_token) == (1.0, 0.05)
    adapter.observe("cpu", predicted=1.0, seconds=1.0)  # exponential average: halfway from 3 to 1
    assert adapter.scales["cpu"] == pytest.approx(2.0)


def test_adapter_bounds_one_outlier_and_ignores_empty_observations():
    adapter = RouteAdapter(weight=1.0, max_step=4.0)
    adapter.observe("copy", 1.0, 1.0)
    adapter.observe("copy", 1.0, 1000.0)  # a stall: moves the scale 4x at most
    assert adapter.scales["copy"] == pytest.approx(4.0)
    for predicted, seconds in ((0.0, 1.0), (1.0, 0.0), (float("inf"), 1.0), (1.0, float("nan"))):
        adapter.observe("copy", predicted, seconds)
    assert adapter.scales["copy"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="route"):
        adapter.observe("disk", 1.0, 1.0)
    with pytest.raises(ValueError, match="weight"):
        RouteAdapter(weight=0.0)


def test_a_slower_measured_route_gets_fewer_misses():
    base = RouteCosts(cpu_fixed=1.0, copy_fixed=1.0)
    tokens = [1] * 6
    cpu, copy = split_misses(tokens, "auto", base)
    assert len(cpu) == len(copy) == 3
    adapter = RouteAdapter()
    adapter.observe("cpu", 1.0, 2.0)  # the CPU took twice what the start-up costs said
    adapter.observe("copy", 1.0, 1.0)
    cpu, copy = split_misses(tokens, "auto", adapter.costs(base))
    assert len(cpu) == 2 and len(copy) == 4


# An adapting split with every miss a miss, and no chooser: each call is split by the adapted costs.
ADAPTING = dict(cache_slots=0, miss_route="auto", calibrate=False, policy="lru", adapt_costs=True, choose_split=False)


def _decode_calls(dispatcher: TieredDispatcher, calls: int, seed: int = 0) -> list[int]:
    """Run 1-token decode calls over random routing; returns the CPU pairs each call sent."""
    layout = dispatcher.store.layout
    g = torch.Generator().manual_seed(seed)
    sent = []
    for _ in range(calls):
        before = dispatcher.metrics.total().cpu_pairs
        hidden = torch.randn(1, layout.hidden_size, generator=g)
        ids = torch.randperm(layout.num_experts, generator=g)[: layout.top_k][None]
        weights = torch.rand(1, layout.top_k, generator=g)
        dispatcher.dispatch(0, hidden, ids, weights)
        sent.append(dispatcher.metrics.total().cpu_pairs - before)
    return sent


def test_dispatcher_moves_misses_off_a_route_that_turned_slow(monkeypatch):
    """Equal start-up costs split a decode call's misses evenly; once the CPU tier runs 50 ms per job
    (as when another reader saturates host memory) the split sends it none (2 misses a call: the CPU
    gets one only while it costs less than two copies)."""
    store = random_store()  # 16 experts per layer, top-2, fp32, on the CPU
    dispatcher = TieredDispatcher(store, **ADAPTING)
    dispatcher.prepare("cpu")
    dispatcher.costs = RouteCosts(cpu_fixed=1e-3, copy_fixed=1e-3)
    expert = cpu_tier.swiglu_expert

    def slow(*args):
        time.sleep(0.05)
        return expert(*args)

    monkeypatch.setattr(cpu_tier, "swiglu_expert", slow)  # fp32 jobs run torch's path through it
    first = _decode_calls(dispatcher, 1)
    assert first == [1]  # 2 misses, equal costs: one each way
    later = _decode_calls(dispatcher, 8, seed=1)
    assert dispatcher.adapter.scales["cpu"] > 4 * dispatcher.adapter.scales["copy"]
    assert later[-4:] == [0, 0, 0, 0]


def test_fixed_shares_and_pure_routes_do_not_adapt():
    store = random_store()
    for options in (
        {"miss_route": "auto", "cpu_share": 0.5, "adapt_costs": True},
        {"miss_route": "cpu", "adapt_costs": True},
        {"adapt_costs": False},
        {},  # the default adapts on CUDA only: CPU runs split reproducibly
    ):
        dispatcher = TieredDispatcher(store, cache_slots=0, calibrate=False, **options)
        dispatcher.prepare("cpu")
        _decode_calls(dispatcher, 3)
        assert dispatcher.adapter.scales == {}, options


def test_metrics_export_the_route_scales_live():
    from moetier.server.metrics import ServerMetrics

    store = random_store()
    dispatcher = TieredDispatcher(store, cache_slots=0, calibrate=False, adapt_costs=True, choose_split=False)
    dispatcher.prepare("cpu")
    server = ServerMetrics(lambda: None, lambda: "tiny", lambda: dispatcher.metrics)
    assert "tier_route_cost_scale" not in server.render().decode()  # nothing measured yet
    _decode_calls(dispatcher, 4)
    dispatcher.metrics.reset()  # a counter reset keeps the scales: they are state
    text = server.render().decode()
    for route in ("cpu", "copy"):
        line = next(
            x
            for x in text.splitlines()
            if x.startswith(f'moetier:tier_route_cost_scale{{model_name="tiny",route="{route}"}}')
        )
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(dispatcher.adapter.scales[route])


def test_a_starved_route_is_probed_with_the_smallest_thin_group():
    costs = RouteCosts(cpu_fixed=100.0, copy_fixed=1.0)  # the CPU looks dear: the split gives it nothing
    tokens = [3, 1, 2, 20]
    assert split_misses(tokens, "auto", costs, fat_threshold=16) == ([], [0, 1, 2, 3])
    assert split_misses(tokens, "auto", costs, fat_threshold=16, probe="cpu") == ([1], [0, 2, 3])
    assert split_misses([5], "auto", costs, fat_threshold=4, probe="cpu") == ([], [0])  # a fat group never moves
    cheap_cpu = RouteCosts(cpu_fixed=1.0, copy_fixed=100.0)
    assert split_misses(tokens[:3], "auto", cheap_cpu, probe="copy") == ([0, 2], [1])
    assert split_misses(tokens, "auto", RouteCosts(), probe="cpu")[0]  # already has work: unchanged
    assert split_misses(tokens, "cpu", costs, probe="copy") == ([0, 1, 2, 3], [])  # pure routes ignore probes


def test_adapter_asks_for_a_probe_after_a_route_starved_and_counts_afresh():
    adapter = RouteAdapter(probe_after=3)
    for _ in range(2):
        adapter.note_split(0, 4)
    adapter.note_split(0, 0)  # a call without misses says nothing
    assert adapter.probe() is None
    adapter.note_split(0, 2)
    assert adapter.probe() == "cpu" and adapter.probe() is None  # one probe, then count again
    adapter.note_split(1, 1)
    assert adapter.idle_calls == {"cpu": 0, "copy": 0}
    with pytest.raises(ValueError, match="probe_after"):
        RouteAdapter(probe_after=0)


def test_dispatcher_measures_a_route_again_after_starving_it():
    """A CPU route once priced 1000x too dear gets no misses; after ``probe_after`` calls it gets one, the
    adapter sees what it really costs, and the split uses it again."""
    store = random_store()
    dispatcher = TieredDispatcher(store, **ADAPTING)
    dispatcher.prepare("cpu")
    dispatcher.adapter.probe_after = 4
    dispatcher.costs = RouteCosts(cpu_fixed=1.0, copy_fixed=1e-3)  # the CPU tier's start-up timing an outlier
    sent = _decode_calls(dispatcher, 12)
    assert sent[:4] == [0, 0, 0, 0] and sum(sent[4:]) >= 1
    assert dispatcher.adapter.scales["cpu"] < 0.1  # observed: far cheaper than the start-up cost said


def test_copy_timings_feed_the_adapter_without_waiting():
    from moetier.tiers.copy_timings import CopyTimings

    adapter = RouteAdapter(weight=1.0)
    host = CopyTimings(adapter, copy_stream=None)  # off CUDA: copies block, the host clock times them
    host.stop(host.start(), predicted=1.0)
    assert 0 < adapter.scales["copy"] < 1.0

    class Event:
        def __init__(self, done: bool, ms: float = 0.0) -> None:
            self.done, self.ms = done, ms

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: "Event") -> float:
            return end.ms

    cuda = CopyTimings(RouteAdapter(weight=1.0, max_step=100.0), copy_stream=object())
    cuda._pending = [(1.0, Event(True), Event(True, 2000.0)), (1.0, Event(True), Event(False)), (1.0, None, None)]
    cuda.poll()  # the first call's copies are done (2 s against 1 predicted); the second's are not: stop there
    assert cuda.adapter.scales["copy"] == pytest.approx(2.0) and len(cuda._pending) == 2
