"""Predicted experts of the next MoE layer (``ExpertDispatcher.hint``), carried to the host without a sync.

A model predicts, one MoE layer early, which experts the next layer's decode tokens will route to and
hands the ids to the dispatcher before dispatching the current layer. :class:`HintBuffer` enqueues their
copy into pinned host memory on the compute stream; the current layer's own routing copy, enqueued
after it on the same stream, waits for the router anyway, so by the time the dispatcher has that
routing the hint has landed too and reading it costs no extra sync. The dispatcher then copies the
predicted experts that are not resident while PCIe would otherwise sit idle (the current layer's CPU
job, the next layer's attention).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class HintBuffer:
    """The latest hint: one ``(layer, ids)`` at a time, a newer one replacing an unread one."""

    layer: int | None = None
    _host: torch.Tensor | None = None
    _count: int = 0
    _landed: object | None = None  # a CUDA event recorded after the copy (None off CUDA)
    predicted: dict[int, set[int]] = field(default_factory=dict)  # layer -> experts hinted, until it dispatches

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Start copying ``topk_ids`` (any shape, int64, on any device) to the host, without waiting."""
        flat = topk_ids.reshape(-1)
        cuda = flat.is_cuda
        if self._host is None or self._host.numel() < flat.numel():
            self._host = torch.empty(max(flat.numel(), 64), dtype=torch.int64, pin_memory=cuda)
        self._host[: flat.numel()].copy_(flat, non_blocking=cuda)
        self._count = flat.numel()
        if cuda:
            if self._landed is None:
                self._landed = torch.cuda.Event()
            self._landed.record()
        self.layer = layer

    def take(self, layer: int) -> list[int]:
        """The experts hinted for ``layer``, most often predicted first ([] without such a hint); consumed.

        Normally the copy has landed already (module docstring); if not, this waits for it alone.
        """
        if self.layer != layer or self._host is None:
            return []
        if self._landed is not None:
            self._landed.synchronize()
        ids = self._host[: self._count].tolist()
        self.layer = None
        ranked = [expert for expert, _ in Counter(ids).most_common()]
        self.predicted[layer] = set(ranked)
        return ranked

    def score(self, layer: int, experts: list[int]) -> tuple[int, int]:
        """``(hinted, correct)`` for ``layer``'s call that routed to ``experts``: how many distinct experts
        were predicted for it, and how many of those it used ((0, 0) when it had no hint)."""
        hinted = self.predicted.pop(layer, None)
        if hinted is None:
            return 0, 0
        return len(hinted), len(hinted.intersection(experts))

    def clear(self) -> None:
        self.layer, self.predicted = None, {}
