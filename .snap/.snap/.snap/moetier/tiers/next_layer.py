"""Copies ahead of the next MoE layer: a call's guess of which experts that layer will need, into free staging slots.

A streaming call (a prefill chunk) guesses from what the next layer used in the previous chunk (for a first chunk
that covers most experts, all of them in id order), so the copy engine keeps moving while attention runs between
the two layers. A decode call takes the model's hints (:meth:`ExpertDispatcher.hint`) for the next layer and copies
the trusted ones that are not resident (:mod:`moetier.tiers.hints`). Both copies are counted as PCIe traffic of
the layer they serve, and the hints are scored against what that layer then used.
"""

from __future__ import annotations

from collections.abc import Iterable

from moetier.tiers.expert_cache import ExpertCache
from moetier.tiers.hints import HintBuffer
from moetier.tiers.metrics import TierMetrics


class NextLayerPrefetch:
    """The streaming history and the hints of a tiered dispatcher, and the prefetches they start.

    ``moe_layers`` orders the layers (the last one's next is the first: the next chunk's); ``floor`` is the fewest
    tokens an expert of a streaming call needs to be worth copying (0: the call sends nothing to the device).
    """

    def __init__(self, moe_layers: Iterable[int], num_experts: int, floor: int, hints: HintBuffer) -> None:
        moe = sorted(moe_layers)
        self.next_layer = dict(zip(moe, moe[1:] + moe[:1], strict=True))
        self.num_experts, self.floor, self.hints = num_experts, floor, hints
        self._history: dict[int, list[int]] = {}  # layer -> experts its last streaming call used, fat first

    def remember_streamed(self, layer: int, experts: list[int], counts: list[int]) -> None:
        """Keep the experts this streaming call sends to the device, most tokens first: the next chunk's guess."""
        if not self.floor:
            self._history[layer] = []
            return
        ranked = sorted(zip(counts, experts, strict=True), reverse=True)
        self._history[layer] = [expert for count, expert in ranked if count >= self.floor]

    def prefetch_streamed(self, layer: int, pairs: int, cache: ExpertCache, metrics: TierMetrics) -> None:
        """Start copying the next MoE layer's likely experts into the free staging slots (a streaming call of
        ``pairs`` (token, expert) pairs)."""
        if not self.floor:
            return
        nxt = self.next_layer[layer]
        guess = self._history.get(nxt)
        if guess is None:
            if pairs < 4 * self.num_experts:
                return  # a small first chunk touches few experts: a guess would mostly waste PCIe
            guess = range(self.num_experts)
        counters = metrics.layer(nxt)
        for expert in guess:
            if cache.free_staging == 0:
                return
            if cache.prefetch((nxt, expert)):
                counters.copy_bytes += cache.block_bytes
                counters.prefetch_bytes += cache.block_bytes

    def prefetch_hinted(self, layer: int, limit: int, cache: ExpertCache, metrics: TierMetrics) -> None:
        """Copy up to ``limit`` of the next MoE layer's trusted hinted experts that are not resident (decode)."""
        nxt = self.next_layer[layer]
        counters, started = metrics.layer(nxt), 0
        for expert in self.hints.trusted(self.hints.take(nxt)):
            if started == limit or cache.free_staging == 0:
                return
            if cache.prefetch((nxt, expert)):
                started += 1
                counters.copy_bytes += cache.block_bytes
                counters.prefetch_bytes += cache.block_bytes

    def score_hint(self, layer: int, experts: list[int], metrics: TierMetrics) -> None:
        """Count how many of the experts hinted for ``layer`` its call then used."""
        hinted, correct = self.hints.score(layer, experts)
        if hinted:
            counters = metrics.layer(layer)
            counters.hint_experts += hinted
            counters.hint_correct += correct
            counters.hint_actual += len(experts)
