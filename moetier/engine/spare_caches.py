"""Finished sequences' caches kept for the next ones, where decode graphs read caches in place.

DeepSeek-V4's decode graphs read and write the sequences' contiguous caches at fixed addresses, so they are keyed by
the caches (:mod:`moetier.models.deepseek_v4_step`): a new request's new cache means a step of eager warm-up and a
capture of every layer's graph, for it and for every batch it joins. In an agent session every turn is a new
request. A finished sequence's cache emptied in place (:meth:`SequenceCache.reset`) or filled with a cached prefix
(:meth:`SequenceCache.copy_into`) keeps its tensors, and the graphs captured over them replay for the next sequence.

Memory: the runner's live caches and the spares together hold at most ``limit`` caches (the engine's stream limit)
and ``token_budget`` tokens of capacity (its KV-token budget), so spares never take memory that the streams could
not have held at once; each spare is reported to the KV listener (the elastic expert budget) while it waits, as a
live cache is. A spare whose memory the expert cache could use (``reclaimable``: the KV held borrows expert slots
beyond the plan's reservation) is dropped after ``keep_seconds`` untaken (:meth:`SpareCaches.expire`): between an
agent's turns the expert cache keeps the size it will need again (growing back and shrinking again would copy
experts for nothing), and on a server left idle it takes the memory back. Memory nothing else could use (all
experts resident, or KV within the plan's reservation: the default plan reserves every stream's) keeps its spares
as long as they fit the bounds. The spare taken is the smallest that has room; without one a new cache is
allocated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from moetier.engine.model_runner import KvListener
    from moetier.engine.types import EngineConfig
    from moetier.models.base import SequenceCache


# Borrowed prefix snapshots (moetier.models.deepseek_v4_snapshot) the placement plan reserves VRAM for, per stream:
# a turn publishes its prompt's and its reply's, so a stream's last four turns stay servable (a retried turn too).
SNAPSHOTS_PER_STREAM = 8


def graphs_read_caches(model: object, paged: bool) -> bool:
    """Whether decode graphs read ``model``'s (a CausalLM or its class) caches in place: contiguous caches of a
    family with ``decode_graphs_read_caches`` (DeepSeek-V4). Its finished caches are worth keeping."""
    return not paged and bool(getattr(model, "decode_graphs_read_caches", False))


def borrowed_prefix_snapshots(hf_config: dict, config: EngineConfig, device: torch.device) -> int | None:
    """Before a checkpoint (its ``config.json``: ``hf_config``) loads: how many prefix snapshots a placement plan
    reserves VRAM for where they will borrow the kept caches' entries (``config`` keeps spare caches, the family's
    decode graphs read its contiguous caches); None where snapshots own their state (the whole prefix-cache bound)."""
    from moetier.engine.kv_sizing import resolve_kv_layout
    from moetier.models import model_class_for

    family = model_class_for(hf_config.get("architectures"))
    paged = resolve_kv_layout(config.kv_layout, family, device) == "paged"
    if config.spare_cache_seconds <= 0 or not graphs_read_caches(family, paged):
        return None
    return SNAPSHOTS_PER_STREAM * config.max_streams


@dataclass
class _Spare:
    cache: SequenceCache
    capacity: int  # tokens it holds
    key: str  # its name with the KV listener
    since: float  # when it became a spare (the clock's seconds)


def _lends(cache: SequenceCache) -> bool:
    """Whether a servable prefix snapshot borrows ``cache``'s memory (taking it would make that snapshot stale)."""
    return any(snapshot.servable for snapshot in getattr(cache, "borrowers", ()))


