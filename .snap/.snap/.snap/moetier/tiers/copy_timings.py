"""How long a decode call's copies took on the copy stream, for the route adapter, without waiting for them."""

from __future__ import annotations

import time
from typing import Any

import torch

from moetier.tiers.route_costs import RouteAdapter


class CopyTimings:
    """Times each call's copy-path copies and reports them to ``adapter`` as route ``copy``.

    On CUDA a call's copies are bracketed by two events on ``copy_stream``; :meth:`poll` (called after a host
    sync anyway) feeds the adapter every pair that has completed, oldest first, and never waits for one.
    Off CUDA (``copy_stream`` None) copies block, so the host clock times them at once.
    """

    def __init__(self, adapter: RouteAdapter, copy_stream: Any) -> None:
        self.adapter, self.copy_stream = adapter, copy_stream
        self._pending: list[tuple[float, Any, Any]] = []  # (predicted seconds, start, end) of a call's copies

    def start(self) -> Any:
        """Before the call's copies: an event on the copy stream, or the host clock."""
        if self.copy_stream is None:
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.copy_stream)
        return start

    def stop(self, start: Any, predicted: float) -> None:
        """After the call's copies were enqueued; ``predicted``: their seconds by the start-up costs."""
        if self.copy_stream is None:
            self.adapter.observe("copy", predicted, time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.copy_stream)
        self._pending.append((predicted, start, end))

    def poll(self) -> None:
        """Feed the adapter the timings whose copies have completed (never waits for one)."""
        while self._pending and self._pending[0][2].query():
            predicted, start, end = self._pending.pop(0)
            self.adapter.observe("copy", predicted, start.elapsed_time(end) / 1e3)
