"""The decode bench's passes beside its timed one, each on a fresh run: host wall ms per named phase, the host's
Python functions (cProfile), and the torch profiler's top ops, kernel launches and (optionally) a Chrome trace.

Each settles its run first (:func:`settled`): a fresh run's first steps warm up and capture its graphs."""

from __future__ import annotations

import cProfile
import gzip
import io
import pstats
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from moetier.bench.common import sync_device
from moetier.profiling import clocking


class DecodeRun(Protocol):
    """What the passes drive: ``prefill()`` -> the first tokens, ``step(tokens)`` -> the next, on ``model``."""

    model: Any

    def prefill(self) -> torch.Tensor: ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor: ...


PROFILED_STEPS = 4  # steps the torch profiler records per mode (after the settling steps)
# Steps before a profiled or traced pass: a fresh run's first steps warm up and capture its graphs, and a tiered
# route's variants (a fed step's timed eager one, its graphed one) capture later still: the profile is of the
# steady state.
_PROFILE_SETTLE_STEPS = 24

# Decode steps before a fresh run's measured pass: a layer's decode graph reads its sequences' own state, so a
# sequence's first step warms it up and its second captures it (deepseek_v4_step).
_SETTLE_STEPS = 2


def settled(run: DecodeRun, steps: int = _SETTLE_STEPS) -> torch.Tensor:
    """Prefill ``run``, then ``steps`` decode steps -> the next tokens."""
    tokens = run.prefill()
    for _ in range(steps):
        tokens = run.step(tokens)
    return tokens


def clock_steps(run: DecodeRun, steps: int) -> dict[str, Any]:
    """Host wall ms per decode step in each named phase (:func:`moetier.profiling.clocking`), over ``steps``
    steps after the timed ones (no profiler: its per-op cost would skew the shares). ``step`` is the whole
    step; ``tiers.wait`` the host's waits for the device's routing, ``tiers.cpu_wait`` for a CPU job."""
    tokens = settled(run)
    sync_device(run.model.device)
    with clocking() as clock:
        start = time.perf_counter()
        for _ in range(steps):
            tokens = run.step(tokens)
        sync_device(run.model.device)
        elapsed = time.perf_counter() - start
    phases = {name: 1e3 * seconds / steps for name, seconds in sorted(clock.seconds.items())}
    return {"step": 1e3 * elapsed / steps, **phases}


def python_profile(run: DecodeRun, steps: int, rows: int = 30) -> str:
    """The host's Python functions by own time over ``steps`` decode steps (cProfile: where to cut host time)."""
    tokens = settled(run, _PROFILE_SETTLE_STEPS)
    sync_device(run.model.device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        tokens = run.step(tokens)
    sync_device(run.model.device)
    profiler.disable()
    own, inclusive = io.StringIO(), io.StringIO()
    pstats.Stats(profiler, stream=own).sort_stats("tottime").print_stats(rows)
    # moetier's own functions by time including their callees: which of our calls a step's host time sits under.
    pstats.Stats(profiler, stream=inclusive).sort_stats("cumulative").print_stats(r"moetier[/\\]", 2 * rows)
    return (
        f"cProfile of {steps} steps, by own time:\n{own.getvalue()}\n"
        f"moetier's functions by cumulative time:\n{inclusive.getvalue()}"
    )


def profile_steps(run: DecodeRun, steps: int = PROFILED_STEPS, trace_path: Path | None = None) -> str:
    """Top ops by device and by host time over a few decode steps, and the kernel-launch count.

    With ``trace_path`` the steps' timeline (host threads, compute and copy streams) is also written
    there as a gzipped Chrome trace: where a step's time goes between the layers' phases."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.model.device.type == "cuda" else [])
    tokens = settled(run, _PROFILE_SETTLE_STEPS)
    with profile(activities=activities, experimental_config=_trace_config(trace_path)) as prof:
        for _ in range(steps):
            tokens = run.step(tokens)
        sync_device(run.model.device)
    if trace_path is not None:
        _write_trace(prof, trace_path)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    sort_device = "self_cuda_time_total" if run.model.device.type == "cuda" else "self_cpu_time_total"
    return (
        f"kernel launches per step: {launches / steps:.0f}\n"
        + events.table(sort_by=sort_device, row_limit=15)
        + "\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=12)
    )


def _trace_config(trace_path: Path | None) -> Any:
    """Kineto options for a timeline: every thread (the CPU tier's worker too) and the host's CUDA syncs."""
    if trace_path is None:
        return None
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except TypeError:  # an older torch: the worker's ops stay out of the trace
        return _ExperimentalConfig(enable_cuda_sync_events=True)


def _write_trace(prof: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
