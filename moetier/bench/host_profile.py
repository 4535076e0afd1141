"""Where a benchmark's host thread spends its time: a cProfile summary of one run of a callable.

The torch profiler's host ops (``bench prefill --profile``) name the aten calls and CUDA API calls, but the
Python between them (a dispatcher's bookkeeping, Triton's launcher, a kernel guard's shape checks) shows only
as the self time of the enclosing range. cProfile names it by function. It slows Python-heavy code down (each
call costs it ~0.1-1 us more), so its totals are not timings: read the shares, and time without it.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _where(file: str, line: int, name: str) -> str:
    """``package/module.py:line(name)`` (the last two path parts), or the built-in's name."""
    if file == "~":  # a built-in (C) function: cProfile keeps its name only
        return name
    return f"{'/'.join(Path(file).parts[-2:])}:{line}({name})"


def profile_host(run: Callable[[], Any], top: int = 25) -> dict[str, Any]:
    """Run ``run()`` once under cProfile; its wall time under the profiler, the profiled calls' count, and the
    ``top`` functions by own time (``tottime``: time in the function itself, not in what it called)."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])
    return {
        "wall_s_under_profiler": round(wall, 4),
        "calls": sum(entry[1] for entry in stats.values()),
        "top_by_own_time": [
            {"function": _where(*key), "calls": calls, "own_ms": round(own * 1e3, 3), "cum_ms": round(cum * 1e3, 3)}
            for key, (_, calls, own, cum, _) in rows[:top]
        ],
    }


def host_profile_lines(label: str, summary: dict[str, Any], shown: int = 10) -> list[str]:
    """Markdown lines for a :func:`profile_host` summary: its wall time and its heaviest functions."""
    top = ", ".join(f"{r['function']} x{r['calls']} {r['own_ms']:.1f}" for r in summary["top_by_own_time"][:shown])
    return [
        f"- host profile {label}: {summary['wall_s_under_profiler']:.3f} s under cProfile, "
        f"{summary['calls']} Python calls",
        f"  - own time (ms): {top}",
    ]
