"""The bounds every benchmark is reported against, measured by the benchmark itself at start."""

from __future__ import annotations

import time
from collections.abc import Callable

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


def measure_bounds(quick: bool = False) -> dict[str, float | None]:
    """``host_read_gbps`` and ``h2d_pinned_gbps`` (GB/s, 1e9 bytes), smaller buffers when ``quick``."""
    size = 64 << 20 if quick else GiB
    return {"host_read_gbps": host_read_gbps(2 * size), "h2d_pinned_gbps": h2d_gbps(size)}
