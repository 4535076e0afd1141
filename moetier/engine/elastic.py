"""The elastic VRAM expert cache: expert slots make room for KV caches and come back when they are freed.

The placement plan (:mod:`moetier.tiers.plan`) reserves KV bytes for ``kv_reserve_streams`` streams of
the full context and gives the expert cache (``cache_slots``, the ceiling) what is left. When the
sequences running at once hold more KV than that reservation, the expert cache gives up whole slots to
make room; when their caches are freed it grows back toward the plan's size (and warms the new slots).

Contract (the engine drives it, :class:`moetier.engine.engine.Engine`):

- KV in use is the sum of ``nbytes`` of the runner's live per-sequence caches, reported on every
  allocation and free (:meth:`ElasticExpertBudget.allocated` / :meth:`~ElasticExpertBudget.freed`),
  plus, per cache, the per-stream state the plan expects that a fresh cache does not hold yet (V4's
  sliding window and open compressor windows fill up during forwards). Prefix-cache snapshots are not
  counted: the plan reserves their own budget (``prefix_cache_bytes``).
- Resizes happen only between steps: after the scheduler has planned a step and before the runner
  allocates the new sequences' caches and runs the forward (so the room exists before the KV lands),
  and when a cache is freed while nobody waits. Nothing is being computed then; the expert cache's own
  resize never evicts an expert that a running dispatch protects anyway.
- The cache never shrinks below ``min_slots`` (the floor, default ``top_k``). Over-commit is refused up
  front by the scheduler's KV-token budget: :func:`kv_token_cap` converts the KV reservation plus the
  borrowable slots ``(max_slots - min_slots) x block_bytes`` into KV tokens with the measured size of a
  cache (:class:`KvSizer`) and the engine lowers ``kv_token_budget`` to it, so a sequence whose KV the
  floor cannot make room for waits in the queue (FCFS) instead of being admitted. Should a cache still
  outgrow the measurement, the budget stays at the floor, counts an over-commit and logs a warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from moetier.errors import ConfigError

__all__ = ["ElasticConfig", "ElasticExpertBudget", "KvSizer", "kv_token_cap"]

log = logging.getLogger(__name__)


def _count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ElasticConfig:
    """The numbers an elastic budget works from; validated on construction (bytes and slot counts).

    ``reserved_kv_bytes``: KV the plan reserved; ``block_bytes``: one expert slot; ``max_slots``: the
    plan's cache size (the ceiling); ``min_slots``: the floor (at most ``max_slots``).
    """

    reserved_kv_bytes: int
    block_bytes: int
    max_slots: int
    min_slots: int

    def __post_init__(self) -> None:
        _count("reserved_kv_bytes", self.reserved_kv_bytes, 0)
        _count("block_bytes", self.block_bytes, 1)
        _count("max_slots", self.max_slots, 0)
        _count("min_slots", self.min_slots, 0)
        if self.min_slots > self.max_slots:
            raise ConfigError(f"min_cache_slots {self.min_slots} exceeds the plan's {self.max_slots} cache slots")

    @classmethod
    def from_plan(cls, plan: Any, min_slots: int | None = None) -> ElasticConfig:
        """From a :class:`~moetier.tiers.plan.PlacementPlan`; the floor defaults to ``top_k`` (capped by the plan)."""
        floor = plan.top_k if min_slots is None else min_slots
        return cls(plan.kv_bytes, plan.expert_block_bytes, plan.cache_slots, min(floor, plan.cache_slots))

    @property
    def borrowable_bytes(self) -> int:
        """KV bytes the expert cache can lend by shrinking from the ceiling to the floor."""
        return (self.max_slots - self.min_slots) * self.block_bytes

    @property
    def kv_limit_bytes(self) -> int:
        """The most KV that fits: the reservation plus every borrowable slot."""
        return self.reserved_kv_bytes + self.borrowable_bytes

    def slots_for(self, kv_bytes: int) -> int:
        """Cache slots that leave room for ``kv_bytes`` of KV: the ceiling minus whole slots for the excess
        over the reservation, never below the floor."""
        excess = max(0, kv_bytes - self.reserved_kv_bytes)
        return max(self.min_slots, self.max_slots - math.ceil(excess / self.block_bytes))


@dataclass(frozen=True)
class KvSizer:
    """A sequence cache's bytes for ``n`` KV tokens, ``stream_bytes + token_bytes * n``, measured on real caches."""

    token_bytes: float
    stream_bytes: int

    @classmethod
    def measure(cls, new_cache: Callable[[int], Any], span: int = 512) -> KvSizer:
        """Allocate caches of ``span`` and ``2 * span`` tokens with ``new_cache`` and fit the line through
        their ``nbytes`` (``span`` a multiple of every compression rate keeps compressed caches exact)."""
        small, large = new_cache(span).nbytes, new_cache(2 * span).nbytes
        per_token = (large - small) / span
        return cls(per_token, max(0, math.ceil(small - per_token * span)))

    def bytes_for(self, tokens: int) -> int:
        return math.ceil(self.stream_bytes + self.token_bytes * tokens)


