"""Two halves of a DeepSeek-V4 decode batch alternating layers (:mod:`moetier.models.deepseek_v4_halves`).

CPU: a tiered dispatcher with ``decode_halves_min_tokens`` runs a step of 3 or 4 sequences as two halves (two
dispatch calls a layer, each of its half's rows, inside :meth:`decode_lane`), and its greedy tokens and logits
equal the whole-batch run's (fp32), eagerly and through fake CUDA graphs (each half's graphs in its own variant);
the lanes' host buffers are their own; a one-stream step, the resident dispatcher and a mapped step stay whole.

GPU (``gpu`` marker): the same on CUDA, where the halves run on two streams after the first steps.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from reference import greedy_groups, relative_error
from test_tiers_fidelity import FP32_REL, load_tiered, small_cache
from test_v4_decode_ops import tiny_model
from test_v4_graph_segments import FakeGraphs

from moetier.errors import ConfigError
from moetier.models import deepseek_v4_halves
from moetier.tiers.cpu_jobs import CallJobs
from moetier.tiers.tiered_config import TieredConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_halves")
    tiny_model(path)
    return path


def tiered_v4(checkpoint, device: str = "cpu", **options):
    resident = tiny_model(checkpoint)
    options = {"cache_slots": small_cache_of(resident), "policy": "lru", **options}
    loaded, _ = load_tiered(checkpoint, torch.float32, device=device, **options)
    return loaded


def small_cache_of(model) -> int:
    return small_cache(SimpleNamespace(store=model.dispatcher.store))  # small_cache reads a loaded model's store


class CallLog:
    """Wraps a dispatcher's dispatch: (layer, rows, lane) per call."""

    def __init__(self, dispatcher) -> None:
        self.calls: list[tuple[int, int, int | None]] = []
        self._dispatch = dispatcher.dispatch
        self._dispatcher = dispatcher
        dispatcher.dispatch = self

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        self.calls.append((layer, hidden.shape[0], getattr(self._dispatcher, "_lane", None)))
        return self._dispatch(layer, hidden, topk_ids, topk_weights)


@pytest.mark.parametrize("route", ["cpu", "auto"])
@pytest.mark.parametrize("size", [4, 3])
@torch.no_grad()
def test_halves_give_the_whole_batch_tokens_and_logits(checkpoint, route, size):
    whole = tiered_v4(checkpoint, miss_route=route)
    halves = tiered_v4(checkpoint, miss_route=route, decode_halves_min_tokens=2)
    log = CallLog(halves.model.dispatcher)
    ref_tokens, ref_logits = greedy_groups(whole.model, groups=(size,), steps=8)
    tokens, logits = greedy_groups(halves.model, groups=(size,), steps=8)
    for loaded in (whole, halves):
        loaded.model.dispatcher.close()
    assert tokens == ref_tokens
    assert max(relative_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) < FP32_REL
    decode = [(layer, rows, lane) for layer, rows, lane in log.calls if rows < size]  # the prefill call is whole
    moe_layers = len(halves.model.layers)
    cut = (size + 1) // 2
    expected = {(layer, rows, lane): 8 for layer in range(moe_layers) for lane, rows in enumerate((cut, size - cut))}
    assert Counter(decode) == Counter(expected)
    metrics = halves.model.dispatcher.metrics
    assert 1 - metrics.snapshot()["hit_rate"] > 0.5  # the CPU tier and copies did the work
    assert metrics.total().half_calls == sum(expected.values())


