"""The bounds' own measurements: the host's read alone and beside the DMA engine's copies."""

import time

import pytest
import torch

from moetier.bench import bandwidth


def _sleeper(nbytes: int, seconds: float):
    def read(call: int) -> int:
        time.sleep(seconds)
        return nbytes

    return read


def test_concurrent_readers_report_their_own_rates_over_the_same_window():
    # Sleeping readers stand in for links of known rates: 1 MB a 10 ms call is 0.1 GB/s, 4 MB a 20 ms call 0.2.
    rates = bandwidth.concurrent_gbps({"slow": _sleeper(10**6, 0.01), "fast": _sleeper(4 * 10**6, 0.02)}, 0.3)
    assert list(rates) == ["slow", "fast"]
    # A sleep never ends early but may end late on a busy machine: a reader is at most its rate, and not far below.
    assert 0.05 < rates["slow"] <= 0.1 * 1.01 and 0.1 < rates["fast"] <= 0.2 * 1.01


def test_a_reader_that_fails_raises_in_the_caller():
    def broken(call: int) -> int:
        raise RuntimeError("the copy failed")

    with pytest.raises(RuntimeError, match="the copy failed"):
        bandwidth.concurrent_gbps({"ok": _sleeper(1, 0.001), "broken": broken}, 0.05)


def test_a_reader_makes_one_call_even_past_a_zero_window():
    rates = bandwidth.concurrent_gbps({"one": _sleeper(10**6, 0.01)}, 0.0)
    assert 0.02 < rates["one"] <= 0.1 * 1.01


def test_the_slice_reader_reads_a_slice_a_call(monkeypatch):
    monkeypatch.setattr(bandwidth, "_SLICE_BYTES", 1 << 20)
    read = bandwidth._cpu_slice_reader(3 << 20)
    assert [read(call) for call in range(4)] == [1 << 20] * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only shape of the bounds")
def test_bounds_without_cuda_price_misses_at_the_cpu_read_alone():
    bounds = bandwidth.measure_bounds(quick=True)
    assert bounds["host_read_beside_dma"] is None and bounds["h2d_pinned_gbps"] is None
    assert bounds["host_read_source"] == "cpu" and bounds["host_read_gbps"] == bounds["host_read_cpu_gbps"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bounds_on_cuda_take_the_larger_of_the_cpu_alone_and_beside_dma():
    bounds = bandwidth.measure_bounds(quick=True)
    beside = bounds["host_read_beside_dma"]
    assert beside["cpu"] > 0 and beside["dma"] > 0 and beside["total"] == pytest.approx(beside["cpu"] + beside["dma"])
    assert bounds["host_read_gbps"] == max(bounds["host_read_cpu_gbps"], beside["total"])
    assert bounds["host_read_source"] == ("cpu+dma" if beside["total"] > bounds["host_read_cpu_gbps"] else "cpu")
    assert bounds["h2d_pinned_gbps"] > 0
