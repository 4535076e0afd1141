"""A decode call's host inputs (:mod:`moetier.tiers.decode_inputs`): the CPU job built from host tensors
alone, the order the tiered dispatcher starts its two miss routes in, and the profiler phases' cost."""

from __future__ import annotations

import pytest
import torch
from reference import relative_error
from test_tiers_fidelity import _random_store, _routing

from moetier.profiling import clocking, phase, profiling
from moetier.tiers.decode_inputs import HostBuffers, read_host_inputs
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout
from moetier.tiers.route_costs import RouteCosts
from moetier.tiers.tiered_dispatcher import TieredDispatcher

LAYOUT = ExpertLayout((0, 1), num_experts=8, hidden_size=32, intermediate_size=16, top_k=3, swiglu_limit=2.0)


def test_host_buffers_are_reused_and_grow():
    buffers = HostBuffers()
    first = buffers.take("x", (2, 4), torch.float32, pinned=False)
    smaller = buffers.take("x", (1, 4), torch.float32, pinned=False)
    assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (1, 4)
    grown = buffers.take("x", (3, 4), torch.float32, pinned=False)
    assert grown.shape == (3, 4) and grown.numel() == 12
    other = buffers.take("x", (3, 4), torch.bfloat16, pinned=False)
    assert other.dtype == torch.bfloat16
    assert buffers.take("y", (3, 4), torch.float32, pinned=False).data_ptr() != grown.data_ptr()


def test_host_buffer_views_are_kept_until_their_buffer_is_replaced():
    buffers = HostBuffers()
    square = buffers.take("x", (2, 3), torch.float32, pinned=False)
    flat = buffers.take("x", (6,), torch.float32, pinned=False)
    assert buffers.take("x", (2, 3), torch.float32, pinned=False) is square  # no new view per call
    square.copy_(torch.arange(6.0).view(2, 3))
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # one buffer, two shapes
    grown = buffers.take("x", (4, 3), torch.float32, pinned=False)
    again = buffers.take("x", (2, 3), torch.float32, pinned=False)
    assert again is not square and again.data_ptr() == grown.data_ptr()  # views of the new buffer
    assert buffers.take("x", (2, 3), torch.bfloat16, pinned=False).dtype == torch.bfloat16


def test_host_inputs_on_the_cpu_are_the_call_tensors():
    hidden, ids, weights = _routing(2, LAYOUT, torch.Generator().manual_seed(0), torch.float32)
    inputs = read_host_inputs(hidden, ids, weights, HostBuffers(), rows=True)
    assert inputs.hidden is hidden
    assert inputs.ids.tolist() == ids.reshape(-1).tolist() and torch.equal(inputs.weights, weights.reshape(-1))
    assert read_host_inputs(hidden, ids, weights, HostBuffers(), rows=False).hidden is None


def _recorded(tiered: TieredDispatcher) -> list[str]:
    """Which route each call started, in order ("cpu": the job submitted, "copy": copies enqueued)."""
    events: list[str] = []
    submit, fill_many = tiered.cpu_tier.submit, tiered.cache.fill_many
    tiered.cpu_tier.submit = lambda job: events.append("cpu") or submit(job)
    tiered.cache.fill_many = lambda work: events.append("copy") or fill_many(work)
    return events


@pytest.mark.parametrize("copy_cost", [1.0, 0.6])
def test_copies_start_first_then_the_cpu_job(copy_cost):
    """Whichever route is predicted longer (one token, three distinct misses, longest-processing-time split
    with ties to the CPU: equal costs give the CPU two experts, copy cost 0.6 gives the copy path two), the
    copies are enqueued first and the CPU job is submitted right after; results equal the resident path."""
    store = _random_store(LAYOUT, torch.float32)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=0, staging_slots=4, decode_prefetch=0)
    tiered.prepare("cpu")
    tiered.costs = RouteCosts(cpu_fixed=1.0, copy_fixed=copy_cost)
    events = _recorded(tiered)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        hidden, ids, weights = _routing(1, LAYOUT, generator, torch.float32)
        events.clear()
        ours = tiered.dispatch(0, hidden, ids, weights)
        assert events == ["copy", "cpu"]
        assert relative_error(ours, resident.dispatch(0, hidden, ids, weights)) < 1e-6
    cpu_pairs, copy_pairs = tiered.metrics.total().cpu_pairs, tiered.metrics.total().copy_pairs
    assert (cpu_pairs, copy_pairs) == ((6, 3) if copy_cost == 1.0 else (3, 6))
    tiered.close()


def test_a_cpu_only_call_reads_its_rows_and_sums_every_row(monkeypatch):
    """Decode of several tokens on the CPU tier alone: the job reads the call's rows as they are and its
    sums cover every row, including rows no CPU group touched (zero), across reused buffers; with nothing
    for the device, no sorted pairs are made there."""
    from moetier.tiers.call_routing import Routing

    monkeypatch.setattr(Routing, "to_device", lambda self, device: pytest.fail("device pairs for no device work"))
    store = _random_store(LAYOUT, torch.float32)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=0, miss_route="cpu")
    generator = torch.Generator().manual_seed(2)
    for tokens in (3, 1, 4, 2):
        hidden, ids, weights = _routing(tokens, LAYOUT, generator, torch.float32)
        for layer in LAYOUT.moe_layers:
            ours = tiered.dispatch(layer, hidden, ids, weights)
            assert relative_error(ours, resident.dispatch(layer, hidden, ids, weights)) < 1e-6
    assert tiered.metrics.total().cpu_pairs == 2 * (3 + 1 + 4 + 2) * LAYOUT.top_k
    tiered.close()


def test_phases_cost_nothing_without_a_profiler():
    assert not profiling()
    with phase("a") as first, phase("b") as second:
        assert first is None and second is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiling()
        with phase("moetier.test_phase"):
            torch.ones(1).add_(1)
    assert any(event.name == "moetier.test_phase" for event in prof.events())


def test_clocking_times_phases_in_every_thread_and_only_while_on():
    import threading
    import time

    with clocking() as clock:
        with phase("outer"), phase("inner"):
            time.sleep(0.002)

        def in_worker() -> None:
            with phase("worker"):
                pass

        worker = threading.Thread(target=in_worker)
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="already"), clocking():
            pass
    assert clock.seconds["outer"] >= clock.seconds["inner"] >= 0.002
    assert clock.calls["outer"] == clock.calls["inner"] == 1 and clock.calls["worker"] == 1
    with phase("after"):
        pass
    assert "after" not in clock.seconds and phase("x") is phase("y")  # off again: the shared no-op