class VariantGraphs(FakeGraphs):
    """:class:`FakeGraphs` noting the variant of every capture (a finished batch's graphs are dropped with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: Counter = Counter()

    def _capture(self, fn, inputs):
        self.captured[self._variant] += 1
        return super()._capture(fn, inputs)


@torch.no_grad()
def test_halves_through_fake_graphs_keep_a_variant_each(checkpoint):
    whole = tiered_v4(checkpoint, miss_route="cpu")
    halves = tiered_v4(checkpoint, miss_route="cpu", decode_halves_min_tokens=2)
    graphs = halves.model.graphs = VariantGraphs()
    whole.model.graphs = FakeGraphs()
    ref_tokens, ref_logits = greedy_groups(whole.model, groups=(4,), steps=6)
    tokens, logits = greedy_groups(halves.model, groups=(4,), steps=6)
    for loaded in (whole, halves):
        loaded.model.dispatcher.close()
    assert tokens == ref_tokens
    assert max(relative_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) < FP32_REL
    assert graphs.failures == {} and graphs.replays > 0
    layers = len(halves.model.layers)  # each half's layers once, the whole batch's inputs and final once
    assert graphs.captured == {deepseek_v4_halves.WHOLE: 2, ("decode halves", 0): layers, ("decode halves", 1): layers}


@pytest.mark.parametrize(
    ("least", "size", "route"),
    [(2, 1, "cpu"), (4, 3, "cpu"), (2, 4, "mapped")],
    ids=["one-stream", "below-the-threshold", "mapped-route"],
)
@torch.no_grad()
def test_other_steps_stay_whole(checkpoint, least, size, route):
    halves = tiered_v4(checkpoint, miss_route=route, decode_halves_min_tokens=least)
    log = CallLog(halves.model.dispatcher)
    greedy_groups(halves.model, groups=(size,), steps=3)
    halves.model.dispatcher.close()
    assert log.calls or route == "mapped"  # (a mapped step's calls may run inside the segments, unlogged)
    assert all(lane is None for _, _, lane in log.calls)
    assert halves.model.dispatcher.metrics.total().half_calls == 0


def test_the_resident_dispatcher_never_splits(checkpoint):
    assert not tiny_model(checkpoint).dispatcher.decode_halves(4)  # its calls keep the device busy


def test_each_lane_has_its_own_host_buffers(checkpoint):
    loaded = tiered_v4(checkpoint, miss_route="cpu", decode_halves_min_tokens=2)
    dispatcher = loaded.model.dispatcher
    dispatcher.prepare("cpu")
    default = dispatcher._host_buffers
    seen = []
    for lane in (0, 1, 0):
        with dispatcher.decode_lane(lane):
            assert dispatcher.jobs.buffers is dispatcher._host_buffers
            seen.append(dispatcher._host_buffers)
        assert dispatcher._host_buffers is default and dispatcher.jobs.buffers is default
    dispatcher.close()
    assert seen[0] is seen[2] and seen[0] is not seen[1] and default not in seen


def test_a_lane_collects_only_the_jobs_that_are_done():
    jobs = CallJobs.__new__(CallJobs)
    accounted = []
    jobs._account = lambda layer, future, result: accounted.append(layer)
    done, running = Future(), Future()
    done.set_result("sums")
    jobs.pending = [(0, done, ()), (1, running, ())]
    jobs.collect_pending(finished_only=True)
    assert accounted == [0] and [layer for layer, _, _ in jobs.pending] == [1]
    running.set_result("sums")
    jobs.collect_pending()
    assert accounted == [0, 1] and jobs.pending == []


@pytest.mark.parametrize("value", [1, -1, True, 2.5])
def test_a_bad_threshold_is_refused(value):
    with pytest.raises(ConfigError, match="decode_halves_min_tokens"):
        TieredConfig(cache_slots=4, decode_halves_min_tokens=value)


@pytest.mark.gpu
@torch.no_grad()
def test_halves_on_cuda_streams_give_the_whole_batch_tokens(checkpoint):
    """Past the first (one-stream) steps the halves run on two CUDA streams, with graphs: the same tokens and
    logits as the whole batch's tiered run."""
    whole = tiered_v4(checkpoint, device="cuda", miss_route="auto")
    halves = tiered_v4(checkpoint, device="cuda", miss_route="auto", decode_halves_min_tokens=2, choose_split=False)
    log = CallLog(halves.model.dispatcher)
    steps = deepseek_v4_halves.SERIAL_STEPS + 8
    ref_tokens, ref_logits = greedy_groups(whole.model, groups=(4,), steps=steps)
    tokens, logits = greedy_groups(halves.model, groups=(4,), steps=steps)
    for loaded in (whole, halves):
        loaded.model.dispatcher.close()
    assert tokens == ref_tokens
    assert max(relative_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) < FP32_REL
    assert sum(lane == 1 for _, _, lane in log.calls) == steps * len(halves.model.layers)
    assert halves.model.graphs.failures == {}
