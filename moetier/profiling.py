"""Named phases on the profiler's timeline (``bench decode --trace``), free when no profiler runs.

``torch.profiler.record_function`` costs ~13 us per use even with no profiler attached (measured on
the dev VM), and a tiered decode layer enters about ten of them on its critical path (the dispatcher's
phases, the CPU tier's worker, the model's attention and dispatch). :func:`phase` checks the profiler's
process-wide switch first: the check is a module attribute read, and it is true in every thread while a
profiler runs (``torch._C._autograd._profiler_enabled()`` is per thread, false in the CPU tier's worker).
"""

from __future__ import annotations

import contextlib

from torch.autograd import profiler as _autograd_profiler
from torch.profiler import record_function

_NO_PHASE = contextlib.nullcontext()  # stateless, so one instance serves every use in every thread


def profiling() -> bool:
    """Whether a torch profiler is recording (True when torch no longer exposes the switch: record then)."""
    return bool(getattr(_autograd_profiler, "_is_profiler_enabled", True))


def phase(name: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records, else a shared no-op context."""
    return record_function(name) if profiling() else _NO_PHASE