def kv_token_cap(config: ElasticConfig, sizer: KvSizer, max_streams: int) -> int | None:
    """The KV-token budget under which ``max_streams`` sequences never need more than ``config.kv_limit_bytes``
    (None when a cache's size does not grow with tokens: nothing to cap)."""
    if sizer.token_bytes <= 0:
        return None
    room = config.kv_limit_bytes - max_streams * sizer.stream_bytes
    return max(1, int(room // sizer.token_bytes))


class ElasticExpertBudget:
    """Tracks the KV in use and sizes the expert cache to the VRAM it leaves; see the module docstring.

    ``resize(n_slots) -> slots reached`` is the dispatcher's ``resize_cache``; ``slots`` is the cache's
    size now (default the ceiling). ``sizer`` predicts the bytes of caches not allocated yet;
    ``unreported_stream_bytes`` is added to every reported cache (state it grows into later).
    Counters: ``resizes`` (= ``shrinks + grows``), ``overcommits`` (rebalances that needed more room than
    the floor allows), ``min_slots_seen``.
    """

    def __init__(
        self,
        config: ElasticConfig,
        resize: Callable[[int], int],
        slots: int | None = None,
        sizer: KvSizer | None = None,
        unreported_stream_bytes: int = 0,
        current: Callable[[], int] | None = None,
    ) -> None:
        _count("unreported_stream_bytes", unreported_stream_bytes, 0)
        self.config = config
        self._resize = resize
        self.slots = config.max_slots if slots is None else slots
        self.sizer = sizer
        self.unreported_stream_bytes = unreported_stream_bytes
        self._current = current  # the cache's real size, read back when a growth fails half-way
        self.kv_bytes = 0
        self._caches: dict[str, int] = {}
        self.resizes = self.shrinks = self.grows = self.overcommits = 0
        self.min_slots_seen = self.slots

    @classmethod
    def for_plan(
        cls, plan: Any, dispatcher: Any, new_cache: Callable[[int], Any], min_slots: int | None = None
    ) -> ElasticExpertBudget:
        """The budget of a :class:`~moetier.tiers.plan.PlacementPlan` over a prepared tiered ``dispatcher``
        (its ``resize_cache``), with caches measured through ``new_cache`` (the runner's allocator)."""
        sizer = KvSizer.measure(new_cache)
        unreported = max(0, plan.kv_stream_bytes - sizer.stream_bytes)
        sizer = replace(sizer, stream_bytes=sizer.stream_bytes + unreported)
        config = ElasticConfig.from_plan(plan, min_slots)
        cache = dispatcher.cache
        return cls(config, dispatcher.resize_cache, cache.n_slots, sizer, unreported, lambda: cache.n_slots)

    def kv_token_cap(self, max_streams: int) -> int | None:
        """:func:`kv_token_cap` with this budget's sizer (None without one)."""
        return None if self.sizer is None else kv_token_cap(self.config, self.sizer, max_streams)

    def pending_bytes(self, kv_tokens: list[int]) -> int:
        """Predicted bytes of caches about to be allocated for sequences of ``kv_tokens`` tokens each."""
        if self.sizer is None:
            return 0
        return sum(self.sizer.bytes_for(tokens) for tokens in kv_tokens)

    # --- what the runner reports --------------------------------------------------------------

    def allocated(self, key: str, nbytes: int) -> None:
        """A cache of ``nbytes`` now belongs to ``key`` (replacing any earlier one of that key)."""
        held = nbytes + self.unreported_stream_bytes
        self.kv_bytes += held - self._caches.get(key, 0)
        self._caches[key] = held

    def freed(self, key: str) -> None:
        self.kv_bytes -= self._caches.pop(key, 0)

    # --- sizing ----------------------------------------------------------------------------------

    @property
    def borrowing(self) -> bool:
        """Whether the KV held now takes memory beyond the plan's reservation (expert slots lent to it)."""
        return self.kv_bytes > self.config.reserved_kv_bytes

    def fits(self, kv_bytes: int) -> bool:
        """Whether ``kv_bytes`` of KV fit without shrinking the cache below its floor."""
        return kv_bytes <= self.config.kv_limit_bytes

    def rebalance(self, pending_bytes: int = 0) -> int:
        """Resize the cache for the KV in use plus ``pending_bytes`` about to be allocated; returns the slots.

        Call only between steps (never while a forward runs).
        """
        needed = self.kv_bytes + pending_bytes
        if not self.fits(needed):
            self.overcommits += 1
            log.warning(
                "KV needs %d bytes but at most %d fit with the expert cache at its floor of %d slots",
                needed,
                self.config.kv_limit_bytes,
                self.config.min_slots,
            )
        target = self.config.slots_for(needed)
        if target == self.slots:
            return self.slots
        before = self.slots
        try:
            self.slots = self._resize(target)
        except (RuntimeError, MemoryError) as exc:  # e.g. out of device memory while growing
            if target < before:
                raise
            self.slots = self._current() if self._current is not None else before
            log.warning("expert cache could not grow to %d slots (%s); staying at %d", target, exc, self.slots)
        if self.slots < before:
            self.shrinks += 1
        elif self.slots > before:
            self.grows += 1
        self.resizes = self.shrinks + self.grows
        self.min_slots_seen = min(self.min_slots_seen, self.slots)
        log.debug("expert cache %d -> %d slots (wanted %d) for %d bytes of KV", before, self.slots, target, needed)
        return self.slots

    def stats(self) -> dict[str, int]:
        """The engine's ``stats()`` fields for the elastic cache."""
        return {
            "expert_cache_slots": self.slots,
            "expert_cache_bytes": self.slots * self.config.block_bytes,
            "expert_cache_max_slots": self.config.max_slots,
            "expert_cache_min_slots": self.config.min_slots,
            "expert_cache_resizes": self.resizes,
            "kv_cache_bytes": self.kv_bytes,
            "kv_cache_reserved_bytes": self.config.reserved_kv_bytes,
        }
