"""Which routed experts the VRAM expert cache keeps: the swappable policy, and its registry.

Keys are ``(layer, expert)`` pairs. The cache owns the slots and the residency map; a policy only
ranks. The cache tells the policy what became resident or left (:meth:`CachePolicy.inserted`,
:meth:`CachePolicy.removed`), the dispatcher tells it what each layer used at each step
(:meth:`CachePolicy.record`), and the cache asks it for victims and admission decisions.
"""

from __future__ import annotations

import heapq
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError

Key = tuple[int, int]


class CachePolicy(ABC):
    """Ranks cache entries; never moves weights itself.

    Contract:
    - ``record(layer, experts, counts, step)``: the layer used ``experts`` (distinct ids) at
      forward step ``step`` (non-decreasing), ``counts[i]`` tokens each. Called for every dispatch,
      hits and misses alike, *before* admissions for that dispatch are decided.
    - ``inserted(key)`` / ``removed(key)``: the cache made ``key`` resident / evicted it. The
      resident set a policy sees is exactly the one built from these calls.
    - ``choose_victim(protected)``: a resident key NOT in ``protected`` to evict next, or ``None``
      when every resident key is protected. ``protected`` holds the experts the current dispatch
      reads; a policy must never return one of them.
    - ``should_admit(key, victim)``: whether the missed ``key`` should take a slot, evicting
      ``victim`` (``None`` when a free slot exists). Default: always.
    - ``preferred(n)``: up to ``n`` keys the cache should load up front (and when it grows);
      default none (start cold).
    """

    name = "abstract"

    @abstractmethod
    def record(self, layer: int, experts: Sequence[int], counts: Sequence[int], step: int) -> None: ...

    @abstractmethod
    def inserted(self, key: Key) -> None: ...

    @abstractmethod
    def removed(self, key: Key) -> None: ...

    @abstractmethod
    def choose_victim(self, protected: Container[Key]) -> Key | None: ...

    def should_admit(self, key: Key, victim: Key | None) -> bool:
        return True

    def preferred(self, n: int) -> list[Key]:
        return []


POLICIES: dict[str, Callable[..., CachePolicy]] = {}


