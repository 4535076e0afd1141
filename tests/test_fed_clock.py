"""The fed CPU share's device-clock samples (moetier.tiers.fed_clock) and the stamps themselves
(moetier.kernels.device_clock: CUDA only, run in the GPU suite)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_mapped_cpu import LAYOUT
from test_tiers_fidelity import _random_store

from moetier.errors import ConfigError
from moetier.kernels import cpu_experts
from moetier.kernels.device_clock import launch_stamp, stamps_usable
from moetier.tiers import mapped_cpu
from moetier.tiers.fed_clock import HANDOFF_SAMPLES, LATE_FLOOR, Handoff, StampedCall, stamped_call
from moetier.tiers.tiered_dispatcher import TieredDispatcher

US = 1000  # ns


def test_a_calls_stamps_become_its_spans_and_unwritten_or_disordered_ones_none():
    call = stamped_call([1_000_000, 1_000_000 + 500 * US, 1_000_000 + 580 * US])
    assert call.device == pytest.approx(500e-6) and call.phase == pytest.approx(580e-6)
    assert call.late == pytest.approx(80e-6) and call.waited
    early = stamped_call([10, 10 + 500 * US, 10 + 503 * US])  # the wait and the stamp's own launch: not late
    assert early.late == pytest.approx(3e-6) and not early.waited
    assert stamped_call([0, 5, 6]) is None  # a call that did not run in the sampled step leaves its zeros
    assert stamped_call([10, 5, 20]) is None and stamped_call([10, 20, 15]) is None


def test_the_handoff_is_the_median_excess_of_the_calls_the_device_waited_for():
    handoff = Handoff()
    late = StampedCall(device=500e-6, phase=600e-6)
    for job in (520e-6, 530e-6, 540e-6):  # phase - job: 80, 70, 60 us
        handoff.observe(late, job)
    assert handoff.seconds == pytest.approx(70e-6)
    handoff.observe(StampedCall(500e-6, 500e-6 + LATE_FLOOR / 2), 300e-6)  # not waited for: tells nothing
    assert handoff.seconds == pytest.approx(70e-6)
    # As the device saw the CPU: the phase where it waited; else the job plus the hand-off, at most its share.
    assert handoff.cpu_seconds(late, 100e-6) == pytest.approx(600e-6)
    assert handoff.cpu_seconds(StampedCall(500e-6, 500e-6), 300e-6) == pytest.approx(370e-6)
    assert handoff.cpu_seconds(StampedCall(500e-6, 500e-6), 480e-6) == pytest.approx(500e-6 + LATE_FLOOR)
    for _ in range(HANDOFF_SAMPLES):  # only the latest calls count
        handoff.observe(late, 590e-6)
    assert handoff.seconds == pytest.approx(10e-6)
    assert Handoff().seconds == 0.0 and Handoff().cpu_seconds(StampedCall(1e-3, 1e-3), 2e-4) == pytest.approx(2e-4)


def test_the_stamps_switch_is_validated(monkeypatch):
    monkeypatch.setenv("MOETIER_FED_STAMPS", "0")
    assert not mapped_cpu.fed_stamps_enabled()
    monkeypatch.setenv("MOETIER_FED_STAMPS", "yes")
    with pytest.raises(ConfigError, match="MOETIER_FED_STAMPS"):
        mapped_cpu.fed_stamps_enabled()
    monkeypatch.delenv("MOETIER_FED_STAMPS")
    assert mapped_cpu.fed_stamps_enabled()


def test_there_are_no_stamps_off_cuda():
    assert not stamps_usable(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stamps_in_a_replayed_graph_time_each_replay_in_stream_order():
    """A graph stamps around a kernel that spins ~50 us: each replay's stamps are that replay's (the later replay's
    are later), ordered, and the span at least the spin; copied back after each replay, as the fed share does."""
    device = torch.device("cuda")
    assert stamps_usable(device)
    stamps = torch.zeros(2, dtype=torch.int64, device=device)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    spin_cycles = 100_000  # ~50 us at the H200's ~1.98 GHz
    with torch.cuda.graph(graph, stream=stream):
        launch_stamp(stamps, 0)
        torch.cuda._sleep(spin_cycles)
        launch_stamp(stamps, 1)
    readings = []
    for _ in range(3):
        graph.replay()
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(stamps, non_blocking=True)
        readings.append(host)
    torch.cuda.synchronize()
    spans = [(int(h[0]), int(h[1])) for h in readings]
    assert all(0 < a < b for a, b in spans)
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0]  # each replay's own, in order
    assert all(b - a >= 20 * US for a, b in spans)  # the spin is inside the span (its clock rate is not known)


@pytest.mark.skipif(not cpu_experts.available(), reason="no C compiler for the CPU tier's kernel")
def test_stamped_calls_become_samples_with_the_cpu_handoff_as_fixed_time(monkeypatch):
    """The fed share's wiring of stamps (off CUDA no kernel stamps, so the copied-back stamps are given): a call the
    device waited 100 us for, whose job took 520 of its 600 us, is a sample of 600 us for the CPU with 80 us of
    hand-off counted as fixed; a call whose row the step did not write is none."""
    tiered = TieredDispatcher(_random_store(LAYOUT, torch.bfloat16), cache_slots=2, miss_route="mapped")  # adaptive
    tiered.prepare("cpu")
    fed = tiered.mapped.cpu
    assert fed.timing == "timed steps"  # off CUDA: the host plays the device and times eager steps
    seen = {}

    def record(share, cpu_seconds, device_seconds, cpu_fixed=0.0):
        seen.update(cpu=cpu_seconds, device=device_seconds, fixed=cpu_fixed)
        return share

    monkeypatch.setattr(mapped_cpu, "balanced_share", record)
    stamps = torch.tensor([[1_000, 1_000 + 500 * US, 1_000 + 600 * US], [0, 0, 0]], dtype=torch.int64)
    counters = fed.metrics.layer(LAYOUT.moe_layers[0])
    passed = SimpleNamespace(query=lambda: True, synchronize=lambda: None)
    unwritten = mapped_cpu.FedCall(1, SimpleNamespace(experts=2), None, stamps=(stamps, 1, passed))
    fed._sample_stamps(300e-6, unwritten, counters)
    assert fed._samples == [] and counters.fed_timed == 0
    samples = mapped_cpu.BALANCE_SAMPLES
    for _ in range(samples):
        call = mapped_cpu.FedCall(0, SimpleNamespace(experts=2), None, stamps=(stamps, 0, passed))
        fed._sample_stamps(520e-6, call, counters)
    assert fed.handoff.seconds == pytest.approx(80e-6)
    assert counters.fed_timed == samples and counters.fed_late_seconds == pytest.approx(samples * 100e-6)
    fed._rebalance()
    tiered.close()
    assert seen["cpu"] == pytest.approx(samples * 600e-6) and seen["device"] == pytest.approx(samples * 500e-6)
    assert seen["fixed"] == pytest.approx(samples * 80e-6)  # no jobs finished: the fitted fixed part is 0
