"""The fed CPU share's device-clock samples (moetier.tiers.fed_clock) and the stamps themselves
(moetier.kernels.device_clock: CUDA only, run in the GPU suite)."""

from __future__ import annotations

import pytest
import torch

from moetier.errors import ConfigError
from moetier.kernels.device_clock import launch_stamp, stamps_usable
from moetier.tiers import mapped_cpu
from moetier.tiers.fed_clock import HANDOFF_SAMPLES, LATE_FLOOR, Handoff, StampedCall, stamped_call

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
