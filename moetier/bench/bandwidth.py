"""The bounds every benchmark is reported against, measured by the benchmark itself at start.

Also the window that runs reading links at once (:class:`Runner`, :func:`run_window`): the bounds run the CPU's
sum beside the DMA engine's copies in it, and ``bench links`` (:mod:`moetier.bench.links`) every link of the
split decode."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

GiB = 1 << 30


def _best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up: first touch, lazy initialisation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Runner(ABC):
    """One link's reads, a unit at a time (the bounds' pair here, every link in ``bench links``).

    Contract: ``start`` runs in the runner's thread before the window (it may queue device work ahead);
    ``step`` blocks until one more unit of work has completed and returns the bytes it read as stored;
    ``finish`` waits for anything still queued and returns its bytes. The window's rate is (bytes of every
    step + finish) / (finish's end - start's call)."""

    name: str

    def start(self) -> None:  # noqa: B027 - optional: only the device links queue work ahead
        """Begin (queue work ahead where the link allows it)."""

    @abstractmethod
    def step(self) -> int: ...

    def finish(self) -> int:
        return 0


class HostSumRunner(Runner):
    """The CPU's read: a multi-threaded sum over a buffer of ``nbytes``, far past the caches."""

    name = "read"

    def __init__(self, nbytes: int) -> None:
        self.data = torch.ones(nbytes // 4, dtype=torch.float32)
        self.nbytes = self.data.numel() * 4
        self.data.sum().item()  # first touch

    def step(self) -> int:
        self.data.sum().item()
        return self.nbytes


class PinnedCopyRunner(Runner):
    """The DMA engine's read: a pinned buffer of ``nbytes`` copied to the device, each copy waited for."""

    name = "dma"

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.step()  # first touch, and the copy engine's start

    def step(self) -> int:
        with torch.cuda.stream(self.stream):
            self.dst.copy_(self.src, non_blocking=True)
        self.stream.synchronize()
        return self.src.numel()


@dataclass
class Window:
    """What one runner did in a window: its bytes, steps and seconds (its own span), or the error it raised."""

    bytes: int = 0
    steps: int = 0
    seconds: float = 0.0
    error: BaseException | None = None


def run_window(runners: list[Runner], seconds: float) -> list[Window]:
    """Run ``runners`` together, each in a thread, released by one barrier and stopped at one deadline."""
    windows = [Window() for _ in runners]
    barrier = threading.Barrier(len(runners))

    def loop(runner: Runner, window: Window) -> None:
        try:
            barrier.wait()
            deadline = time.perf_counter() + seconds
            began = time.perf_counter()
            runner.start()
            while time.perf_counter() < deadline:
                window.bytes += runner.step()
                window.steps += 1
            window.bytes += runner.finish()
            window.seconds = time.perf_counter() - began
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, in its thread
            window.error = exc
            barrier.abort()

    threads = [
        threading.Thread(target=loop, args=(runner, window), name=f"window-{runner.name}")
        for runner, window in zip(runners, windows, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for window in windows:
        if window.error is not None and not isinstance(window.error, threading.BrokenBarrierError):
            raise window.error
    return windows


def host_read_gbps(nbytes: int = 2 * GiB) -> float:
    """Host DRAM read bandwidth by the CPU alone: :class:`HostSumRunner`'s sum, the best of a few."""
    runner = HostSumRunner(nbytes)
    return runner.nbytes / _best_seconds(runner.step) / 1e9


def h2d_gbps(nbytes: int = GiB, pinned: bool = True) -> float | None:
    """Host-to-device copy bandwidth from pinned (or pageable) memory; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / _best_seconds(copy) / 1e9


def host_read_beside_dma_gbps(cpu_bytes: int, dma_bytes: int, seconds: float) -> dict[str, float] | None:
    """Host DRAM read by the CPU's sum and the DMA engine's copies at once; None without CUDA.

    The split decode reads misses by both links at once, so the host's DRAM read rate is what the two reach
    together: on the test hosts that is above the CPU's sum alone (``bench links``' ``read+dma``).
    """
    if not torch.cuda.is_available():
        return None
    pair = [HostSumRunner(cpu_bytes), PinnedCopyRunner(dma_bytes)]
    rates = {runner.name: w.bytes / w.seconds / 1e9 for runner, w in zip(pair, run_window(pair, seconds), strict=True)}
    return {"cpu": rates["read"], "dma": rates["dma"], "total": sum(rates.values())}


def measure_bounds(quick: bool = False) -> dict[str, Any]:
    """The host's read and copy rates (GB/s, 1e9 bytes), smaller buffers and a shorter window when ``quick``.

    - ``host_read_cpu_gbps``: the CPU's multi-threaded sum alone;
    - ``host_read_beside_dma``: the CPU's sum and the DMA engine's copies at once (each, and their total), or None
      without CUDA;
    - ``host_read_gbps``: the larger of the two totals, the rate the DRAM bounds price misses at, and
      ``host_read_source`` (``cpu`` or ``cpu+dma``) naming which;
    - ``h2d_pinned_gbps``: pinned -> device copies alone, or None without CUDA.
    """
    size = 64 << 20 if quick else GiB
    cpu_alone = host_read_gbps(2 * size)
    beside = host_read_beside_dma_gbps(2 * size, size, 0.2 if quick else 1.0)
    both = beside["total"] if beside else 0.0
    h2d = h2d_gbps(size)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the copies' device buffers, so that the bench's free-VRAM checks see them free
    return {
        "host_read_gbps": max(cpu_alone, both),
        "host_read_source": "cpu+dma" if both > cpu_alone else "cpu",
        "host_read_cpu_gbps": cpu_alone,
        "host_read_beside_dma": beside,
        "h2d_pinned_gbps": h2d,
    }