def register_policy(name: str):
    """Class decorator: make a policy available to :func:`make_policy` under ``name``."""

    def wrap(cls: type[CachePolicy]) -> type[CachePolicy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap


def make_policy(name: str, **options: Any) -> CachePolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown expert cache policy {name!r}; known: {sorted(POLICIES)}") from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigError(f"bad options for cache policy {name!r}: {exc}") from None


@register_policy("lru")
class LRUPolicy(CachePolicy):
    """Evict the resident expert whose last use is oldest; admit every miss.

    Good when the cache holds a couple of layers' working sets (consecutive tokens reuse experts).
    """

    def __init__(self) -> None:
        self._resident: OrderedDict[Key, None] = OrderedDict()  # oldest use first

    def record(self, layer: int, experts: Sequence[int], counts: Sequence[int], step: int) -> None:
        for expert in experts:
            key = (layer, expert)
            if key in self._resident:
                self._resident.move_to_end(key)

    def inserted(self, key: Key) -> None:
        # A newly admitted expert was just used: it is the most recent.
        self._resident[key] = None
        self._resident.move_to_end(key)

    def removed(self, key: Key) -> None:
        self._resident.pop(key, None)

    def choose_victim(self, protected: Container[Key]) -> Key | None:
        return next((key for key in self._resident if key not in protected), None)


@register_policy("lfu")
class DecayedFrequencyPolicy(CachePolicy):
    """Frequency with exponential decay: an expert's score is its tokens routed, halved every ``half_life`` steps.

    Hot experts over a window of roughly ``half_life`` steps stay pinned: a miss is admitted only
    into a free slot or when its score beats the lowest-scored evictable resident, so a one-off
    expert cannot push out a hot one. Scores are stored scaled by ``2**((step - base) / half_life)``
    so only the accessed entries change per step; the scale is renormalised before it overflows.
    """

    _RENORMALISE_HALF_LIVES = 256

    def __init__(self, half_life: float = 64.0) -> None:
        if not half_life > 0:
            raise ConfigError(f"lfu half_life must be > 0 steps, got {half_life}")
        self.half_life = float(half_life)
        self._base = 0
        self._step = 0
        self._score: dict[Key, float] = {}
        self._resident: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []  # (score, tick, key): lazy, stale entries skipped
        self._tick = 0

    def score(self, key: Key) -> float:
        """The decayed score at the current step (tokens, each halved per ``half_life`` steps since)."""
        return self._score.get(key, 0.0) * 2.0 ** (-(self._step - self._base) / self.half_life)

    def record(self, layer: int, experts: Sequence[int], counts: Sequence[int], step: int) -> None:
        self._step = max(self._step, step)
        if (self._step - self._base) > self._RENORMALISE_HALF_LIVES * self.half_life:
            self._renormalise()
        weight = 2.0 ** ((self._step - self._base) / self.half_life)
        for expert, count in zip(experts, counts, strict=True):
            key = (layer, expert)
            self._score[key] = self._score.get(key, 0.0) + count * weight
            if key in self._resident:
                self._push(key)

    def inserted(self, key: Key) -> None:
        self._resident.add(key)
        self._push(key)

    def removed(self, key: Key) -> None:
        self._resident.discard(key)

    def choose_victim(self, protected: Container[Key]) -> Key | None:
        skipped: list[tuple[float, int, Key]] = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            score, _, key = entry
            if key not in self._resident or score != self._score.get(key, 0.0):
                continue  # stale: evicted, or re-scored since this entry was pushed
            if key in protected:
                skipped.append(entry)
                continue
            victim = key
            skipped.append(entry)  # stays resident until the cache calls removed()
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return victim

    def should_admit(self, key: Key, victim: Key | None) -> bool:
        return victim is None or self._score.get(key, 0.0) > self._score.get(victim, 0.0)

    def _push(self, key: Key) -> None:
        self._tick += 1
        heapq.heappush(self._heap, (self._score.get(key, 0.0), self._tick, key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(self._score.get(key, 0.0), i, key) for i, key in enumerate(sorted(self._resident))]
        heapq.heapify(self._heap)

    def _renormalise(self) -> None:
        scale = 2.0 ** (-(self._step - self._base) / self.half_life)
        self._score = {key: s * scale for key, s in self._score.items() if s * scale > 1e-300}
        self._base = self._step
        self._rebuild_heap()


@register_policy("static")
class StaticPolicy(CachePolicy):
    """A fixed set chosen from recorded routing statistics: the most-routed experts fill the cache and never move.

    ``stats`` (or the JSON file ``stats_path``) maps layer -> per-expert token counts, either as a
    list indexed by expert or as ``{expert: count}`` (see :func:`load_routing_stats`). Experts are
    ranked by count over all layers (ties: lower layer, then lower expert first). Misses are never
    admitted; victims (only needed when the cache shrinks) are the lowest-ranked residents.
    """

    def __init__(self, stats: Mapping | None = None, stats_path: str | Path | None = None) -> None:
        if (stats is None) == (stats_path is None):
            raise ConfigError("static cache policy needs exactly one of stats= or stats_path=")
        counts = load_routing_stats(stats_path) if stats is None else normalise_routing_stats(stats)
        ranked = sorted(
            ((layer, expert) for layer, table in counts.items() for expert in table),
            key=lambda key: (-counts[key[0]][key[1]], key),
        )
        self.ranking: list[Key] = ranked
        self._rank = {key: i for i, key in enumerate(ranked)}
        self._resident: set[Key] = set()

    def record(self, layer: int, experts: Sequence[int], counts: Sequence[int], step: int) -> None:
        """Static: accesses do not change the set."""

    def inserted(self, key: Key) -> None:
        self._resident.add(key)

    def removed(self, key: Key) -> None:
        self._resident.discard(key)

    def choose_victim(self, protected: Container[Key]) -> Key | None:
        unranked = len(self._rank)
        candidates = [key for key in self._resident if key not in protected]
        return max(candidates, key=lambda key: (self._rank.get(key, unranked), key), default=None)

    def should_admit(self, key: Key, victim: Key | None) -> bool:
        return False

    def preferred(self, n: int) -> list[Key]:
        return self.ranking[:n]


def normalise_routing_stats(stats: Mapping) -> dict[int, dict[int, int]]:
    """``{layer: {expert: count}}`` with int keys from a list- or dict-valued mapping (JSON keys are strings)."""
    out: dict[int, dict[int, int]] = {}
    try:
        for layer, table in stats.items():
            items = table.items() if isinstance(table, Mapping) else enumerate(table)
            row = {int(expert): int(count) for expert, count in items}
            if any(count < 0 for count in row.values()):
                raise ValueError("negative count")
            out[int(layer)] = row
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"routing statistics must map layer -> per-expert counts ({exc})") from None
    return out


def load_routing_stats(path: str | Path) -> dict[int, dict[int, int]]:
    """Read routing statistics written by :func:`save_routing_stats` (or by hand, same shape)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read routing statistics {path}: {exc}") from None
    return normalise_routing_stats(data.get("layers", data) if isinstance(data, dict) else data)


def save_routing_stats(counts: Mapping[int, Mapping[int, int]], path: str | Path) -> None:
    """Write ``{layer: {expert: count}}`` (e.g. ``TierMetrics.routing_counts()``) as JSON for the static policy."""
    payload = {"layers": {str(layer): {str(e): int(c) for e, c in sorted(t.items())} for layer, t in counts.items()}}
    Path(path).write_text(json.dumps(payload, indent=1))
