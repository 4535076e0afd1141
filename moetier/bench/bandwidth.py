"""The bounds every benchmark is reported against, measured by the benchmark itself at start."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

GiB = 1 << 30


def _best_seconds(fn: Callable[[], None], repeats: int = 5) -> float:
    fn()  # warm-up: first touch, lazy initialisation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def host_read_gbps(nbytes: int = 2 * GiB) -> float:
    """Host DRAM read bandwidth: a multi-threaded sum over a buffer far larger than the caches."""
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_seconds(lambda: data.sum().item()) / 1e9


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


# A slice the concurrent runners read a call: far past the last-level cache, and short (a few ms) beside the
# window, so that a runner's last call past the window's end barely runs alone.
_SLICE_BYTES = 256 << 20


def concurrent_gbps(readers: dict[str, Callable[[int], int]], seconds: float) -> dict[str, float]:
    """Run ``readers`` at once, each in its own thread released together, until ``seconds`` have passed.

    A reader takes its call's index and returns the bytes it read. Each reader's GB/s (1e9 bytes) is its bytes
    over its own span (its first call's start to its last call's end), as the runners overlap for the whole
    window but the last. Contract: every reader makes at least one call.
    """
    release = threading.Barrier(len(readers))
    rates: dict[str, float] = {}
    failures: list[Exception] = []

    def loop(name: str, read: Callable[[int], int]) -> None:
        try:
            release.wait()
            start = time.perf_counter()
            deadline, total, calls = start + seconds, 0, 0
            while calls == 0 or time.perf_counter() < deadline:
                total += read(calls)
                calls += 1
            rates[name] = total / (time.perf_counter() - start) / 1e9
        except Exception as exc:  # re-raised in the caller's thread below
            failures.append(exc)  # before the abort: the others' broken-barrier errors come after it
            release.abort()

    threads = [threading.Thread(target=loop, args=item, daemon=True) for item in readers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return {name: rates[name] for name in readers}


def _cpu_slice_reader(nbytes: int) -> Callable[[int], int]:
    """Sums over consecutive slices of a host buffer of ``nbytes``, so that every call reads DRAM."""
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    slices = data.split(_SLICE_BYTES // 4)

    def read(call: int) -> int:
        part = slices[call % len(slices)]
        part.sum().item()
        return part.numel() * 4

    read(0)  # first touch
    return read


def _dma_slice_reader(nbytes: int) -> Callable[[int], int]:
    """Pinned -> device copies of consecutive slices of ``nbytes``, each waited for, on a stream of its own."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pairs = list(zip(src.split(_SLICE_BYTES), dst.split(_SLICE_BYTES), strict=True))
    stream = torch.cuda.Stream()

    def read(call: int) -> int:
        host, device = pairs[call % len(pairs)]
        with torch.cuda.stream(stream):
            device.copy_(host, non_blocking=True)
        stream.synchronize()
        return host.numel()

    read(0)
    return read


def host_read_beside_dma_gbps(cpu_bytes: int, dma_bytes: int, seconds: float) -> dict[str, float] | None:
    """Host DRAM read by the CPU's sum and the DMA engine's copies at once; None without CUDA.

    The split decode reads misses by both links at once, so the host's DRAM read rate is what the two reach
    together: on the test hosts that is above the CPU's sum alone (``bench links``' ``read+dma``).
    """
    if not torch.cuda.is_available():
        return None
    readers = {"cpu": _cpu_slice_reader(cpu_bytes), "dma": _dma_slice_reader(dma_bytes)}
    rates = concurrent_gbps(readers, seconds)
    return rates | {"total": sum(rates.values())}


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