class SpareCaches:
    """Caches of finished sequences, each with its capacity in tokens, waiting for a sequence that fits one.

    :meth:`put` keeps a cache (dropping the oldest spares beyond the bounds), :meth:`take` hands out the smallest
    with room for a number of tokens, :meth:`make_room` drops spares so that a new cache fits the bounds, and
    :meth:`expire` those older than ``keep_seconds`` while ``reclaimable()`` says their memory could serve something
    else. ``taken`` and ``dropped`` count what happened."""

    def __init__(
        self,
        limit: int,
        token_budget: int,
        keep_seconds: float,
        listener: KvListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        reclaimable: Callable[[], bool] = lambda: True,
    ) -> None:
        if limit < 1 or token_budget < 1 or keep_seconds <= 0:
            raise ValueError(f"spare caches need a positive limit, token budget and keep time, got {limit}, "
                             f"{token_budget}, {keep_seconds}")  # fmt: skip
        self.limit, self.token_budget, self.keep_seconds = limit, token_budget, keep_seconds
        self.listener = listener
        self.clock = clock
        self.reclaimable = reclaimable
        self._spares: list[_Spare] = []  # oldest first
        self._serial = 0
        self.taken = self.dropped = 0

    def __len__(self) -> int:
        return len(self._spares)

    @property
    def tokens(self) -> int:
        """The spares' capacity, in tokens."""
        return sum(s.capacity for s in self._spares)

    def put(self, cache: SequenceCache, capacity: int, live: list[int]) -> None:
        """Keep ``cache`` (``capacity`` tokens) beside the live caches of ``live`` tokens each, within the bounds."""
        self._serial += 1
        spare = _Spare(cache, capacity, f"spare-cache-{self._serial}", self.clock())
        self._spares.append(spare)
        if self.listener is not None:
            self.listener.allocated(spare.key, cache.nbytes)
        self._trim(live, 0)

    def take(self, tokens: int, cache: SequenceCache | None = None) -> tuple[SequenceCache, int] | None:
        """``cache`` if it is a spare with room for ``tokens``, else (no ``cache``) the smallest spare with room,
        those no prefix snapshot borrows from first, with its capacity (no longer a spare); or None."""
        fitting = [s for s in self._spares if s.capacity >= tokens and (cache is None or s.cache is cache)]
        if not fitting:
            return None
        spare = min(fitting, key=lambda s: (_lends(s.cache), s.capacity))
        self._remove(spare)
        self.taken += 1
        return spare.cache, spare.capacity

    def unserved(self, wanted: list[int]) -> list[int]:
        """Of caches about to be taken for ``wanted`` tokens each, those no spare would serve (each, largest first,
        given the smallest spare left with room): what new allocations will need beyond the spares' memory."""
        free = sorted(s.capacity for s in self._spares)
        left = []
        for tokens in sorted(wanted, reverse=True):
            fit = next((i for i, capacity in enumerate(free) if capacity >= tokens), None)
            if fit is None:
                left.append(tokens)
            else:
                free.pop(fit)
        return left

    def make_room(self, live: list[int], tokens: int) -> None:
        """Drop the oldest spares until a new cache of ``tokens`` fits beside ``live`` and the rest."""
        self._trim(live, tokens)

    def expire(self) -> float | None:
        """Drop the spares that waited ``keep_seconds`` while their memory is reclaimable; the seconds until the next
        one would be dropped (None: none would, no spare or none reclaimable)."""
        now = self.clock()
        while self._spares and self.reclaimable() and now - self._spares[0].since >= self.keep_seconds:
            self._drop(self._spares[0])
        if not self._spares or not self.reclaimable():
            return None
        return self._spares[0].since + self.keep_seconds - now

    def _trim(self, live: list[int], incoming: int) -> None:
        extra = 1 if incoming else 0
        while self._spares and (
            len(live) + len(self._spares) + extra > self.limit or sum(live) + self.tokens + incoming > self.token_budget
        ):
            self._drop(self._spares[0])

    def _drop(self, spare: _Spare) -> None:
        self._remove(spare)
        self.dropped += 1

    def _remove(self, spare: _Spare) -> None:
        self._spares.remove(spare)
        if self.listener is not None:
            self.listener.freed(spare.key)
