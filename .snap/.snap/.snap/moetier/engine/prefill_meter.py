"""Prefill progress and throughput: what an operator watching a 100k-token prompt needs to see.

The engine reports to a :class:`PrefillMeter` as it steps:

- ``begin`` when a request's first prefill chunk is about to run (the prompt tokens already in its
  cache then are the prefix-cache hit);
- ``advance`` after each of its chunks, with the prompt tokens that chunk computed. The meter logs a
  progress line every ``log_interval`` seconds of a long prefill, and one INFO line when the prefill
  completes: ``request X: prefilled N tokens (M from the prefix cache) in S s, R tok/s``, where S runs
  from the first chunk's start to the last chunk's end and R counts the computed tokens (N - M) only;
- ``step`` once per step that computed prompt tokens, with its wall time and the tokens computed.

Counters: ``seconds_total`` (wall seconds of steps that computed prompt tokens: a step that also
decoded other streams counts whole, and overlapping prefills are not counted twice) and
``computed_tokens_total`` (prompt tokens the model computed, prefix-cache hits excluded), so their
rates' ratio is the prefill throughput. ``tokens_per_second`` is that ratio over roughly the last
``horizon`` seconds of prefill work (both sums decay by ``exp(-step seconds / horizon)`` per step); it
keeps its last value while nothing is prefilled, and is 0 before the first prefill.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class _Prefill:
    total: int
    cached: int
    done: int
    started: float
    last_log: float


class PrefillMeter:
    """Per-request prefill progress, its log lines, and the engine-wide prefill counters."""

    def __init__(self, log_interval: float = 10.0, horizon: float = 30.0) -> None:
        self.log_interval = log_interval
        self.horizon = horizon
        self.seconds_total = 0.0
        self.computed_tokens_total = 0
        self._recent_tokens = 0.0
        self._recent_seconds = 0.0
        self._prefills: dict[str, _Prefill] = {}

    @property
    def tokens_per_second(self) -> float:
        return self._recent_tokens / self._recent_seconds if self._recent_seconds > 0 else 0.0

    def begin(self, request_id: str, cached: int, total: int, now: float) -> None:
        """The request's first chunk starts at ``now`` with ``cached`` of its ``total`` prompt tokens in its
        cache already; later calls for the same request are ignored."""
        if request_id not in self._prefills:
            self._prefills[request_id] = _Prefill(total, cached, cached, now, now)

    def advance(self, request_id: str, tokens: int, now: float) -> None:
        """A chunk ending at ``now`` computed ``tokens`` prompt tokens of the request: log progress or completion."""
        prefill = self._prefills.get(request_id)
        if prefill is None:
            return
        prefill.done += tokens
        elapsed = max(now - prefill.started, 1e-9)
        rate = (prefill.done - prefill.cached) / elapsed
        if prefill.done >= prefill.total:
            del self._prefills[request_id]
            logger.info(
                "request %s: prefilled %d tokens (%d from the prefix cache) in %.2f s, %.0f tok/s",
                request_id,
                prefill.total,
                prefill.cached,
                elapsed,
                rate,
            )
        elif now - prefill.last_log >= self.log_interval:
            prefill.last_log = now
            logger.info(
                "request %s: prefill %d/%d tokens, %.1f s, %.0f tok/s",
                request_id,
                prefill.done,
                prefill.total,
                elapsed,
                rate,
            )

    def drop(self, request_id: str) -> None:
        """The request finished, failed or was aborted (its prefill may be incomplete): forget it."""
        self._prefills.pop(request_id, None)

    def step(self, seconds: float, computed_tokens: int) -> None:
        """A step of ``seconds`` wall time computed ``computed_tokens`` prompt tokens (call only when > 0)."""
        self.seconds_total += seconds
        self.computed_tokens_total += computed_tokens
        keep = math.exp(-seconds / self.horizon)
        self._recent_tokens = self._recent_tokens * keep + computed_tokens
        self._recent_seconds = self._recent_seconds * keep + seconds
