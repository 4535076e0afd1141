"""The bounds' own measurements: the host's read alone and beside the DMA engine's copies."""

import time

import pytest
import torch

from moetier.bench import bandwidth


class _Sleeper(bandwidth.Runner):
    """A link of a known rate: ``nbytes`` a step of ``step_s`` seconds."""

    def __init__(self, name: str, nbytes: int, step_s: float) -> None:
        self.name, self.nbytes, self.step_s = name, nbytes, step_s

    def step(self) -> int:
        time.sleep(self.step_s)
        return self.nbytes


def test_a_window_rates_each_runner_over_its_own_span():
    # 1 MB a 10 ms step is 0.1 GB/s, 4 MB a 20 ms step 0.2.
    slow, fast = bandwidth.run_window([_Sleeper("slow", 10**6, 0.01), _Sleeper("fast", 4 * 10**6, 0.02)], 0.3)
    rates = [w.bytes / w.seconds / 1e9 for w in (slow, fast)]
    # A sleep never ends early but may end late on a busy machine: a runner is at most its rate, and not far below.
    assert 0.05 < rates[0] <= 0.1 * 1.01 and 0.1 < rates[1] <= 0.2 * 1.01
    assert min(slow.seconds, fast.seconds) >= 0.3


def test_the_host_sum_reads_its_whole_buffer_a_step():
    runner = bandwidth.HostSumRunner(3 << 20)
    assert runner.step() == 3 << 20 and bandwidth.host_read_gbps(3 << 20) > 0


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
