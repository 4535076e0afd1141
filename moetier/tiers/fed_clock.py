"""A graphed fed call's device-clock stamps as a sample of the fed CPU share's balance.

On CUDA each call of a queued step stamps the device clock three times (:mod:`moetier.kernels.device_clock`):
after its start word is stored, after the device's share of its experts, and once the stream has the CPU's sums.
The device's share is the first span; the CPU's time as the device saw it (its job, plus starting on the start
word and the stream seeing its done word: the *hand-off*) is the whole phase when the device waited for it.
When the CPU was done first the device only knows it was done in time, so the CPU's time is its job's own clock
plus the hand-off measured on the calls where the device waited (:class:`Handoff`). Before stamps, graphed calls
were not timed: eager steps were, whose CPU was ahead of the graphed ones' by their hand-off (H200 traces: in
graphed calls the device then waited a median ~70 us a call for the CPU, results/h200-20261204-e3ff99d-row-cuts).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# A call's stamps, in the order of its slots (one row of three per MoE layer).
STAMPS = ("started", "device_done", "cpu_in")
# The device waited for the CPU when its last stamp came this much after its share's: beneath it, the wait for an
# already stored done word and the stamp's own launch.
LATE_FLOOR = 10e-6
# The hand-off is the median over this many of the latest calls where the device waited.
HANDOFF_SAMPLES = 32


@dataclass(frozen=True)
class StampedCall:
    """One call's spans from its start word (seconds): ``device``, to the end of the device's share; ``phase``, until
    the stream had the CPU's sums."""

    device: float
    phase: float

    @property
    def late(self) -> float:
        """How long the device waited for the CPU after its share (0 when the CPU was done first)."""
        return max(0.0, self.phase - self.device)

    @property
    def waited(self) -> bool:
        return self.late > LATE_FLOOR


def stamped_call(stamps_ns: Sequence[int]) -> StampedCall | None:
    """A call's three stamps (ns, :data:`STAMPS` order) as its spans; None where they are not one finished call's (a
    slot not written this step, or out of order)."""
    started, device_done, cpu_in = (int(s) for s in stamps_ns)
    if started <= 0 or not started <= device_done <= cpu_in:
        return None
    return StampedCall(1e-9 * (device_done - started), 1e-9 * (cpu_in - started))


class Handoff:
    """The CPU's time in a call that its job's clock does not see: from the start word stored on the device until
    the job starts, and from its done word until the stream goes on.

    Contract: :meth:`observe` every stamped call with its job's wall time; :attr:`seconds` is the median of
    ``phase - job`` over the last :data:`HANDOFF_SAMPLES` calls where the device waited (0 before any);
    :meth:`cpu_seconds` is the CPU's time in a call as the device saw it."""

    def __init__(self) -> None:
        self._seen: deque[float] = deque(maxlen=HANDOFF_SAMPLES)
        self.seconds = 0.0

    def observe(self, call: StampedCall, job_seconds: float) -> None:
        if call.waited:
            self._seen.append(max(0.0, call.phase - job_seconds))
            self.seconds = statistics.median(self._seen)

    def cpu_seconds(self, call: StampedCall, job_seconds: float) -> float:
        """The phase where the device waited for the CPU; else the job's time plus the hand-off, at most the device's
        share (the CPU was done by its end)."""
        if call.waited:
            return call.phase
        return min(job_seconds + self.seconds, call.device + LATE_FLOOR)
