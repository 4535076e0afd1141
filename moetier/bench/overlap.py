"""Did the copies overlap the compute? Busy time of the copy engine and of the kernels from a profiler trace.

A torch profiler run exports a Chrome trace whose device events carry a category: ``kernel`` for
compute, ``gpu_memcpy`` for copies (host-to-device expert copies among them). Each category's busy
time is the length of the union of its intervals; the overlap is the length of the intersection
of the two unions. Copy-then-compute shows an overlap near zero; a streaming prefill hides the
shorter of the two behind the longer, so ``hidden_share_of_shorter`` (overlap over the smaller busy
time) near 1 is perfect overlap, whichever side bounds the run.
"""

from __future__ import annotations

from typing import Any

Interval = tuple[float, float]

COPY_CATEGORY = "gpu_memcpy"
KERNEL_CATEGORY = "kernel"


def merged(intervals: list[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same points."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in merged(intervals))


def intersection_length(a: list[Interval], b: list[Interval]) -> float:
    """Length of the points covered by both interval sets."""
    a, b = merged(a), merged(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def device_intervals(trace: dict[str, Any], category: str, name_contains: str = "") -> list[Interval]:
    """``(start, end)`` in microseconds of the trace's complete events of ``category``."""
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") == category and name_contains in event.get("name", ""):
            start = float(event["ts"])
            out.append((start, start + float(event.get("dur", 0.0))))
    return out


def overlap_summary(trace: dict[str, Any]) -> dict[str, float | int]:
    """Seconds the host-to-device copies and the kernels were busy, together, and over the whole window."""
    copies = device_intervals(trace, COPY_CATEGORY, "HtoD")
    kernels = device_intervals(trace, KERNEL_CATEGORY)
    both = copies + kernels
    window = (max(e for _, e in both) - min(s for s, _ in both)) if both else 0.0
    copy_busy, kernel_busy = length(copies), length(kernels)
    overlap = intersection_length(copies, kernels)
    return {
        "copies": len(copies),
        "kernels": len(kernels),
        "window_s": window / 1e6,
        "copy_busy_s": copy_busy / 1e6,
        "kernel_busy_s": kernel_busy / 1e6,
        "overlap_s": overlap / 1e6,
        "copy_hidden_share": overlap / copy_busy if copy_busy else 0.0,
        "hidden_share_of_shorter": overlap / min(copy_busy, kernel_busy) if min(copy_busy, kernel_busy) else 0.0,
        "copy_engine_utilisation": copy_busy / window if window else 0.0,
    }
