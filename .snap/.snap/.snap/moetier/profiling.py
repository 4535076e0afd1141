"""Named phases on the profiler's timeline (``bench decode --trace``), free when nothing records them.

``torch.profiler.record_function`` costs ~13 us per use even with no profiler attached (measured on
the dev VM), and a tiered decode layer enters about ten of them on its critical path (the dispatcher's
phases, the CPU tier's worker, the model's attention and dispatch). :func:`phase` checks the profiler's
process-wide switch first: the check is a module attribute read, and it is true in every thread while a
profiler runs (``torch._C._autograd._profiler_enabled()`` is per thread, false in the CPU tier's worker).

Without a profiler, :func:`clocking` makes the same phases add their wall time to a :class:`PhaseClock`
(two ``perf_counter`` reads, ~1 us): where a step's host time goes, without the profiler's own cost on
every op (it inflates a tiered decode step's host time by ~20%, unevenly across ops).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

from torch.autograd import profiler as _autograd_profiler
from torch.profiler import record_function

_NO_PHASE = contextlib.nullcontext()  # stateless, so one instance serves every use in every thread


class PhaseClock:
    """Wall seconds and entries per phase name, from every thread (a worker's phases count apart, by name).

    Nested phases each count their whole span: a parent's seconds include its children's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds
            self.calls[name] += 1


class _Timed:
    """One phase's span on a :class:`PhaseClock`."""

    __slots__ = ("_clock", "_name", "_start")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self._clock, self._name, self._start = clock, name, 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._clock.add(self._name, time.perf_counter() - self._start)


_clock: PhaseClock | None = None


def profiling() -> bool:
    """Whether a torch profiler is recording (True when torch no longer exposes the switch: record then)."""
    return bool(getattr(_autograd_profiler, "_is_profiler_enabled", True))


def phase(name: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records; inside :func:`clocking`, a span on its clock;
    else a shared no-op context."""
    if profiling():
        return record_function(name)
    clock = _clock
    return _NO_PHASE if clock is None else _Timed(clock, name)


def record_phase(name: str, seconds: float) -> None:
    """Add a span measured elsewhere (a C thread's job) to the clock of :func:`clocking`, if one runs."""
    clock = _clock
    if clock is not None:
        clock.add(name, seconds)


@contextlib.contextmanager
def clocking() -> Iterator[PhaseClock]:
    """Time every :func:`phase` entered (by any thread) until the block ends, on a fresh clock."""
    global _clock
    if _clock is not None:
        raise RuntimeError("phases are already being clocked")
    _clock = clock = PhaseClock()
    try:
        yield clock
    finally:
        _clock = None
