"""Predicted experts of the next MoE layer (``ExpertDispatcher.hint``), carried to the host without a sync.

A model predicts, one MoE layer early, which experts the next layer's decode tokens will route to and
hands the ids to the dispatcher before dispatching the current layer. :class:`HintBuffer` enqueues their
copy into pinned host memory on the compute stream; the current layer's own routing copy, enqueued
after it on the same stream, waits for the router anyway, so by the time the dispatcher has that
routing the hint has landed too and reading it costs no extra sync. The dispatcher then copies the
predicted experts that are not resident while PCIe would otherwise sit idle (the current layer's CPU
job, the next layer's attention).

A wrong prediction is not free: its copy takes PCIe time and DRAM bandwidth from the misses the next
layer really has (and the CPU tier would have computed a right one beside the copies anyway). On the
scaled V4-Flash bench model, hints 57% precise made tiered decode 12-22% slower
(``results/h200-20261201-0e132ca``). So :class:`HintBuffer` also keeps, per rank of the prediction
(rank 0: the expert predicted most often, or first), how often that rank was right, and
:meth:`HintBuffer.trusted` prefetches only ranks whose decayed precision reaches ``min_precision``.
Scoring runs on every hinted call, so a rank that becomes reliable is picked up.
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
    predicted: dict[int, list[int]] = field(default_factory=dict)  # layer -> ranked hint, until it dispatches
    min_precision: float = 0.8
    min_samples: int = 16  # a rank is trusted only after this many (decayed) scored hints
    decay: float = 0.98  # per scored call: the precision follows the last ~50 calls
    _right: list[float] = field(default_factory=list)  # per rank: decayed count of right predictions
    _seen: list[float] = field(default_factory=list)  # per rank: decayed count of scored predictions

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
        self.predicted[layer] = ranked
        return ranked

    def trusted(self, ranked: list[int]) -> list[int]:
        """The experts of ``ranked`` (a :meth:`take`) whose rank has been right often enough to prefetch
        (all of them with ``min_precision`` 0: prefetch whatever is predicted)."""
        if self.min_precision <= 0:
            return ranked
        return [
            expert
            for rank, expert in enumerate(ranked)
            if rank < len(self._seen)
            and self._seen[rank] >= self.min_samples
            and self._right[rank] >= self.min_precision * self._seen[rank]
        ]

    def rank_precision(self) -> list[float]:
        """Decayed precision per rank (0 where unscored)."""
        return [right / seen if seen else 0.0 for right, seen in zip(self._right, self._seen, strict=True)]

    def score(self, layer: int, experts: list[int]) -> tuple[int, int]:
        """``(hinted, correct)`` for ``layer``'s call that routed to ``experts``: how many distinct experts
        were predicted for it, and how many of those it used ((0, 0) when it had no hint)."""
        ranked = self.predicted.pop(layer, None)
        if ranked is None:
            return 0, 0
        used = set(experts)
        while len(self._seen) < len(ranked):
            self._seen.append(0.0)
            self._right.append(0.0)
        for rank in range(len(self._seen)):
            self._seen[rank] *= self.decay
            self._right[rank] *= self.decay
        for rank, expert in enumerate(ranked):
            self._seen[rank] += 1.0
            self._right[rank] += float(expert in used)
        return len(ranked), len(used.intersection(ranked))

    def clear(self) -> None:
        """Forget the pending hint and every rank's record."""
        self.layer, self.predicted, self._right, self._seen = None, {}, [], []
